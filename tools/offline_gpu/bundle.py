"""The one way files travel between this machine and a GPU host without internet: a named set of
files as one tar.gz, cut into chunks (each at most CHUNK bytes), and a manifest with the whole
tar's sha256. A command there or here moves what fits its limit; the set is joined, checked and
unpacked only once every chunk has arrived, so a damaged or partial set unpacks nothing.

    pack(name, members, staging)    the set (member path, name in the set) in chunks under staging;
                                    kept when the same files were packed before (a second `send`
                                    goes on with the first one's set)
    send(name, staging, out, max)   the chunks not sent yet, up to max bytes, into out (a call's $OUT)
    collect(name, src, dst, max)    the chunks in src into dst/1, dst/2, ... (one carried folder each,
                                    max bytes); a newer set replaces them only once it is whole
    receive(src, stash)             a carried folder's chunks into stash (every set it holds)
    unpack(name, stash, place)      each member to place(member name) (None: skipped), each file
                                    whole or not at all; None while a chunk is missing"""

import hashlib
import json
import shutil
import tarfile
from pathlib import Path
from typing import Callable

CHUNK = 14 * 2**20  # a command returns files of <= 16 MiB; four fill one carried folder


def _manifest_path(name: str, where: Path) -> Path:
    return where / f"{name}.json"


def manifest(name: str, where: Path) -> dict | None:
    """The set's manifest in `where` or in one of its numbered folders; None if there is none."""
    found = [_manifest_path(name, where), *sorted(where.glob(f"*/{name}.json"))]
    return next((json.loads(p.read_text()) for p in found if p.is_file()), None)


def pack(name: str, members: list[tuple[Path, str]], staging: Path) -> dict:
    # a member's listing line: its name, and its size and time (a checkpoint that moved on keeps its name)
    listing = hashlib.sha256(
        "\n".join(f"{arc} {p.stat().st_size} {p.stat().st_mtime_ns}" for p, arc in members).encode()
    ).hexdigest()
    old = manifest(name, staging) if staging.is_dir() else None
    if old is not None and old["listing"] == listing:
        return old
    for f in staging.glob(f"{name}.*"):
        f.unlink()
    staging.mkdir(parents=True, exist_ok=True)
    tgz = staging / f"{name}.tgz"
    with tarfile.open(tgz, "w:gz", compresslevel=1) as tar:  # wheels and floats barely compress
        for p, arc in members:
            tar.add(p, arcname=arc)
    digest, chunks = hashlib.sha256(), []
    with open(tgz, "rb") as f:
        while piece := f.read(CHUNK):
            digest.update(piece)
            chunks.append(f"{name}.tgz.{len(chunks):03d}")
            (staging / chunks[-1]).write_bytes(piece)
    tgz.unlink()
    m = {"name": name, "sha256": digest.hexdigest(), "chunks": chunks, "members": [a for _, a in members],
         "listing": listing, "sent": []}  # fmt: skip
    _manifest_path(name, staging).write_text(json.dumps(m, indent=1))
    return m


def send(name: str, staging: Path, out: Path, max_bytes: int) -> list[str]:
    """Returns the chunks still left to send."""
    m = manifest(name, staging)
    out.mkdir(parents=True, exist_ok=True)
    used = 0
    for c in m["chunks"]:
        size = (staging / c).stat().st_size
        if c not in m["sent"] and used + size <= max_bytes:
            shutil.copyfile(staging / c, out / c)
            m["sent"].append(c)
            used += size
    _manifest_path(name, staging).write_text(json.dumps(m, indent=1))
    shutil.copyfile(_manifest_path(name, staging), _manifest_path(name, out))
    return [c for c in m["chunks"] if c not in m["sent"]]


