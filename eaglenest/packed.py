"""Read packed training shards (memory-mapped .npy, sequential) and build padded batches."""
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from .bf16 import from_bits
from .errors import EaglenestError
from .pack import ARRAYS


class PackedSplit:
    def __init__(self, root: Path, split: str):
        root = Path(root)
        if not (root / "manifest.json").is_file():
            raise EaglenestError(f"{root}: not a packed dataset (run the pack stage)")
        self.manifest = json.loads((root / "manifest.json").read_text())
        self.shards, self.samples = [], []
        for s in self.manifest["shards"][split]:
            d = root / split / s["dir"]
            arrays = {k: np.load(d / f"{k}.npy", mmap_mode="r") for k in (*ARRAYS, "offsets")}
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
        return {k: self.shards[s][k][a:a + n] for k in ARRAYS}

    @property
    def n_tokens(self) -> int:
        return sum(n for _, _, n in self.samples)


def load_vocab(root: Path) -> dict:
    return load_file(str(Path(root) / "vocab.safetensors"))


def epoch_batches(split: PackedSplit, epoch: int, seed: int, batch_tokens: int) -> list[list[int]]:
    """Shuffle samples (seeded by epoch), then group consecutive ones while count x longest fits."""
    order = np.random.default_rng([seed, epoch]).permutation(len(split)).tolist()
    batches, cur, longest = [], [], 0
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


def collate(split: PackedSplit, idx: list[int]) -> dict:
    """Right-padded tensors: aux [B,T,A,H] / final [B,T,H] bf16, ids/mask/in_vocab [B,T]."""
    items = [split.get(i) for i in idx]
    T = max(len(x["input_ids"]) for x in items)
    A, H = items[0]["aux"].shape[1:]
    aux = np.zeros((len(items), T, A, H), np.uint16)
    final = np.zeros((len(items), T, H), np.uint16)
    ints = {k: np.zeros((len(items), T), np.int64) for k in ("input_ids", "loss_mask", "in_vocab")}
    for b, x in enumerate(items):
        n = len(x["input_ids"])
        aux[b, :n], final[b, :n] = x["aux"], x["final"]
        for k in ints:
            ints[k][b, :n] = x[k]
    return {"aux": from_bits(aux), "final": from_bits(final), **{k: torch.from_numpy(v) for k, v in ints.items()}}
