"""Pack (docs/design.md: Pack): every part's store (digest-verified on read) + its loss masks -> the draft
vocabulary and train/val shards laid out for sequential reads.

    <out>/vocab.safetensors         selected, d2t (int64), t2d (bool)
    <out>/{train,val}/<NNNNN>/      the states as the stores keep them (`state_format`: bf16 aux.npy
                                    [T,3,H] u16 + final.npy [T,H] u16; fp8 adds aux_scale/final_scale),
                                    input_ids.npy [T] i32, loss_mask.npy [T] u8, in_vocab.npy [T] u8,
                                    offsets.npy [n+1] i64
    <out>/manifest.json             fingerprints, taps, state format, shard list
    <out>/index.parquet             per sample, in packed order: key, part, id, split, digest

Samples are ordered by key (a hash: shuffled, deterministic, independent of part order); the
split is by key too, so adding a part never moves an existing sample between train and val.
`in_vocab[p]` = the teacher's argmax at position p is in the draft vocabulary."""
import logging
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from eaglenest.atomic import write_json
from eaglenest.data.vocab import build_vocab, coverage
from eaglenest.errors import EaglenestError
from eaglenest.store import states as state_format
from eaglenest.store.hidden_store import HiddenStore

log = logging.getLogger(__name__)
TOKEN_ARRAYS = ("input_ids", "loss_mask", "in_vocab")


def packed_arrays(states: str) -> tuple[str, ...]:
    """The .npy arrays of a shard: the stores' state arrays, then the per-token ones."""
    return (*state_format.arrays(states, 0, 0), *TOKEN_ARRAYS)


def is_val(key: str, val_fraction: float) -> bool:
    return int(key[:8], 16) / 0xFFFFFFFF < val_fraction


def open_parts(parts: list[str], hidden_dir: Path, tokenized_dir: Path):
    """Stores and loss masks of every part; one target and one set of taps across parts."""
    stores, masks = [], {}
    for part in parts:
        store = HiddenStore(Path(hidden_dir) / part)
        tok = pq.read_table(Path(tokenized_dir) / f"{part}.parquet", columns=["id", "input_ids", "loss_mask"])
        masks[part] = {i: (np.asarray(x, np.int32), np.asarray(m, np.uint8)) for i, x, m in
                       zip(tok.column("id").to_pylist(), tok.column("input_ids").to_pylist(),
                           tok.column("loss_mask").to_pylist())}
        stores.append(store)
    first = stores[0].attrs
    for s in stores[1:]:
        for k in ("target_fingerprint", "taps", "hidden_size", "dtype", "states"):
            mine, theirs = (s.states, stores[0].states) if k == "states" else (s.attrs[k], first[k])
            if mine != theirs:
                raise EaglenestError(f"part {s.part}: {k} {mine!r} differs from part {stores[0].part} "
                                     f"({theirs!r}); re-extract so every part matches")
    return stores, masks


