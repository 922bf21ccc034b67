"""The teacher's argmax (docs/design.md: Teacher): for every token of one part, the target's top token
from its stored final state (`final @ lm_head` in the compute dtype of `made_on.compute_dtype`: bf16,
as the drafter's loss sees it on a GPU or a CPU with bf16 units; float32 on a CPU that emulates bf16). It is the only
thing pack needs from the states, so a part's store is read once here, cached by DVC with the part,
and pack (a new part, a changed `pack.*`) reads 4 bytes a token instead of the states.

    <out>/argmax.npy       [T] int32: the store's samples in store order, concatenated
    <out>/manifest.json    the store's samples digest and the token ids' digest it was computed for,
                           the target's fingerprint, samples and tokens

Every read is digest-checked (the store's own check) and its token ids compared with the tokenized
part, so a store that does not hold what tokenize made fails here, naming the sample."""

import hashlib
import json
import logging
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from eaglenest.files.atomic import replaced_dir, write_json
from eaglenest.runtime import children
from eaglenest.runtime.errors import EaglenestError
from eaglenest.runtime.made_on import compute_dtype
from eaglenest.store import states as state_format
from eaglenest.store.hidden_store import HiddenStore

log = logging.getLogger(__name__)


def ids_digest(ids: list[np.ndarray]) -> str:
    """The token ids of a store's samples, in store order (lengths included)."""
    h = hashlib.sha256()
    for a in ids:
        h.update(np.int64(len(a)).tobytes())
        h.update(np.ascontiguousarray(a, dtype="<i4").tobytes())
    return h.hexdigest()


def tokenized_ids(path: Path) -> dict[str, np.ndarray]:
    """A tokenized part's token ids by sample id."""
    tok = pq.read_table(path, columns=["id", "input_ids"])
    columns = tok.column("id").to_pylist(), tok.column("input_ids").to_pylist()
    return {i: np.asarray(x, np.int32) for i, x in zip(*columns)}


def teach_parts(parts: list[str], hidden_dir: Path, tokenized_dir: Path, teacher_dir: Path, lm_head, **kw) -> None:
    """`teacher` for each part of a workspace laid out as the pipeline's (tests, benches)."""
    for part in parts:
        ids = tokenized_ids(Path(tokenized_dir) / f"{part}.parquet")
        teacher(Path(hidden_dir) / part, ids, Path(teacher_dir) / part, lm_head, **kw)


def teacher(
    store_dir: Path,
    token_ids: dict[str, np.ndarray],
    out_dir: Path,
    lm_head: torch.Tensor,
    device: str = "cpu",
    workers: int = 1,
    unit_mb: float = 256,
    progress: bool = True,
) -> dict:
    """token_ids: the tokenized part's ids by sample id. workers > 1: the store is read by that many
    processes (a sample costs ~10-30 ms of one core in zarr); the output is the same bytes."""
    store = HiddenStore(Path(store_dir))
    ids = []
    for row in store.index:
        if row["id"] not in token_ids:
            raise EaglenestError(
                f"part {store.part}: sample {row['id']!r} is in the store but not in the tokenized part; "
                f"the store is stale (dvc repro extract@{store.part})"
            )
        ids.append(token_ids[row["id"]])
    A, H, states = len(store.attrs["taps"]), store.attrs["hidden_size"], store.states
    row_bytes = sum(int(np.prod(shape)) * dt.itemsize for shape, dt in state_format.arrays(states, A, H).values())
    unit = max(1, int(unit_mb * 2**20 / row_bytes))
    jobs, rows, filled = [], [], 0  # units of whole samples, planned before any read
    for i, row in enumerate(store.index):
        rows.append((i, row["id"], ids[i]))
        filled += row["length"]
        if filled >= unit:
            jobs.append(rows)
            rows, filled = [], 0
    jobs += [rows] if rows else []
    workers = min(workers, len(jobs))  # a process per unit at most: spawning one costs seconds of imports
    dtype = compute_dtype("auto", device)
    setup = (str(store.path), lm_head, device, states, dtype)
    out = []
    with tqdm(total=len(store), desc=f"teacher {store.part}", unit="sample", disable=not progress) as bar:
        if workers <= 1:
            _worker_init(*setup)
            done = map(_read_unit, jobs)
        else:
            ctx = mp.get_context("spawn")
            pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init, initargs=setup)
            done = pool.map(_read_unit, jobs)
        try:
            for job, top in zip(jobs, done):
                out.append(top)
                bar.update(len(job))
        except BaseException:  # an error or a signal: the workers' units are not waited for
            if workers > 1:
                pool.shutdown(wait=False, cancel_futures=True)
                children.end_descendants()
            raise
        if workers > 1:
            pool.shutdown()
    argmax = np.concatenate(out) if out else np.zeros(0, np.int32)
    manifest = {
        "part": store.part,
        "target_fingerprint": store.attrs["target_fingerprint"],
        "vocab_size": int(lm_head.shape[0]),
        "samples": len(store),
        "tokens": int(len(argmax)),
        "samples_digest": store.samples_digest(),
        "ids_digest": ids_digest(ids),
        "dtype": dtype,
    }
    with replaced_dir(out_dir) as tmp:  # a failure leaves the old output and no temporary behind
        np.save(tmp / "argmax.npy", argmax)
        write_json(tmp / "manifest.json", manifest)
    return manifest


