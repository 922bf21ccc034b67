"""Training's view of the data: pack's split, order and token arrays (memory-mapped .npy), and each
sample's states read from its store (digest-verified on every read), then padded batches. The
states stay in the stores' format (`state_format`) until the trainer's device decodes them: fp8
states cross the host and PCIe at half the bytes."""

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file

from eaglenest.data.pack import TOKEN_ARRAYS, packed_arrays
from eaglenest.runtime.errors import EaglenestError
from eaglenest.store import states as state_format
from eaglenest.store.hidden_store import HiddenStore


def open_indexed_store(hidden_dir: Path, part: str, manifest: dict) -> HiddenStore:
    """The part's store as pack indexed it; else one line naming the part and the command that fixes
    it (a store deleted, moved, re-extracted or invalidated since pack ran)."""
    path = Path(hidden_dir) / part
    fix = f"`dvc checkout {path}` restores the indexed store; `dvc repro` re-extracts and re-packs"
    try:
        store = HiddenStore(path)
    except EaglenestError as e:
        raise EaglenestError(f"part {part}: its store is gone or unreadable since pack ran ({e}); {fix}") from None
    want = manifest["stores"][part]
    if (
        store.attrs.get("extractor_fingerprint") != manifest["parts"][part]
        or store.samples_digest() != want["samples_digest"]
    ):
        raise EaglenestError(f"part {part}: {path} is not the store pack indexed (its content changed); {fix}")
    return store


class PackedSplit:
    def __init__(self, root: Path, split: str, hidden_dir: Path):
        root = Path(root)
        if not (root / "manifest.json").is_file():
            raise EaglenestError(f"{root}: not a packed dataset (run the pack stage)")
        self.manifest = json.loads((root / "manifest.json").read_text())
        if "stores" not in self.manifest:
            raise EaglenestError(
                f"{root}: packed by an older eaglenest (state copies, no store index); `dvc repro pack`"
            )
        self.states = self.manifest.get("states", "bf16")
        self.names = packed_arrays(self.states)
        index = pq.read_table(root / "index.parquet", columns=["part", "split", "row"]).to_pylist()
        rows = [(r["part"], r["row"]) for r in index if r["split"] == split]
        self.tokens = {k: np.load(root / split / f"{k}.npy", mmap_mode="r") for k in TOKEN_ARRAYS}
        off = np.load(root / split / "offsets.npy")
        if len(off) != len(rows) + 1:
            raise EaglenestError(f"{root}: {split} has {len(off) - 1} samples of tokens but {len(rows)} indexed")
        self.samples = [(part, row, int(off[j]), int(off[j + 1] - off[j])) for j, (part, row) in enumerate(rows)]
        self.stores = {part: open_indexed_store(hidden_dir, part, self.manifest) for part in self.manifest["parts"]}
        self._kept, self._keep_bytes = {}, 0  # `keep_in_memory`

    def keep_in_memory(self, budget_bytes: int) -> bool:
        """Keep every sample's stored arrays once read (read and digest-checked once a run, not once an
        epoch) if all of them fit `budget_bytes`; whether they do."""
        A, H = len(self.manifest["taps"]), self.manifest["hidden_size"]
        need = self.n_tokens * sum(
            int(np.prod(s)) * d.itemsize for s, d in state_format.arrays(self.states, A, H).values()
        )
        self._keep_bytes = need if need <= budget_bytes else 0
        return bool(self._keep_bytes)

    def __len__(self) -> int:
        return len(self.samples)

    def length(self, i: int) -> int:
        return self.samples[i][3]

    def token_arrays(self, i: int) -> dict:
        """input_ids, loss_mask, in_vocab of sample i (no state read)."""
        _, _, a, n = self.samples[i]
        return {k: self.tokens[k][a : a + n] for k in TOKEN_ARRAYS}

    def get(self, i: int) -> dict:
        """Sample i's state arrays as stored (read and digest-checked now) and its token arrays."""
        tokens, stored = self.token_arrays(i), self._kept.get(i)
        if stored is None:
            part, row, _, _ = self.samples[i]
            ids, stored = self.stores[part].read_stored(row)
            if not np.array_equal(ids, tokens["input_ids"]):
                raise EaglenestError(
                    f"part {part}: sample {row} of {self.stores[part].path} is not the one pack indexed"
                )
            if self._keep_bytes:
                self._kept[i] = stored
        return {**stored, **tokens}

    @property
    def n_tokens(self) -> int:
        return sum(s[3] for s in self.samples)


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


def batch_layout(split: PackedSplit, rows: int, T: int) -> dict[str, tuple[np.dtype, tuple]]:
    """name -> (dtype, shape) of a collated [rows, T] batch: the state arrays as stored, then the
    per-token arrays as int64."""
    spec = state_format.arrays(split.states, len(split.manifest["taps"]), split.manifest["hidden_size"])
    out = {k: (d, (rows, T, *s)) for k, (s, d) in spec.items()}
    return {**out, **{k: (np.dtype(np.int64), (rows, T)) for k in TOKEN_ARRAYS}}


def collate_into(split: PackedSplit, idx: list[int], out: dict[str, np.ndarray]) -> None:
    """Write samples idx right-padded into zeroed arrays of `batch_layout`, a sample at a time."""
    for b, i in enumerate(idx):
        x = split.get(i)
        n = len(x["input_ids"])
        for k in split.names:
            out[k][b, :n] = x[k]


def as_tensors(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    # torch has no arithmetic on uint16: bf16 bit patterns travel as int16
    return {k: torch.from_numpy(v.view(np.int16) if v.dtype == np.uint16 else v) for k, v in arrays.items()}


def collate(split: PackedSplit, idx: list[int], shape: tuple[int, int] | None = None) -> dict:
    """Right-padded tensors [B, T, ...] (shape: at least (B, T) = (rows, longest); padding rows and
    columns have loss_mask 0): the state arrays as stored (`decode_states` turns them into aux
    [B,T,A,H] / final [B,T,H] bf16), input_ids/loss_mask/in_vocab int64."""
    B, T = shape or (len(idx), max(split.length(i) for i in idx))
    out = {k: np.zeros(s, d) for k, (d, s) in batch_layout(split, B, T).items()}
    collate_into(split, idx, out)
    return as_tensors(out)


def decode_states(batch: dict, states: str) -> dict:
    """A collated batch with its stored state arrays replaced by bf16 aux and final (on the
    batch's device); the same values `HiddenStore.read` gives."""
    stored = {k: batch[k] for k in state_format.arrays(states, 0, 0)}
    aux, final = state_format.decode_tensors(stored, states)
    return {**{k: v for k, v in batch.items() if k not in stored}, "aux": aux, "final": final}