def pack(parts: list[str], hidden_dir: Path, tokenized_dir: Path, out_dir: Path, lm_head: torch.Tensor,
         draft_vocab_size: int, val_fraction: float, shard_mb: float = 256, progress: bool = True,
         device: str = "cpu") -> dict:
    stores, masks = open_parts(parts, hidden_dir, tokenized_dir)
    samples = []  # (key, store, index, part, id)
    counts = np.zeros(lm_head.shape[0], dtype=np.int64)
    for s in stores:
        for i, row in enumerate(s.index):
            if row["id"] not in masks[s.part]:
                raise EaglenestError(f"part {s.part}: sample {row['id']!r} is in the store but not in the "
                                     f"tokenized part; the store is stale (dvc repro extract@{s.part})")
            ids, mask = masks[s.part][row["id"]]
            counts += np.bincount(ids[mask == 1], minlength=len(counts))
            samples.append((row["key"], s, i, s.part, row["id"]))
    samples.sort(key=lambda x: (x[0], x[3], x[4]))
    selected, d2t, t2d = build_vocab(counts, draft_vocab_size)
    t2d_t = torch.from_numpy(t2d)
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({"selected": torch.from_numpy(selected), "d2t": torch.from_numpy(d2t), "t2d": t2d_t},
              str(tmp / "vocab.safetensors"))

    A, H, states = len(stores[0].attrs["taps"]), stores[0].attrs["hidden_size"], stores[0].states
    row_bytes = sum(int(np.prod(shape)) * dt.itemsize for shape, dt in state_format.arrays(states, A, H).values())
    shard_tokens = max(1, int(shard_mb * 2**20 / row_bytes))
    head = lm_head.to(device=device, dtype=torch.bfloat16)
    names = packed_arrays(states)
    writers = {"train": ShardWriter(tmp / "train", shard_tokens, names),
               "val": ShardWriter(tmp / "val", shard_tokens, names)}
    stats = {"train": [0, 0], "val": [0, 0]}
    in_vocab_hits = masked = 0
    index_rows = []
    for key, store, i, part, sid in tqdm(samples, desc="pack", unit="sample", disable=not progress):
        ids, stored = store.read_stored(i)  # digest-verified; kept in the stores' format
        tok_ids, mask = masks[part][sid]
        if not np.array_equal(ids, tok_ids):
            raise EaglenestError(f"part {part}: sample {sid!r}: stored token ids differ from the tokenized part")
        with torch.inference_mode():
            final = state_format.decode_tensor({k: torch.from_numpy(np.ascontiguousarray(v))
                                                for k, v in stored.items()}, "final", states)
            top = (final.to(device) @ head.T).argmax(-1).cpu()
        in_vocab = t2d_t[top].numpy().astype(np.uint8)
        split = "val" if is_val(key, val_fraction) else "train"
        index_rows.append({"key": key, "part": part, "id": sid, "split": split, "digest": store.index[i]["digest"]})
        writers[split].add(**stored, input_ids=ids, loss_mask=mask, in_vocab=in_vocab)
        stats[split][0] += 1
        stats[split][1] += len(ids)
        masked += int(mask.sum())
        in_vocab_hits += int((in_vocab * mask).sum())
    shards = {k: w.close() for k, w in writers.items()}
    if stats["train"][0] == 0:
        raise EaglenestError("pack: no training samples (too few samples or val_fraction too high)")
    manifest = {"target_fingerprint": stores[0].attrs["target_fingerprint"], "taps": stores[0].attrs["taps"],
                "hidden_size": H, "states": states, "vocab_size": int(len(t2d)),
                "draft_vocab_size": int(draft_vocab_size),
                "parts": {s.part: s.attrs["extractor_fingerprint"] for s in stores}, "shards": shards,
                "val_fraction": val_fraction}
    write_json(tmp / "manifest.json", manifest)
    pq.write_table(pa.Table.from_pylist(index_rows), tmp / "index.parquet")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    masked_counts = counts.sum()
    return {"samples": len(samples), "tokens": int(sum(v[1] for v in stats.values())),
            "train_samples": stats["train"][0], "train_tokens": stats["train"][1],
            "val_samples": stats["val"][0], "val_tokens": stats["val"][1], "masked_tokens": int(masked_counts),
            "draft_vocab_size": int(draft_vocab_size), "distinct_masked_tokens": int((counts > 0).sum()),
            "draft_vocab_coverage": round(coverage(counts, t2d), 5),
            "teacher_argmax_in_vocab": round(in_vocab_hits / max(1, masked), 5)}


class ShardWriter:
    """Accumulates samples and writes a shard directory of .npy arrays once it reaches shard_tokens."""

    def __init__(self, root: Path, shard_tokens: int, names: tuple[str, ...]):
        self.root, self.shard_tokens, self.names = Path(root), shard_tokens, names
        self.root.mkdir(parents=True, exist_ok=True)
        self.buf = {k: [] for k in names}
        self.n = 0
        self.shards = []

    def add(self, **arrays) -> None:
        for k in self.names:
            self.buf[k].append(arrays[k])
        self.n += len(arrays["input_ids"])
        if self.n >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.n:
            return
        d = self.root / f"{len(self.shards):05d}"
        d.mkdir()
        lengths = [len(x) for x in self.buf["input_ids"]]
        for k in self.names:
            np.save(d / f"{k}.npy", np.concatenate(self.buf[k]))
        np.save(d / "offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        self.shards.append({"dir": d.name, "samples": len(lengths), "tokens": self.n})
        self.buf = {k: [] for k in self.names}
        self.n = 0

    def close(self) -> list:
        self.flush()
        return self.shards
