"""DVC run-cache entries of chosen stages, with their outputs, carried between GPU hosts without internet through
this one in pieces a bounded command can move (files of <= 16 MiB, <= 64 MiB a call). A fresh machine that
loads them restores those stages as DVC restores any stage run ("Stage ... is cached") instead of
running them again.

    pack(cache, stages, staging, extra)
                                      on the machine: the entries and their objects in one tar.gz, in
                                      chunks under `staging`, with a manifest (count, sha256, entries);
                                      `extra` files go with them (a training checkpoint: a run that
                                      goes on on the next machine)
    send(staging, out, max_bytes)     the chunks not sent yet, up to max_bytes, into `out` (the call's
                                      $OUT); again in the next call until none is left
    collect(src, dst, max_bytes)      here: the returned files into dst/1, dst/2, ... each one call's carry
                                      (a newer set replaces them only once it is whole)
    receive(src, stash)               on the next machine, once per carried folder: its chunks into stash;
                                      unpack(stash, cache, root) once every chunk is there
    gather(src)                       the whole tar.gz (sha256-checked) from src and its folders
    contents(src, stages, extras)     its commands, the reports of those stages and those extra files

A chunk set is named by its manifest's sha256: a new set (a later session's) replaces the old one."""

import hashlib
import json
import shutil
import tarfile
from pathlib import Path

import yaml

from eaglenest.files.atomic import replaced_file

CHUNK = 14 * 2**20  # a bounded command brings back files of <= 16 MiB; four fill one carried folder
MANIFEST = "runcache.json"
NAME = "runcache.tgz"
EXTRA = "extra/"  # the tar's members that are not DVC cache files: `extra`'s, by their relative path


def entries(cache: Path, stages: tuple[str, ...]) -> list[Path]:
    """The run-cache entries of commands starting with one of `stages` whose outputs are all in the
    cache (a directory output: its .dir listing and every file of it), then those objects."""
    objects = cache / "files" / "md5"
    obj = lambda md5: objects / md5[:2] / md5[2:]  # noqa: E731
    members = []
    for entry in sorted((cache / "runs").glob("*/*/*")):
        run = yaml.safe_load(entry.read_text())
        if not run.get("cmd", "").startswith(stages):
            continue
        need = []
        for o in run.get("outs") or []:
            need.append(obj(o["md5"]))
            if o["md5"].endswith(".dir") and need[-1].exists():
                need += [obj(f["md5"]) for f in json.loads(need[-1].read_text())]
        if all(p.exists() for p in need):
            members += [entry, *need]
    return list(dict.fromkeys(members))


def _stamp(f: Path, name: str) -> str:
    """A member as the listing names it: a cache file by its name (named by its content), an extra
    file also by its size and time (a checkpoint that moved on keeps its name)."""
    return f"{name} {f.stat().st_size} {f.stat().st_mtime_ns}" if name.startswith(EXTRA) else name


def pack(cache: Path, stages: tuple[str, ...], staging: Path, extra: dict[str, Path] | None = None) -> dict:
    """The entries, and the `extra` files (relative path there -> file here), in chunks under staging
    (kept when the same files were packed before, so a second `send` continues the first one's set)."""
    members = [(m, str(m.relative_to(cache))) for m in entries(cache, stages)]
    members += [(f, EXTRA + rel) for rel, f in sorted((extra or {}).items())]
    listing = hashlib.sha256("\n".join(_stamp(*m) for m in members).encode()).hexdigest()
    old = staging / MANIFEST
    if old.exists() and json.loads(old.read_text()).get("listing") == listing:
        return json.loads(old.read_text())
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    tgz = staging / NAME
    with tarfile.open(tgz, "w:gz", compresslevel=1) as tar:  # a checkpoint's floats barely compress
        for m, name in members:
            tar.add(m, arcname=name)
    digest, chunks = hashlib.sha256(), []
    with open(tgz, "rb") as f:
        while piece := f.read(CHUNK):
            digest.update(piece)
            chunks.append(f"{NAME}.{len(chunks):03d}")
            (staging / chunks[-1]).write_bytes(piece)
    tgz.unlink()
    runs = sum(1 for _, name in members if name.startswith("runs/"))
    extras = [name.removeprefix(EXTRA) for _, name in members if name.startswith(EXTRA)]
    manifest = {
        "sha256": digest.hexdigest(),
        "chunks": chunks,
        "runs": runs,
        "extra": extras,
        "listing": listing,
        "sent": [],
    }
    old.write_text(json.dumps(manifest, indent=1))
    return manifest


def send(staging: Path, out: Path, max_bytes: int) -> list[str]:
    """Chunks not sent yet into out, up to max_bytes; returns those still left."""
    manifest = json.loads((staging / MANIFEST).read_text())
    out.mkdir(parents=True, exist_ok=True)
    used = 0
    for name in manifest["chunks"]:
        size = (staging / name).stat().st_size
        if name in manifest["sent"] or used + size > max_bytes:
            continue
        shutil.copyfile(staging / name, out / name)
        manifest["sent"].append(name)
        used += size
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
    shutil.copyfile(staging / MANIFEST, out / MANIFEST)
    return [c for c in manifest["chunks"] if c not in manifest["sent"]]


def _manifest(src: Path) -> dict | None:
    found = [src / MANIFEST, *sorted(src.glob(f"*/{MANIFEST}"))]
    return next((json.loads(p.read_text()) for p in found if p.exists()), None)


def collect(src: Path, dst: Path, max_bytes: int, keep=("points.tgz",)) -> list[Path]:
    """The chunks a bounded command returned (src) added to dst's numbered folders of <= max_bytes each; the
    set's manifest and the files named in `keep` go into every folder. A newer set (another manifest)
    is laid out in dst/next/ and replaces dst's folders only once every chunk of it is there: a session
    whose save calls were cut short leaves the older whole set in place."""
    if not (src / MANIFEST).exists():
        raise SystemExit(f"{src}: no {MANIFEST} (not what bench.gpu_curve save returns)")
    new = json.loads((src / MANIFEST).read_text())
    have = _manifest(dst) if dst.exists() else None
    into = dst if have is None or have["sha256"] == new["sha256"] else dst / "next"
    pending = _manifest(into) if into != dst and into.exists() else None
    if pending is not None and pending["sha256"] != new["sha256"]:  # a newer set still: start it again
        shutil.rmtree(into)
    folders = sorted(into.glob("[0-9]*"), key=lambda d: int(d.name))
    size = lambda d: sum(p.stat().st_size for p in d.glob(f"{NAME}.*"))  # noqa: E731
    for piece in sorted(src.glob(f"{NAME}.*")):
        if any((d / piece.name).exists() for d in folders):
            continue
        if not folders or size(folders[-1]) + piece.stat().st_size > max_bytes:
            folders.append(into / str(len(folders) + 1))
            folders[-1].mkdir(parents=True)
        shutil.copyfile(piece, folders[-1] / piece.name)
    for d in folders:
        (d / MANIFEST).write_text(json.dumps(new, indent=1))
        for k in keep:
            if (src / k).exists():
                shutil.copyfile(src / k, d / k)
    there = {p.name for d in folders for p in d.glob(f"{NAME}.*")}
    missing = [c for c in new["chunks"] if c not in there]
    if into != dst and not missing:  # the newer set is whole: it replaces the older one
        for d in dst.glob("[0-9]*"):
            shutil.rmtree(d)
        folders = [d.rename(dst / d.name) for d in folders]
        into.rmdir()
        into = dst
    state = f"{into}: {len(there)} of {len(new['chunks'])} chunks in {len(folders)} folder(s)"
    if missing:
        state += f"; missing {missing}" + (f" (the whole older set stays in {dst})" if into != dst else "")
    print(state)
    return folders


