"""Hashes used across stages: sha256 for files (fingerprints), xxh3-128 for stored sample bytes."""

import hashlib
import json
import os
from pathlib import Path

import xxhash


def sha256_file(path: Path, bufsize: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


class DigestCache:
    """sha256 of files keyed by (path, size, mtime_ns, inode, ctime_ns), as DVC's own state db keys
    its md5s: a file rewritten in any way gets a new key and is hashed again. Saves re-reading a
    16 GB target on every part. The cache is a JSON file written atomically; a damaged one is
    treated as empty."""

    def __init__(self, path: Path | None):
        self.path = Path(path) if path else None
        self.entries = {}
        if self.path and self.path.is_file():
            try:
                self.entries = json.loads(self.path.read_text())
            except (ValueError, OSError):
                self.entries = {}

    @staticmethod
    def key(path: Path) -> str:
        st = os.stat(path)
        return f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_ctime_ns}"

    def sha256(self, path: Path) -> str:
        if self.path is None:
            return sha256_file(path)
        k = self.key(path)
        if k in self.entries:
            return self.entries[k]
        self.entries[k] = digest = sha256_file(path)
        return digest

    def save(self) -> None:
        if self.path is None:
            return
        live = {k: v for k, v in self.entries.items() if os.path.exists(k.split("|", 1)[0])}
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")  # processes may save at once
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(live, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError:  # only a cache: the next run hashes again
            tmp.unlink(missing_ok=True)


def sha256_text(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()


def content_digest(*buffers) -> str:
    """Fast digest over a sample's stored bytes (numpy arrays or bytes), in order."""
    h = xxhash.xxh3_128()
    for b in buffers:
        h.update(memoryview(b).cast("B") if not isinstance(b, bytes) else b)
    return h.hexdigest()
