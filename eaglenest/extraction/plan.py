"""What an extraction does: the part's samples (`read_tokenized`), packed into pieces (one zarr
shard each), consecutive pieces grouped into windows, and a window's samples into length-bucketed
batches. Deterministic, so a restarted extraction rebuilds the same plan and the same batches."""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from eaglenest.runtime.errors import EaglenestError


def tokenized_file(path: Path) -> Path:
    """path, or an error saying the tokenize stage has not made it."""
    path = Path(path)
    if not path.is_file():
        raise EaglenestError(f"{path}: tokenized part not found (run the tokenize stage)")
    return path


def read_tokenized(path: Path) -> tuple[list[str], list[np.ndarray]]:
    t = pq.read_table(tokenized_file(path), columns=["id", "input_ids"])
    ids = t.column("id").to_pylist()
    col = t.column("input_ids").combine_chunks()  # one list array: its flat values, sliced per sample
    flat = col.flatten().to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    ends = np.cumsum(col.value_lengths().to_numpy(zero_copy_only=False))
    return ids, np.split(flat, ends[:-1]) if len(col) else []


def token_count(path: Path) -> int:
    """A tokenized part's tokens, from its input_ids column alone."""
    col = pq.read_table(tokenized_file(path), columns=["input_ids"]).column("input_ids")
    return int(sum(len(chunk.flatten()) for chunk in col.chunks))


def sample_count(path: Path) -> int:
    """A tokenized part's samples, from the parquet footer."""
    return pq.ParquetFile(tokenized_file(path)).metadata.num_rows


@dataclass(frozen=True)
class Piece:
    index: int
    samples: tuple[int, ...]  # indices into the part, longest first
    offsets: tuple[int, ...]  # start row of each sample inside the piece


# In the work key (loop.py): a work dir planned another way holds other samples under the same piece
# numbers, so it must never be resumed by this plan.
PLAN = "pieces-by-length-v1"


def plan_pieces(lengths: list[int], shard_tokens: int) -> list[Piece]:
    """Greedy over the samples longest first (ties in input order): a sample goes into the current
    piece if it fits, else opens one. So a piece holds samples of about one length and the
    length-sorted batches of a window (`window_batches`) fill its pieces one after another: a piece
    goes to its writer as the loop moves on, not all of a window's at its end (the writers' drain
    after the last batch), and a window's batches span a narrow range of lengths (H200 bench, lengths
    128-2,048 at 16k-token batches: 2.9 % padding on a 600k-token part, 0.7 % on 2.6M; 9.6 % with
    pieces in input order)."""
    pieces, cur, offs, used = [], [], [], 0
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
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


WINDOW_BATCHES = 8  # a window holds >= this many batches' worth of samples
# extract.batch_tokens: auto. On the H200 (8B shape, 600k-token parts) 16,384 beat 4,096 on both a
# cold and a warm part (steady MFU 0.33 / 0.45 vs 0.29 / 0.39): a 4k batch's host launch (~85 ms)
# leaves the GPU idle ~40 % of the time. On a CPU the forward is the cost and 4,096 keeps the window's
# buffers small. bench/RESULTS.md, "extract stage ... third run".
AUTO_BATCH_TOKENS = {"cuda": 16384, "cpu": 4096}


def batch_tokens_for(value: int | str, device: str) -> int:
    """extract.batch_tokens for a resolved device: an integer as given, auto by device kind."""
    if value == "auto":
        return AUTO_BATCH_TOKENS["cuda" if str(device).startswith("cuda") else "cpu"]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EaglenestError(f"extract.batch_tokens must be auto or an integer >= 1, got {value!r}")
    return value


def plan_windows(pieces: list[Piece], lengths: list[int], batch_tokens: int) -> list[list[Piece]]:
    """Consecutive pieces whose samples are batched together, greedy: a window closes once it holds
    WINDOW_BATCHES x batch_tokens of samples. A piece holds a shard's bytes, which for a wide target
    is few tokens (8B, bf16: 32 KB a token, 4,096 tokens in a 128 MB shard, ~2-30 samples): batched
    on its own, a piece capped every batch at ~4k tokens whatever extract.batch_tokens said. Over a
    window, batches reach batch_tokens; with pieces packed by length (`plan_pieces`) they fill the
    pieces in order, so host memory holds the pieces in flight, not a whole window's. A narrow
    target's piece fills a window alone or nearly (SmolLM2 bf16: ~29k tokens).
    Planned over all of a part's pieces, never only the pending ones, so a resumed or multi-device
    run runs the very batches of an uninterrupted one: the same bytes."""
    windows, cur, tokens = [], [], 0
    for p in pieces:
        cur.append(p)
        tokens += sum(lengths[i] for i in p.samples)
        if tokens >= WINDOW_BATCHES * batch_tokens:
            windows.append(cur)
            cur, tokens = [], 0
    if cur:
        windows.append(cur)
    return windows


def window_batches(window: list[Piece], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """A window's batches: its samples, every piece's, length-bucketed together."""
    return length_batches([i for p in window for i in p.samples], lengths, batch_tokens)
