"""Durable, all-or-nothing file writes: temp file, fsync, rename."""

import json
import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj, durable: bool = False) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")
        if durable:
            f.flush()
            os.fsync(f.fileno())
    tmp.replace(path)
    if durable:
        fsync_path(path.parent)
