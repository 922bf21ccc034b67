"""Pack (docs/design.md: Pack): every part's store index, its loss masks and its teacher argmax (the
`teacher@<part>` stage's) -> the draft vocabulary, the train/val split and an index into the stores.
No state is read or copied: training reads the states from the stores themselves
(`packed.PackedSplit`), so each state is stored once, and pack costs seconds whatever the states' size.

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
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import save_file

from eaglenest.data.teacher import load_teacher
from eaglenest.data.vocab import build_vocab, coverage
from eaglenest.files.atomic import replaced_dir, write_json
from eaglenest.runtime.errors import EaglenestError
from eaglenest.store import states as state_format
from eaglenest.store.hidden_store import HiddenStore

log = logging.getLogger(__name__)
TOKEN_ARRAYS = ("input_ids", "loss_mask", "in_vocab")


def packed_arrays(states: str) -> tuple[str, ...]:
    """A sample's arrays as training reads them: the stores' state arrays, then the per-token ones."""
    return (*state_format.arrays(states, 0, 0), *TOKEN_ARRAYS)


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


def pack(
    parts: list[str],
    hidden_dir: Path,
    tokenized_dir: Path,
    teacher_dir: Path,
    out_dir: Path,
    draft_vocab_size: int,
    val_fraction: float,
) -> dict:
    """teacher_dir: the parts' teacher argmax (data/teacher/<part>), each checked to be computed for
    its store and tokenized part as they are now."""
    stores, masks = open_parts(parts, hidden_dir, tokenized_dir)
    samples = []  # (key, part, store index, id)
    tops, vocab = {}, None  # part -> the teacher's argmax per sample, in store order; the target's vocabulary
    for s in stores:
        ids = []
        for row in s.index:
            if row["id"] not in masks[s.part]:
                raise EaglenestError(
                    f"part {s.part}: sample {row['id']!r} is in the store but not in the "
                    f"tokenized part; the store is stale (dvc repro extract@{s.part})"
                )
            ids.append(masks[s.part][row["id"]][0])
        argmax, vocab = load_teacher(Path(teacher_dir) / s.part, s, ids)
        tops[s.part] = np.split(argmax, np.cumsum([len(x) for x in ids])[:-1]) if ids else []
        samples += [(row["key"], s.part, i, row["id"]) for i, row in enumerate(s.index)]
    counts = np.zeros(vocab, dtype=np.int64)
    for _key, part, _i, sid in samples:  # in store order: the sum is the same in any order
        ids, mask = masks[part][sid]
        counts += np.bincount(ids[mask == 1], minlength=len(counts))
    order = sorted(range(len(samples)), key=lambda j: (samples[j][0], samples[j][1], samples[j][3]))
    samples = [samples[j] for j in order]
    by_part = {s.part: s for s in stores}
    selected, d2t, t2d = build_vocab(counts, draft_vocab_size)
    with replaced_dir(out_dir) as tmp:  # a failure leaves no data/packed.tmp behind
        save_file(
            {"selected": torch.from_numpy(selected), "d2t": torch.from_numpy(d2t), "t2d": torch.from_numpy(t2d)},
            str(tmp / "vocab.safetensors"),
        )
        stats, masked, in_vocab_hits = {}, 0, 0
        for split in ("train", "val"):
            mine = [x for x in samples if is_val(x[0], val_fraction) == (split == "val")]
            arrays = {k: [np.zeros(0, d)] for k, d in zip(TOKEN_ARRAYS, (np.int32, np.uint8, np.uint8))}
            for _key, part, i, sid in mine:
                tok, mask = masks[part][sid]
                in_vocab = t2d[tops[part][i]].astype(np.uint8)
                for k, v in zip(TOKEN_ARRAYS, (tok, mask, in_vocab)):
                    arrays[k].append(v)
                masked += int(mask.sum())
                in_vocab_hits += int((in_vocab * mask).sum())
            lengths_of = [by_part[part].index[i]["length"] for _, part, i, _ in mine]
            (tmp / split).mkdir()
            for k, v in arrays.items():
                np.save(tmp / split / f"{k}.npy", np.concatenate(v))
            np.save(tmp / split / "offsets.npy", np.concatenate([[0], np.cumsum(lengths_of)]).astype(np.int64))
            stats[split] = [len(lengths_of), int(sum(lengths_of))]
        if stats["train"][0] == 0:
            raise EaglenestError("pack: no training samples (too few samples or val_fraction too high)")
        H, states = stores[0].attrs["hidden_size"], stores[0].states
        manifest = {
            "target_fingerprint": stores[0].attrs["target_fingerprint"],
            "taps": stores[0].attrs["taps"],
            "hidden_size": H,
            "states": states,
            "vocab_size": int(len(t2d)),
            "draft_vocab_size": int(draft_vocab_size),
            "parts": {s.part: s.attrs["extractor_fingerprint"] for s in stores},
            "stores": {s.part: {"samples": len(s), "samples_digest": s.samples_digest()} for s in stores},
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
