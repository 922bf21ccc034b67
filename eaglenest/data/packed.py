"""Read packed training shards (memory-mapped .npy, sequential) and build padded batches. The
states stay in the stores' format (`state_format`) until the trainer's device decodes them:
fp8 states cross the host and PCIe at half the bytes."""

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from eaglenest.data.pack import TOKEN_ARRAYS, packed_arrays
from eaglenest.errors import EaglenestError
from eaglenest.store import states as state_format


class PackedSplit:
    def __init__(self, root: Path, split: str):
        root = Path(root)
        if not (root / "manifest.json").is_file():
            raise EaglenestError(f"{root}: not a packed dataset (run the pack stage)")
        self.manifest = json.loads((root / "manifest.json").read_text())
        self.states = self.manifest.get("states", "bf16")
        self.names = packed_arrays(self.states)
        self.shards, self.samples = [], []
        for s in self.manifest["shards"][split]:
            d = root / split / s["dir"]
            arrays = {k: np.load(d / f"{k}.npy", mmap_mode="r") for k in (*self.names, "offsets")}
            off = arrays["offsets"]
            for j in range(len(off) - 1):
                self.samples.append((len(self.shards), int(off[j]), int(off[j + 1] - off[j])))
            self.shards.append(arrays)

    def __len__(self) -> int:
        return len(self.samples)

    def length(self, i: int) -> int:
        return self.samples[i][2]

    def get(self, i: int) -> dict:
        s, a, n = self.samples[i]
        return {k: self.shards[s][k][a : a + n] for k in self.names}

    @property
    def n_tokens(self) -> int:
        return sum(n for _, _, n in self.samples)


def load_vocab(root: Path) -> dict:
    return load_file(str(Path(root) / "vocab.safetensors"))


def bucket_width(max_len: int, shapes: int = 8) -> int:
    """Padding granularity that gives at most `shapes` sequence lengths up to max_len (a multiple
    of 64, at least 128): few enough shapes for compiled kernels not to hit torch's recompile limit."""
    return max(128, -(-max_len // shapes // 64) * 64)


def epoch_batches(split: PackedSplit, epoch: int, seed: int, batch_tokens: int, bucket: int = 0) -> list[list[int]]:
    """Shuffle samples (seeded by epoch), then group them into batches of at most batch_tokens
    padded tokens.

    bucket 0: consecutive samples while count x longest fits (any shape; eager kernels).
    bucket q: fixed shapes for compiled kernels. A sample goes to the open batch of its length
    rounded up to q; a batch of length T closes at batch_tokens // T rows (`batch_shape`), so
    each T has one shape, and a batch pads to a multiple of q instead of its longest sample
    (short-sample data: far less padding too). Batches come out as they fill; each length's
    unfilled last batch comes at the end of the epoch."""
    order = np.random.default_rng([seed, epoch]).permutation(len(split)).tolist()
    batches, cur, longest = [], [], 0
    if bucket:
        open_ = {}
        for i in order:
            T = -(-split.length(i) // bucket) * bucket
            cur = open_.setdefault(T, [])
            cur.append(i)
            if len(cur) == max(1, batch_tokens // T):
                batches.append(cur)
                open_[T] = []
        return batches + [b for _, b in sorted(open_.items()) if b]
    for i in order:
        n = split.length(i)
        if cur and (len(cur) + 1) * max(longest, n) > batch_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    return batches


def batch_shape(lengths: list[int], bucket: int = 0, batch_tokens: int = 0) -> tuple[int, int]:
    """(rows, T) a batch pads to: its own size with bucket 0, else the fixed shape of its length."""
    if not bucket:
        return len(lengths), max(lengths)
    T = -(-max(lengths) // bucket) * bucket
    return max(len(lengths), batch_tokens // T), T


def collate(split: PackedSplit, idx: list[int], shape: tuple[int, int] | None = None) -> dict:
    """Right-padded tensors [B, T, ...] (shape: at least (B, T) = (rows, longest); padding rows and
    columns have loss_mask 0): the state arrays as stored (`decode_states` turns them into aux
    [B,T,A,H] / final [B,T,H] bf16), input_ids/loss_mask/in_vocab int64."""
    items = [split.get(i) for i in idx]
    B, T = shape or (len(items), max(len(x["input_ids"]) for x in items))
    out = {
        k: np.zeros((B, T, *items[0][k].shape[1:]), np.int64 if k in TOKEN_ARRAYS else items[0][k].dtype)
        for k in split.names
    }
    for b, x in enumerate(items):
        n = len(x["input_ids"])
        for k in split.names:
            out[k][b, :n] = x[k]
    # torch has no arithmetic on uint16: bf16 bit patterns travel as int16
    return {k: torch.from_numpy(v.view(np.int16) if v.dtype == np.uint16 else v) for k, v in out.items()}


def decode_states(batch: dict, states: str) -> dict:
    """A collated batch with its stored state arrays replaced by bf16 aux and final (on the
    batch's device); the same values `HiddenStore.read` gives."""
    stored = {k: batch[k] for k in state_format.arrays(states, 0, 0)}
    aux, final = state_format.decode_tensors(stored, states)
    return {**{k: v for k, v in batch.items() if k not in stored}, "aux": aux, "final": final}
