"""Hashes used across stages: sha256 for files (fingerprints), xxh3-128 for stored sample bytes."""

import hashlib
from pathlib import Path

import xxhash


def sha256_file(path: Path, bufsize: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


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