def collect(name: str, src: Path, dst: Path, max_bytes: int) -> list[Path]:
    """A newer set (another sha256) is laid out in dst/next/ and replaces dst's folders once all its
    chunks are there: a session cut short leaves the older whole set in place."""
    new = manifest(name, src)
    if new is None:
        raise SystemExit(f"{src}: no {name}.json (not a set that `save` or `wheels` made)")
    have = manifest(name, dst) if dst.is_dir() else None
    into = dst if have is None or have["sha256"] == new["sha256"] else dst / "next"
    if into != dst and into.is_dir() and manifest(name, into)["sha256"] != new["sha256"]:
        shutil.rmtree(into)  # an even newer set: start that one again
    folders = sorted(into.glob("[0-9]*"), key=lambda d: int(d.name))
    size = lambda d: sum(p.stat().st_size for p in d.glob(f"{name}.tgz.*"))  # noqa: E731
    for piece in sorted(src.glob(f"{name}.tgz.*")):
        if any((d / piece.name).exists() for d in folders):
            continue
        if not folders or size(folders[-1]) + piece.stat().st_size > max_bytes:
            folders.append(into / str(len(folders) + 1))
            folders[-1].mkdir(parents=True)
        shutil.copyfile(piece, folders[-1] / piece.name)
    for d in folders:
        _manifest_path(name, d).write_text(json.dumps(new, indent=1))
    there = {p.name for d in folders for p in d.glob(f"{name}.tgz.*")}
    missing = [c for c in new["chunks"] if c not in there]
    if into != dst and not missing:
        for d in dst.glob("[0-9]*"):
            shutil.rmtree(d)
        folders = [d.rename(dst / d.name) for d in folders]
        into.rmdir()
        into = dst
    note = f"; missing {len(missing)}" + (f" (the older whole set stays in {dst})" if into != dst else "")
    print(f"{into}: {len(there)} of {len(new['chunks'])} chunks of {name} in {len(folders)} folder(s)"
          + (note if missing else ""))  # fmt: skip
    return folders


def receive(src: Path, stash: Path) -> dict[str, tuple[int, int]]:
    """Every set in the folder src into stash (a set of another sha256 there is replaced); per set,
    (chunks there, chunks in it)."""
    stash.mkdir(parents=True, exist_ok=True)
    out = {}
    for mp in sorted(src.glob("*.json")):
        m = json.loads(mp.read_text())
        if "chunks" not in m:
            continue
        old = manifest(m["name"], stash)
        if old is not None and old["sha256"] != m["sha256"]:
            for f in stash.glob(f"{m['name']}.*"):
                f.unlink()
        for p in [*src.glob(f"{m['name']}.tgz.*"), mp]:
            shutil.copyfile(p, stash / p.name)
        out[m["name"]] = (sum((stash / c).exists() for c in m["chunks"]), len(m["chunks"]))
    if not out:
        raise SystemExit(f"{src}: no set's manifest in it (a carried folder holds <name>.json)")
    return out


def _joined(name: str, src: Path, into: Path) -> Path | None:
    m = manifest(name, src)
    pieces = {p.name: p for p in [*src.glob(f"{name}.tgz.*"), *src.glob(f"*/{name}.tgz.*")]}
    if m is None or any(c not in pieces for c in m["chunks"]):
        return None
    digest = hashlib.sha256()
    with open(into, "wb") as f:
        for c in m["chunks"]:
            piece = pieces[c].read_bytes()
            digest.update(piece)
            f.write(piece)
    if digest.hexdigest() != m["sha256"]:
        into.unlink()
        raise SystemExit(f"{src}: the chunks of {name} do not add up to its sha256 (a damaged or mixed set)")
    return into


def unpack(name: str, src: Path, place: Callable[[str], Path | None]) -> list[str] | None:
    """The members unpacked (in the set's order), or None while the set is not whole in src."""
    tgz = _joined(name, src, src / f".{name}.joining")
    if tgz is None:
        return None
    done = []
    try:
        with tarfile.open(tgz) as tar:
            for m in tar.getmembers():
                dst = place(m.name) if m.isfile() else None
                if dst is None:
                    continue
                dst.parent.mkdir(parents=True, exist_ok=True)
                tmp = dst.with_name(f".{dst.name}.tmp")
                try:
                    with open(tmp, "wb") as f:
                        shutil.copyfileobj(tar.extractfile(m), f)
                    tmp.replace(dst)  # by rename: a file DVC linked into its cache is never written through
                finally:
                    tmp.unlink(missing_ok=True)
                done.append(m.name)
    finally:
        tgz.unlink()
    return done


def read(name: str, src: Path, wanted: Callable[[str], bool]) -> dict[str, bytes]:
    """The bytes of the set's members that `wanted` names, from a whole set in src (else nothing)."""
    tgz = _joined(name, src, src / f".{name}.reading")
    if tgz is None:
        return {}
    try:
        with tarfile.open(tgz) as tar:
            return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile() and wanted(m.name)}
    finally:
        tgz.unlink()
