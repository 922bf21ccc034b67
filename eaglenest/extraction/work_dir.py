"""A part's extraction work dir, the lock that keeps two runs of one part apart, and publishing the
finished store without ever destroying the previous good one first.

    <work_root>/<part>.lock                 flock'ed by the running extraction; holds its PID
    <work_root>/<part>-<key 20 hex>/        one per (input, extractor, layout)
        store/                              the zarr store being filled
        created                             written once store/ is completely created
        pieces/<i>.json                     piece manifests: a manifest commits a piece

Work dirs are 0700 (created by this user for this user: nothing in them is meant for others) and
owned exactly: a part's clean-up matches `<part>-<20 hex>` only, never another part whose name
starts with this one's (`chat` and `chat-v2`)."""

import fcntl
import json
import logging
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

import zarr

from eaglenest.files.atomic import fsync_path, write_json
from eaglenest.runtime.errors import EaglenestError
from eaglenest.store.checksums import write_checksums
from eaglenest.store.hidden_store import Layout, create_arrays

log = logging.getLogger(__name__)
KEY_CHARS = 20


class WorkDir:
    def __init__(self, root: Path, part: str, key: str):
        self.root, self.part = Path(root), part
        self.path = self.root / f"{part}-{key[:KEY_CHARS]}"
        self.store = self.path / "store"
        self.manifests = self.path / "pieces"
        self.marker = self.path / "created"

    def open_store(self, layout: Layout, n_pieces: int, attrs: dict) -> zarr.Group:
        """The work store, as created to the end or reopened; a store of another extraction is an error."""
        if self.is_complete():
            group = zarr.open_group(str(self.store), mode="r+")
            old = dict(group.attrs)
            if old.get("work_key") != attrs["work_key"]:
                raise EaglenestError(f"{self.store}: work store belongs to another extraction; delete it")
            return group
        if self.path.exists():
            log.warning(
                "%s: the work dir was never completely created (a crash or a full disk); rebuilding it", self.path
            )
        self.reset()  # nothing is committed before the store is complete: start clean
        group = zarr.open_group(str(self.store), mode="w", attributes=attrs)
        create_arrays(group, layout, n_pieces)
        self.mark_created()
        return group

    def finish(self, out_dir: Path) -> None:
        """Commit the store (checksums last), publish it over the previous one, and remove this work dir
        and any stale sibling."""
        for junk in self.store.rglob("*.partial"):  # temp files of writes a crash interrupted
            junk.unlink()
        write_checksums(self.store)  # the commit point of the store itself
        publish(self.store, out_dir)  # the previous store stays until the new one is in place
        for stale in self.stale_siblings():
            shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(self.path, ignore_errors=True)

    def is_complete(self) -> bool:
        """The store was created to the end (arrays included): a crash or a full disk during creation
        leaves no marker, and the dir is rebuilt instead of failing every rerun."""
        return self.marker.is_file() and (self.store / "zarr.json").is_file()

    def reset(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self.path.exists():
            raise EaglenestError(f"{self.path}: an incomplete work dir could not be removed; remove it by hand")
        self.store.mkdir(parents=True, mode=0o700)

    def mark_created(self) -> None:
        write_json(self.marker, {"part": self.part}, durable=True)

    def committed(self) -> dict[int, dict]:
        out = {}
        if self.manifests.is_dir():
            for p in self.manifests.glob("*.json"):
                out[int(p.stem)] = json.loads(p.read_text())
        return out

    def commit_piece(self, index: int, rows: list[dict]) -> None:
        write_json(self.manifests / f"{index}.json", {"piece": index, "samples": rows}, durable=True)

    def stale_siblings(self) -> list[Path]:
        mine = re.compile(re.escape(self.part) + f"-[0-9a-f]{{{KEY_CHARS}}}")
        return [p for p in self.root.iterdir() if p.is_dir() and p != self.path and mine.fullmatch(p.name)]


@contextmanager
def part_lock(root: Path, part: str):
    """Hold `<root>/<part>.lock` for the extraction; a second run of the part fails at once. The file
    is removed on release (while still locked); a locker that opened it before the removal sees
    that its file is no longer the one at the path, and tries again."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = root / f"{part}.lock"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise EaglenestError(
                f"part {part} is being extracted by PID {holder} (lock {path}); wait for that run or stop it"
            ) from None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # removed by the previous holder after we opened it
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def check_writable(out_dir: Path) -> None:
    """Before hours of work: the directory the store will be published into must take a rename."""
    parent = Path(out_dir).resolve().parent
    probe = parent
    while not probe.exists():
        probe = probe.parent
    if not os.access(probe, os.W_OK | os.X_OK):
        raise EaglenestError(
            f"{probe}: not writable, so {out_dir} could not be published there (permissions?); nothing was extracted"
        )


def publish(store: Path, out_dir: Path) -> None:
    """Move a finished store to out_dir. The old out_dir is renamed aside, never deleted, until the
    new one is in place; any failure puts the old one back. Leftovers of a crash between the two
    renames (`.<name>.old-*`, `.<name>.new-*`) are swept by the next publish of the same out_dir."""
    out_dir = Path(out_dir)
    parent = out_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    for old in parent.glob(f".{out_dir.name}.old-*"):  # a crash between the renames: the previous good one
        if not out_dir.exists():
            os.rename(old, out_dir)
            log.warning("%s: restored from %s (a publish was interrupted)", out_dir, old.name)
        else:
            shutil.rmtree(old, ignore_errors=True)
    for new in parent.glob(f".{out_dir.name}.new-*"):
        shutil.rmtree(new, ignore_errors=True)
    staged, old = parent / f".{out_dir.name}.new-{os.getpid()}", parent / f".{out_dir.name}.old-{os.getpid()}"
    try:
        shutil.move(str(store), str(staged))  # a rename on the same filesystem, else a copy beside the old
    except OSError:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    had_old = out_dir.exists()
    try:
        if had_old:
            os.rename(out_dir, old)
        os.rename(staged, out_dir)
    except OSError:
        if had_old and old.exists() and not out_dir.exists():
            os.rename(old, out_dir)
        shutil.rmtree(staged, ignore_errors=True)
        raise
    fsync_path(parent)
    if had_old:
        shutil.rmtree(old, ignore_errors=True)
