"""Pack (docs/design.md: Pack): every part's store (digest-verified on read) + its loss masks -> the draft
vocabulary, the train/val split and an index into the stores. No state is copied: training reads
the states from the stores themselves (`packed.PackedSplit`), so each state is stored once.

    <out>/vocab.safetensors         selected, d2t (int64), t2d (bool)
    <out>/{train,val}/              per split, its samples in packed order: input_ids.npy [T] i32,
                                    loss_mask.npy [T] u8, in_vocab.npy [T] u8, offsets.npy [n+1] i64
    <out>/manifest.json             fingerprints, taps, state format, each store indexed (its
                                    extractor and a digest of its samples' digests), each split's counts
    <out>/index.parquet             per sample, in packed order: key, part, id, split, digest, row (the
                                    sample's index in its store), length

Samples are ordered by key (a hash: shuffled, deterministic, independent of part order); the
split is by key too, so adding a part never moves an existing sample between train and val.
`in_vocab[p]` = the teacher's argmax at position p is in the draft vocabulary."""

import logging
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from eaglenest.atomic import replaced_dir, write_json
from eaglenest.data.vocab import build_vocab, coverage
from eaglenest.errors import EaglenestError
from eaglenest.hashing import sha256_text
from eaglenest.store import states as state_format
from eaglenest.store.hidden_store import HiddenStore

log = logging.getLogger(__name__)
TOKEN_ARRAYS = ("input_ids", "loss_mask", "in_vocab")


def packed_arrays(states: str) -> tuple[str, ...]:
    """A sample's arrays as training reads them: the stores' state arrays, then the per-token ones."""
    return (*state_format.arrays(states, 0, 0), *TOKEN_ARRAYS)


def samples_digest(store: HiddenStore) -> str:
    """A store's content as pack indexed it: the digest of its samples' digests, in its order."""
    return sha256_text(*(r["digest"] for r in store.index))


def is_val(key: str, val_fraction: float) -> bool:
    return int(key[:8], 16) / 0xFFFFFFFF < val_fraction


def open_parts(parts: list[str], hidden_dir: Path, tokenized_dir: Path):
    """Stores and loss masks of every part; one target and one set of taps across parts."""
    stores, masks = [], {}
    for part in parts:
        store = HiddenStore(Path(hidden_dir) / part)
        tok = pq.read_table(Path(tokenized_dir) / f"{part}.parquet", columns=["id", "input_ids", "loss_mask"])
        masks[part] = {
            i: (np.asarray(x, np.int32), np.asarray(m, np.uint8))
            for i, x, m in zip(
                tok.column("id").to_pylist(), tok.column("input_ids").to_pylist(), tok.column("loss_mask").to_pylist()
            )
        }
        stores.append(store)
    first = stores[0].attrs
    for s in stores[1:]:
        for k in ("target_fingerprint", "taps", "hidden_size", "dtype", "states"):
            mine, theirs = (s.states, stores[0].states) if k == "states" else (s.attrs[k], first[k])
            if mine != theirs:
                raise EaglenestError(
                    f"part {s.part}: {k} {mine!r} differs from part {stores[0].part} "
                    f"({theirs!r}); re-extract so every part matches"
                )
    return stores, masks


def plan_units(samples: list[tuple], lengths: list[int], val_fraction: float, unit_tokens: int) -> dict:
    """Samples (in key order) of each split's units of work: a unit closes once it holds unit_tokens
    or more. Fixed before any state is read, so the output is the same whatever the worker count."""
    plan = {"train": [[]], "val": [[]]}
    filled = {"train": 0, "val": 0}
    for sample, n in zip(samples, lengths):
        split = "val" if is_val(sample[0], val_fraction) else "train"
        plan[split][-1].append(sample)
        filled[split] += n
        if filled[split] >= unit_tokens:
            plan[split].append([])
            filled[split] = 0
    return {k: [s for s in v if s] for k, v in plan.items()}


def pack(
    parts: list[str],
    hidden_dir: Path,
    tokenized_dir: Path,
    out_dir: Path,
    lm_head: torch.Tensor,
    draft_vocab_size: int,
    val_fraction: float,
    shard_mb: float = 256,
    progress: bool = True,
    device: str = "cpu",
    workers: int = 1,
) -> dict:
    """workers > 1: the stores are read by that many processes (reading and digest-checking a sample
    costs ~10 ms of one core in zarr, which one process cannot hide); the output is the same."""
    stores, masks = open_parts(parts, hidden_dir, tokenized_dir)
    samples, lengths = [], []  # (key, part, store index, id), tokens
    counts = np.zeros(lm_head.shape[0], dtype=np.int64)
    for s in stores:
        for i, row in enumerate(s.index):
            if row["id"] not in masks[s.part]:
                raise EaglenestError(
                    f"part {s.part}: sample {row['id']!r} is in the store but not in the "
                    f"tokenized part; the store is stale (dvc repro extract@{s.part})"
                )
            ids, mask = masks[s.part][row["id"]]
            counts += np.bincount(ids[mask == 1], minlength=len(counts))
            samples.append((row["key"], s.part, i, row["id"]))
    order = sorted(range(len(samples)), key=lambda j: (samples[j][0], samples[j][1], samples[j][3]))
    samples = [samples[j] for j in order]
    by_part = {s.part: s for s in stores}
    lengths = [by_part[part].index[i]["length"] for _, part, i, _ in samples]
    selected, d2t, t2d = build_vocab(counts, draft_vocab_size)
    with replaced_dir(out_dir) as tmp:  # a failure leaves no data/packed.tmp behind
        save_file(
            {"selected": torch.from_numpy(selected), "d2t": torch.from_numpy(d2t), "t2d": torch.from_numpy(t2d)},
            str(tmp / "vocab.safetensors"),
        )

        A, H, states = len(stores[0].attrs["taps"]), stores[0].attrs["hidden_size"], stores[0].states
        row_bytes = sum(int(np.prod(shape)) * dt.itemsize for shape, dt in state_format.arrays(states, A, H).values())
        # units of work: `shard_mb` of states read each, planned before any is read (the same arrays
        # whatever the worker count)
        plan = plan_units(samples, lengths, val_fraction, max(1, int(shard_mb * 2**20 / row_bytes)))
        jobs = [
            (split, n, [(key, part, i, sid, *masks[part][sid]) for key, part, i, sid in shard])
            for split, units in plan.items()
            for n, shard in enumerate(units)
        ]
        setup = ({s.part: str(s.path) for s in stores}, lm_head, t2d, device, states)
        results = {}
        with tqdm(total=len(samples), desc="pack", unit="sample", disable=not progress) as bar:
            if workers <= 1:
                _worker_init(*setup)
                done = map(_read_unit, jobs)
            else:
                pool = ProcessPoolExecutor(
                    workers, mp_context=mp.get_context("spawn"), initializer=_worker_init, initargs=setup
                )
                done = pool.map(_read_unit, jobs)
            try:
                for (split, n, _), r in zip(jobs, done):
                    results[split, n] = r
                    bar.update(r["samples"])
            finally:
                if workers > 1:
                    pool.shutdown(cancel_futures=True)
        stats = {}
        for split in plan:
            units = [results[split, n] for n in range(len(plan[split]))]
            empty = {
                "input_ids": np.zeros(0, np.int32),
                "loss_mask": np.zeros(0, np.uint8),
                "in_vocab": np.zeros(0, np.uint8),
            }
            arrays = {k: np.concatenate([u["arrays"][k] for u in units]) for k in TOKEN_ARRAYS} if units else empty
            lengths_of = [n for u in units for n in u["lengths"]]
            (tmp / split).mkdir()
            for k, v in arrays.items():
                np.save(tmp / split / f"{k}.npy", v)
            np.save(tmp / split / "offsets.npy", np.concatenate([[0], np.cumsum(lengths_of)]).astype(np.int64))
            stats[split] = [len(lengths_of), int(sum(lengths_of))]
        if stats["train"][0] == 0:
            raise EaglenestError("pack: no training samples (too few samples or val_fraction too high)")
        masked = sum(r["masked"] for r in results.values())
        in_vocab_hits = sum(r["in_vocab_hits"] for r in results.values())
        manifest = {
            "target_fingerprint": stores[0].attrs["target_fingerprint"],
            "taps": stores[0].attrs["taps"],
            "hidden_size": H,
            "states": states,
            "vocab_size": int(len(t2d)),
            "draft_vocab_size": int(draft_vocab_size),
            "parts": {s.part: s.attrs["extractor_fingerprint"] for s in stores},
            "stores": {s.part: {"samples": len(s), "samples_digest": samples_digest(s)} for s in stores},
            "splits": {split: {"samples": v[0], "tokens": v[1]} for split, v in stats.items()},
            "val_fraction": val_fraction,
        }
        write_json(tmp / "manifest.json", manifest)
        index_rows = [
            {
                "key": key,
                "part": part,
                "id": sid,
                "split": "val" if is_val(key, val_fraction) else "train",
                "digest": by_part[part].index[i]["digest"],
                "row": i,
                "length": by_part[part].index[i]["length"],
            }
            for key, part, i, sid in samples
        ]
        pq.write_table(pa.Table.from_pylist(index_rows), tmp / "index.parquet")
        written = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
    return {
        "samples": len(samples),
        "tokens": int(sum(v[1] for v in stats.values())),
        "train_samples": stats["train"][0],
        "train_tokens": stats["train"][1],
        "val_samples": stats["val"][0],
        "val_tokens": stats["val"][1],
        "masked_tokens": int(counts.sum()),
        "draft_vocab_size": int(draft_vocab_size),
        "distinct_masked_tokens": int((counts > 0).sum()),
        "draft_vocab_coverage": round(coverage(counts, t2d), 5),
        "teacher_argmax_in_vocab": round(in_vocab_hits / max(1, masked), 5),
        "pack_bytes": written,
        "store_bytes": sum(f.stat().st_size for s in stores for f in s.path.rglob("*") if f.is_file()),
    }


