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
    """Right-padded tensors [B, T, ...]: the state arrays as stored (`decode_states` turns them into
    aux [B,T,A,H] / final [B,T,H] bf16), input_ids/loss_mask/in_vocab int64."""
    items = [split.get(i) for i in idx]
    T = max(len(x["input_ids"]) for x in items)
    out = {
        k: np.zeros((len(items), T, *items[0][k].shape[1:]), np.int64 if k in TOKEN_ARRAYS else items[0][k].dtype)
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