def load_teacher(out_dir: Path, store: HiddenStore, ids: list[np.ndarray]) -> tuple[np.ndarray, int]:
    """The part's argmax and the target's vocabulary size, checked to be computed for exactly this
    store and these token ids: else one line naming the part and the command that fixes it."""
    out_dir = Path(out_dir)
    fix = f"dvc repro teacher@{store.part}"
    try:
        manifest = json.loads((out_dir / "manifest.json").read_text())
        argmax = np.load(out_dir / "argmax.npy", mmap_mode="r")
    except (OSError, ValueError) as e:
        raise EaglenestError(f"part {store.part}: {out_dir} is missing or unreadable ({e}); run `{fix}`") from None
    if manifest.get("samples_digest") != store.samples_digest():
        raise EaglenestError(
            f"part {store.part}: {out_dir} was computed for another store than {store.path}; run `{fix}`"
        )
    if manifest.get("ids_digest") != ids_digest(ids) or len(argmax) != sum(len(a) for a in ids):
        raise EaglenestError(
            f"part {store.part}: the tokenized part's token ids differ from those {out_dir} was computed for; "
            f"run `dvc repro extract@{store.part}` (it reruns the teacher)"
        )
    return np.asarray(argmax), int(manifest["vocab_size"])


# --- one unit of samples, in this process or a worker --------------------------------------------
_ctx: dict = {}


def _worker_init(store_path: str, lm_head: torch.Tensor, device: str, states: str, dtype: str) -> None:
    if mp.parent_process() is not None:  # a worker: one core each, the pool is the parallelism
        children.worker_init()
        torch.set_num_threads(1)
    _ctx.update(
        store=HiddenStore(Path(store_path)),
        head=lm_head.to(device=device, dtype=getattr(torch, dtype)),
        device=device,
        states=states,
    )


def _read_unit(rows: list[tuple]) -> np.ndarray:
    """Read (digest-verified) each sample, check its ids against the tokenized part, and take the
    teacher's argmax, a sample at a time (a batched matmul may round differently)."""
    store, head, states = _ctx["store"], _ctx["head"], _ctx["states"]
    tops = []
    for i, sid, tok_ids in rows:
        ids, stored = store.read_stored(i)
        if not np.array_equal(ids, tok_ids):
            raise EaglenestError(f"part {store.part}: sample {sid!r}: stored token ids differ from the tokenized part")
        with torch.inference_mode():
            final = state_format.decode_tensor(
                {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in stored.items()}, "final", states
            )
            tops.append((final.to(_ctx["device"], head.dtype) @ head.T).argmax(-1).cpu().numpy().astype(np.int32))
    return np.concatenate(tops) if tops else np.zeros(0, np.int32)
