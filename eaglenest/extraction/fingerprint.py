"""The extractor fingerprint and sample keys (docs/design.md: Store)."""

from eaglenest.files.hashing import sha256_text


def extractor_info(backend: dict, taps: list[int], dtype: str, revision) -> dict:
    """Everything that determines the stored bytes besides the target and the tokens."""
    return {
        "backend": backend["backend"],
        "backend_version": backend["version"],
        "capture_version": backend["capture_version"],
        "taps": list(taps),
        "dtype": dtype,
        "revision": revision,
    }


def extractor_fingerprint(info: dict) -> str:
    return sha256_text(*(f"{k}={info[k]}" for k in sorted(info)))


def sample_key(target_fp: str, extractor_fp: str, ids_bytes: bytes) -> str:
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    for b in (target_fp.encode(), b"\0", extractor_fp.encode(), b"\0", ids_bytes):
        h.update(b)
    return h.hexdigest()
