"""What an extraction does: the part's samples (`read_tokenized`), packed into pieces (one zarr
shard each), and a piece's samples into length-bucketed batches. Deterministic, so a restarted
extraction rebuilds the same plan."""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from eaglenest.errors import EaglenestError


def read_tokenized(path: Path) -> tuple[list[str], list[np.ndarray]]:
    path = Path(path)
    if not path.is_file():
        raise EaglenestError(f"{path}: tokenized part not found (run the tokenize stage)")
    t = pq.read_table(path, columns=["id", "input_ids"])
    ids = t.column("id").to_pylist()
    seqs = [np.asarray(x, dtype=np.int32) for x in t.column("input_ids").to_pylist()]
    return ids, seqs


@dataclass(frozen=True)
class Piece:
    index: int
    samples: tuple[int, ...]  # indices into the part, in input order
    offsets: tuple[int, ...]  # start row of each sample inside the piece


def plan_pieces(lengths: list[int], shard_tokens: int) -> list[Piece]:
    """Greedy, in input order: a sample goes into the current piece if it fits, else opens one."""
    pieces, cur, offs, used = [], [], [], 0
    for i, n in enumerate(lengths):
        if n > shard_tokens:
            raise ValueError(f"sample {i} has {n} tokens > shard of {shard_tokens} rows")
        if used + n > shard_tokens:
            pieces.append(Piece(len(pieces), tuple(cur), tuple(offs)))
            cur, offs, used = [], [], 0
        cur.append(i)
        offs.append(used)
        used += n
    if cur:
        pieces.append(Piece(len(pieces), tuple(cur), tuple(offs)))
    return pieces


def length_batches(samples, lengths, batch_tokens: int) -> list[list[int]]:
    """Longest first; a batch's padded size (count x longest) stays within batch_tokens."""
    order = sorted(samples, key=lambda i: -lengths[i])
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches
