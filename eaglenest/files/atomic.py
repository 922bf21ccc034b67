"""Durable, all-or-nothing file writes: temp file, fsync, rename."""

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def replaced_file(path: Path):
    """Yields `<path>.tmp` to write; when the block ends it replaces `path`. If the block fails (a full
    disk, a bad value) the temp file is removed and `path` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        yield tmp
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def copy_file(src: Path, dst: Path) -> None:
    """`dst` becomes a copy of `src` by rename: a copy written into `dst` itself would write through a
    hard link (DVC's cache links outputs) into every other name of the file."""
    with replaced_file(dst) as tmp:
        shutil.copyfile(src, tmp)


def write_json(path: Path, obj, durable: bool = False) -> None:
    text = json.dumps(obj, indent=2, sort_keys=True) + "\n"  # before any file exists: may raise
    with replaced_file(path) as tmp, open(tmp, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    if durable:
        fsync_path(Path(path).parent)


@contextmanager
def replaced_dir(path: Path):
    """Yields `<path>.tmp`, fresh; when the block ends, it replaces `path`. If the block fails the
    temp directory is removed and `path` is left as it was."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
