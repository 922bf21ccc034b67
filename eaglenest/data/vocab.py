"""Draft vocabulary (docs/design.md: Pack): the N most frequent target tokens under the loss mask.
d2t[i] = selected[i] - i (int64 offsets: target_id = i + d2t[i]); t2d bool over the target vocab."""

import numpy as np


def build_vocab(counts: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """counts [V]. Returns (selected sorted int64 [size], d2t int64 [size], t2d bool [V]). When fewer
    than `size` distinct tokens occur, the smallest unused ids fill the rest (never a crash)."""
    V = len(counts)
    if not 0 < size <= V:
        raise ValueError(f"draft vocab size {size} must be in [1, {V}]")
    order = np.lexsort((np.arange(V), -counts))  # by count desc, then id asc
    seen = order[counts[order] > 0][:size]
    if len(seen) < size:
        unused = np.setdiff1d(np.arange(V), seen)[: size - len(seen)]
        seen = np.concatenate([seen, unused])
    selected = np.sort(seen).astype(np.int64)
    d2t = selected - np.arange(size, dtype=np.int64)
    t2d = np.zeros(V, dtype=bool)
    t2d[selected] = True
    return selected, d2t, t2d


def coverage(counts: np.ndarray, t2d: np.ndarray) -> float:
    total = counts.sum()
    return float(counts[t2d].sum() / total) if total else 0.0
