"""Tap resolution, the extractor fingerprint and sample keys (docs/design.md: Taps, Store)."""
from .errors import EaglenestError
from .hashing import sha256_text


def default_taps(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def resolve_taps(taps, num_layers: int) -> list[int]:
    """`auto` -> [2, L//2, L-3]; else three HF hidden_states indices in [0, L-1], ascending."""
    if taps in (None, "auto"):
        return default_taps(num_layers)
    if not isinstance(taps, (list, tuple)) or len(taps) != 3 or not all(isinstance(t, int) for t in taps):
        raise EaglenestError(f"extract.taps must be `auto` or three integers (low, mid, high), got {taps!r}")
    bad = [t for t in taps if not 0 <= t <= num_layers - 1]
    if bad:
        raise EaglenestError(f"extract.taps {list(taps)}: {bad} out of range; a tap is an HF hidden_states "
                             f"index in [0, {num_layers - 1}] for this {num_layers}-layer target "
                             f"(the final post-norm state is stored separately)")
    if list(taps) != sorted(set(taps)):
        raise EaglenestError(f"extract.taps {list(taps)} must be distinct and ascending (low, mid, high)")
    return list(taps)


def extractor_info(backend: dict, taps: list[int], dtype: str, revision) -> dict:
    """Everything that determines the stored bytes besides the target and the tokens."""
    return {"backend": backend["backend"], "backend_version": backend["version"],
            "capture_version": backend["capture_version"], "taps": list(taps), "dtype": dtype,
            "revision": revision}


def extractor_fingerprint(info: dict) -> str:
    return sha256_text(*(f"{k}={info[k]}" for k in sorted(info)))


def sample_key(target_fp: str, extractor_fp: str, ids_bytes: bytes) -> str:
    import hashlib
    h = hashlib.blake2b(digest_size=16)
    for b in (target_fp.encode(), b"\0", extractor_fp.encode(), b"\0", ids_bytes):
        h.update(b)
    return h.hexdigest()