# --- one shard, in this process or a worker ------------------------------------------------------
_ctx: dict = {}


def _worker_init(store_paths: dict, lm_head: torch.Tensor, t2d: np.ndarray, device: str, states: str) -> None:
    if mp.parent_process() is not None:  # a worker: one core each, the pool is the parallelism
        torch.set_num_threads(1)
    _ctx.update(
        stores={part: HiddenStore(Path(p)) for part, p in store_paths.items()},
        t2d=torch.from_numpy(t2d),
        head=lm_head.to(device=device, dtype=torch.bfloat16),
        device=device,
        states=states,
    )


def _read_unit(job: tuple) -> dict:
    """Read (digest-verified), check against the tokenized part, compute the teacher's in_vocab; the
    unit's token arrays come back, its states stay in the stores."""
    split, n, rows = job
    states, head, t2d = _ctx["states"], _ctx["head"], _ctx["t2d"]
    arrays = {k: [] for k in TOKEN_ARRAYS}
    masked = hits = 0
    for _key, part, i, sid, tok_ids, mask in rows:
        ids, stored = _ctx["stores"][part].read_stored(i)
        if not np.array_equal(ids, tok_ids):
            raise EaglenestError(f"part {part}: sample {sid!r}: stored token ids differ from the tokenized part")
        with torch.inference_mode():
            final = state_format.decode_tensor(
                {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in stored.items()}, "final", states
            )
            top = (final.to(_ctx["device"]) @ head.T).argmax(-1).cpu()
        in_vocab = t2d[top].numpy().astype(np.uint8)
        for k, v in {"input_ids": ids, "loss_mask": mask, "in_vocab": in_vocab}.items():
            arrays[k].append(v)
        masked += int(mask.sum())
        hits += int((in_vocab * mask).sum())
    return {
        "arrays": {k: np.concatenate(v) for k, v in arrays.items()},
        "lengths": [len(x) for x in arrays["input_ids"]],
        "samples": len(rows),
        "masked": masked,
        "in_vocab_hits": hits,
    }