def gather(src: Path, into: Path) -> Path | None:
    """The set's whole tar.gz at `into` from the chunks in src and its folders, its sha256 checked;
    None while a chunk is missing (or there is no set)."""
    manifest = _manifest(src)
    if manifest is None:
        return None
    pieces = {p.name: p for p in [*src.glob(f"{NAME}.*"), *src.glob(f"*/{NAME}.*")]}
    if any(c not in pieces for c in manifest["chunks"]):
        return None
    digest = hashlib.sha256()
    with open(into, "wb") as f:
        for c in manifest["chunks"]:
            piece = pieces[c].read_bytes()
            digest.update(piece)
            f.write(piece)
    if digest.hexdigest() != manifest["sha256"]:
        into.unlink()
        raise SystemExit(f"{src}: the chunks of {NAME} do not add up to its sha256 (a damaged or mixed set)")
    return into


def receive(src: Path, stash: Path) -> tuple[int, int]:
    """One carried folder's chunks and manifest into stash; returns (chunks there, chunks in the set)."""
    manifest = _manifest(src)
    if manifest is None:
        raise SystemExit(f"{src}: no {MANIFEST} (bench.gpu_curve collect lays the carried folders out)")
    old = _manifest(stash) if stash.exists() else None
    if old is not None and old["sha256"] != manifest["sha256"]:
        shutil.rmtree(stash)
    stash.mkdir(parents=True, exist_ok=True)
    for p in [*src.glob(f"{NAME}.*"), src / MANIFEST]:
        shutil.copyfile(p, stash / p.name)
    return sum((stash / c).exists() for c in manifest["chunks"]), len(manifest["chunks"])


def unpack(stash: Path, cache: Path, root: Path | None = None) -> int | None:
    """The set into a DVC cache once complete, and its extra files under `root` (each whole or not at
    all: written beside, then renamed); the number of stage runs it restored, or None."""
    tgz = gather(stash, stash / f".{NAME}")
    if tgz is None:
        return None
    try:
        with tarfile.open(tgz) as tar:
            members = tar.getmembers()
            tar.extractall(cache, members=[m for m in members if not m.name.startswith(EXTRA)], filter="data")
            for m in members if root is not None else []:
                if m.isfile() and m.name.startswith(EXTRA):
                    dst = root / m.name.removeprefix(EXTRA)
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    with replaced_file(dst) as tmp, open(tmp, "wb") as f:
                        shutil.copyfileobj(tar.extractfile(m), f)
            return sum(1 for m in members if m.name.startswith("runs/"))
    finally:
        tgz.unlink()


def contents(src: Path, stages=(), extras=()) -> tuple[list[str], dict[str, dict[str, dict]], dict[str, bytes]]:
    """The commands of the set's runs, the reports/<stage>/<part>.json outputs of those runs for each of
    `stages`, and the bytes of those of the `extras` files it carries (relative paths, as pack's
    `extra`), from one read of the set at src (as gather; nothing where it holds no whole set)."""
    commands, found, carried = [], {stage: {} for stage in stages}, {}
    tgz = gather(src, src / f".{NAME}.reading")
    if tgz is None:
        return commands, found, carried
    try:
        with tarfile.open(tgz) as tar:
            for m in tar.getmembers():
                if m.name.startswith(EXTRA) and m.name.removeprefix(EXTRA) in extras:
                    carried[m.name.removeprefix(EXTRA)] = tar.extractfile(m).read()
                if not m.name.startswith("runs/"):
                    continue
                run = yaml.safe_load(tar.extractfile(m))
                commands.append(run["cmd"])
                for o in run.get("outs") or []:
                    top, stage, *rest = Path(o["path"]).parts + ("",)
                    if top == "reports" and stage in found and len(rest) == 2:  # reports/<stage>/<part>.json
                        obj = tar.extractfile(f"files/md5/{o['md5'][:2]}/{o['md5'][2:]}")
                        found[stage][Path(o["path"]).stem] = json.load(obj)
    finally:
        tgz.unlink()
    return commands, found, carried
