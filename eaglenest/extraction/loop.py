"""Extract one part's hidden states into a Zarr store, crash-safe and resumable
(docs/design.md: Store, Extraction).

A work directory outside the DVC outputs, keyed by (input hash, target, extractor, layout), holds
the store being built. Each piece (= one zarr shard per array) is encoded and written by a
background writer (`writers`, `store.shard_writer`: temp name, fsync, rename), then its manifest is written
(temp + fsync + rename). A manifest commits a piece; a restart keeps committed pieces and
extracts only the rest. After the validation gate passes, the index is written and the store
is renamed into the output in one step; a failed gate commits nothing."""

import concurrent.futures
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import zarr
from tqdm import tqdm

from eaglenest.errors import EaglenestError
from eaglenest.extraction.backends import SampleFailed
from eaglenest.extraction.fingerprint import extractor_fingerprint, extractor_info, sample_key
from eaglenest.extraction.gate import Reference, run_gate
from eaglenest.extraction.plan import Piece, length_batches, plan_pieces
from eaglenest.extraction.work_dir import WorkDir, check_writable, part_lock, publish
from eaglenest.extraction.writers import PieceWriter
from eaglenest.hashing import sha256_file, sha256_text
from eaglenest.store import states as state_format
from eaglenest.store.bf16 import from_bits
from eaglenest.store.hidden_store import (
    SCHEMA_VERSION,
    TAP_SEMANTICS,
    HiddenStore,
    Layout,
    create_arrays,
    write_checksums,
    write_index,
)
from eaglenest.store.shard_writer import BufferPool
from eaglenest.target import Target

log = logging.getLogger(__name__)


def read_tokenized(path: Path) -> tuple[list[str], list[np.ndarray]]:
    path = Path(path)
    if not path.is_file():
        raise EaglenestError(f"{path}: tokenized part not found (run the tokenize stage)")
    t = pq.read_table(path, columns=["id", "input_ids"])
    ids = t.column("id").to_pylist()
    seqs = [np.asarray(x, dtype=np.int32) for x in t.column("input_ids").to_pylist()]
    return ids, seqs


def _open_work_store(work: WorkDir, layout: Layout, n_pieces: int, attrs: dict) -> zarr.Group:
    if work.is_complete():
        group = zarr.open_group(str(work.store), mode="r+")
        old = dict(group.attrs)
        if old.get("work_key") != attrs["work_key"]:
            raise EaglenestError(f"{work.store}: work store belongs to another extraction; delete it")
        return group
    if work.path.exists():
        log.warning("%s: the work dir was never completely created (a crash or a full disk); rebuilding it", work.path)
    work.reset()  # nothing is committed before the store is complete: start clean
    group = zarr.open_group(str(work.store), mode="w", attributes=attrs)
    create_arrays(group, layout, n_pieces)
    work.mark_created()
    return group


def extract_part(*, part: str, work_root: Path, out_dir: Path, **kw) -> dict:
    """Extract, gate and publish one part; one run per part at a time (`work_dir.part_lock`)."""
    with part_lock(work_root, part):
        check_writable(out_dir)
        return _extract_part(part=part, work_root=work_root, out_dir=out_dir, **kw)


def _extract_part(
    *,
    part: str,
    tokenized: Path,
    target: Target,
    backend,
    taps: list[int],
    dtype: str,
    revision,
    layout_cfg: dict,
    validate_cfg: dict,
    out_dir: Path,
    work_root: Path,
    batch_tokens: int,
    max_seq_len: int,
    progress: bool = True,
    writers: int | None = None,
) -> dict:
    t0 = time.time()
    names, seqs = read_tokenized(tokenized)
    if not seqs:
        raise EaglenestError(f"{tokenized}: no samples to extract")
    lengths = [len(s) for s in seqs]
    if max(lengths) > max_seq_len:
        raise EaglenestError(f"{tokenized}: a sample has {max(lengths)} tokens > max_seq_len {max_seq_len}")
    layout = Layout.for_sizes(target.hidden_size, len(taps), max_seq_len=max_seq_len, **layout_cfg)
    described = backend.describe()
    info = extractor_info(described, taps, dtype, revision)
    efp = extractor_fingerprint(info)
    input_sha = sha256_file(tokenized)
    work_key = sha256_text(input_sha, target.fingerprint, efp, str(asdict(layout)))
    work = WorkDir(work_root, part, work_key)
    pieces = plan_pieces(lengths, layout.shard_tokens)
    attrs = {
        "schema_version": SCHEMA_VERSION,
        "part": part,
        "target_fingerprint": target.fingerprint,
        "extractor": info,
        "extractor_fingerprint": efp,
        "taps": taps,
        "tap_semantics": TAP_SEMANTICS,
        "dtype": "bfloat16",
        "storage": state_format.describe(layout.states),
        "hidden_size": target.hidden_size,
        "max_seq_len": max_seq_len,
        "layout": asdict(layout),
        "input_sha256": input_sha,
        "work_key": work_key,
        "device": described.get("device"),
    }
    _open_work_store(work, layout, len(pieces), attrs)
    done = work.committed()
    pending = [p for p in pieces if p.index not in done]
    if done:
        log.info("%s: resuming: %d of %d pieces already committed in %s", part, len(done), len(pieces), work.path)
    keys = [sample_key(target.fingerprint, efp, s.tobytes()) for s in seqs]

    todo_tokens = sum(lengths[i] for p in pending for i in p.samples)
    # half the cores, at most 8: a GPU host's 16 cores write ~1.7 GB/s of zstd-1 shards with 8
    # (bench.host_path); the other half run the loop, the fill copies and the backend
    writers = writers or max(1, min(8, (os.cpu_count() or 2) // 2))
    writer = PieceWriter(work, layout, workers=writers, processes=writers > 1)
    pool = BufferPool(layout, shared=writer.shared)
    t_compute = time.time()
    # The piece buffers (GBs of shared memory, ~0.25 s per GB to free) are freed beside the gate
    freeing = threading.Thread(target=pool.close, name="free-piece-buffers")
    try:
        with (
            tqdm(
                total=todo_tokens,
                unit="tok",
                unit_scale=True,
                desc=f"extract {part}",
                disable=not progress,
                smoothing=0.1,
            ) as bar,
            ThreadPoolExecutor(2, thread_name_prefix="piece-fill") as fill,
        ):
            try:
                clock = _run_pieces(
                    pending, seqs, lengths, names, keys, backend, layout, batch_tokens, bar, fill, writer, pool
                )
                t_drain = time.perf_counter()
            finally:
                try:
                    writer.close()
                finally:  # no copy or writer touches the buffers any more
                    freeing.start()
        compute_s = time.time() - t_compute
        host_path = _host_path_report(part, clock, writer, writers, time.perf_counter() - t_drain, compute_s)
        rows = [r for m in work.committed().values() for r in m["samples"]]
        if len(rows) != len(seqs):
            raise EaglenestError(f"{part}: {len(rows)} samples committed, expected {len(seqs)}")
        write_index(work.store, rows)
        store = HiddenStore(work.store, check_metadata=False)  # not committed yet

        gate_metrics, passed = _gate(store, target, taps, validate_cfg, described.get("device", "cpu"))
        stored_bytes = sum(f.stat().st_size for f in work.store.rglob("*") if f.is_file())
        raw = sum(lengths) * (len(taps) + 1) * target.hidden_size * 2  # as bf16, uncompressed
        metrics = {
            "part": part,
            "samples": len(seqs),
            "tokens": sum(lengths),
            "pieces": len(pieces),
            "pieces_resumed": len(done),
            "tokens_extracted_now": todo_tokens,
            "extract_seconds": round(compute_s, 2),
            "total_seconds": round(time.time() - t0, 2),
            "tokens_per_s": round(todo_tokens / compute_s, 1) if todo_tokens else None,
            "stored_bytes": stored_bytes,
            "bytes_per_token": round(stored_bytes / sum(lengths), 1),
            "compression_ratio": round(raw / max(1, stored_bytes), 3),
            "padding_fraction": round(1 - sum(lengths) / (len(pieces) * layout.shard_tokens), 4),
            "extractor_fingerprint": efp,
            "host_path": host_path,
            "validation": gate_metrics,
        }
        if not passed:
            metrics["committed"] = False
            raise GateFailed(metrics)
        _finalize(work, out_dir)
        metrics["committed"] = True
        return metrics
    finally:
        if freeing.ident is not None:  # started: joined before any return or raise
            freeing.join()


def _host_path_report(
    part: str, clock: dict, writer: PieceWriter, writers: int, drain_s: float, compute_s: float
) -> dict:
    """Where the extraction loop's time went, and which side bounds it: a loop that mostly waits on
    the backend is compute-bound (as it should be); one that waits on the writers is store-bound."""
    out = {k: round(v, 2) for k, v in {**clock, "drain_writers_s": drain_s}.items()}
    out["writers"] = writers
    out["writer_busy"] = {k: round(v, 2) for k, v in writer.seconds.items()}
    out["writer_utilisation"] = round(writer.seconds["piece_s"] / max(1e-9, writers * compute_s), 3)
    store_wait = clock["wait_writers_s"] + drain_s
    backend_s = clock["wait_backend_s"] + clock["launch_s"]
    out["bound_by"] = "store" if store_wait > 0.1 * compute_s else "backend"  # >10 %: writers hold it back
    busy = writer.seconds
    log.info(
        "%s: host path: the loop spent %.1f s launching + waiting on the backend, %.1f s on the "
        "writers (+%.1f s draining them); %d writers %.0f%% busy; summed over pieces: fill copies %.1f s, "
        "digest %.1f s, encode %.1f s, write+fsync %.1f s -> %s-bound",
        part,
        backend_s,
        clock["wait_writers_s"],
        drain_s,
        writers,
        100 * out["writer_utilisation"],
        busy["fill_s"],
        busy["digest_s"],
        busy["encode_s"],
        busy["write_s"],
        out["bound_by"],
    )
    if out["bound_by"] == "store":
        log.warning(
            "%s: the store path bounds extraction: more writers (extract.writers), store.codec none, "
            "or a faster disk under extract.work_dir",
            part,
        )
    return out


class GateFailed(EaglenestError):
    def __init__(self, metrics: dict):
        self.metrics = metrics
        super().__init__(
            f"part {metrics['part']}: validation gate FAILED, nothing committed: "
            + "; ".join(metrics["validation"]["failures"])
        )


def _launch(backend, batch: list[int], seqs, names, piece: Piece):
    """Start one batch; returns a callable that waits for its outputs. A backend with
    `extract_async` (hf) computes while the caller copies the previous batch out."""

    def named(fn, *a):
        try:
            return fn(*a)
        except SampleFailed as e:
            raise EaglenestError(
                f"sample {names[batch[e.position]]!r} (part piece {piece.index}): {e.reason}. "
                f"Committed pieces are kept; rerun to resume."
            ) from None

    launch = getattr(backend, "extract_async", None)
    if launch is None:
        outs = named(backend.extract, [seqs[i] for i in batch])
        return lambda: outs
    wait = named(launch, [seqs[i] for i in batch])
    return lambda: named(wait)


class _PieceFill:
    """One piece's buffers being filled; the copies run in `fill` threads. `finish` (in a writer
    thread, so the loop never waits on copies) awaits them and fills the padding tail."""

    def __init__(self, piece: Piece, layout: Layout, pool: BufferPool, lengths, names, keys):
        self.piece, self.layout, self.lengths, self.names, self.keys = piece, layout, lengths, names, keys
        self.bufs = pool.get()
        self.start = dict(zip(piece.samples, piece.offsets))
        self.copies = []

    def add(self, batch, outs, seqs, fill: ThreadPoolExecutor) -> None:
        """`outs`: per sample (aux, final) bf16, or the stored arrays already encoded (a dict from
        `state_format.encode`: the hf backend quantizes on the GPU)."""
        A, H, lengths, states = self.layout.n_aux, self.layout.hidden, self.lengths, self.layout.states
        for i, out in zip(batch, outs):
            got = out if isinstance(out, dict) else dict(zip(("aux", "final"), out))
            spec = state_format.arrays(states if isinstance(out, dict) else "bf16", A, H)
            shapes = {k: tuple(t.shape) for k, t in got.items()}
            want = {k: (lengths[i], *row) for k, (row, _) in spec.items()}
            if shapes != want:
                raise EaglenestError(f"backend returned {shapes} for sample {self.names[i]!r}; expected {want}")
        arr = self.bufs.arrays

        def copy_in(items):
            t = time.perf_counter()
            for i, out in items:
                o, n = self.start[i], lengths[i]
                stored = out if isinstance(out, dict) else state_format.encode(*out, states)
                arr["input_ids"][o : o + n] = seqs[i]
                for name, a in state_format.as_numpy(stored, states).items():
                    arr[name][o : o + n] = a
            return time.perf_counter() - t

        self.copies.append(fill.submit(copy_in, list(zip(batch, outs))))

    def settle(self) -> None:
        """Every copy finished or cancelled: the buffers are no longer written."""
        for c in self.copies:
            c.cancel()
        concurrent.futures.wait(self.copies)

    def finish(self) -> tuple[list[dict], float]:
        """(the piece's rows, copy seconds) once every copy is in."""
        concurrent.futures.wait(self.copies)
        fill_s = sum(c.result() for c in self.copies)  # a failed copy raises here
        p, lengths = self.piece, self.lengths
        self.bufs.pad_from(sum(lengths[i] for i in p.samples))  # samples sit back to back from row 0
        base = p.index * self.layout.shard_tokens
        rows = [
            {
                "id": self.names[i],
                "key": self.keys[i],
                "start": base + self.start[i],
                "length": lengths[i],
                "piece": p.index,
            }
            for i in p.samples
        ]  # the writer adds each digest
        return rows, fill_s


def _run_pieces(pending, seqs, lengths, names, keys, backend, layout, batch_tokens, bar, fill, writer, pool) -> dict:
    """Every batch of every pending piece through the backend, the next batch always launched
    before the current one's outputs are awaited, so the GPU never waits on the host; each
    filled piece goes to the writer (copies still running). Returns where this loop waited, in
    seconds: on the backend (compute-bound) or on the writers (store-bound); launch_s = launching
    batches (all of the compute for a backend without `extract_async`)."""
    clock = {"launch_s": 0.0, "wait_backend_s": 0.0, "wait_writers_s": 0.0}
    work = iter(
        [
            (p, b, j == len(bs) - 1)
            for p in pending
            for bs in [length_batches(p.samples, lengths, batch_tokens)]
            for j, b in enumerate(bs)
        ]
    )

    def start(item):
        if item is None:
            return None
        t = time.perf_counter()
        launched = (*item, _launch(backend, item[1], seqs, names, item[0]))
        clock["launch_s"] += time.perf_counter() - t  # a backend without extract_async computes here
        return launched

    current, inflight = None, start(next(work, None))
    try:
        while inflight is not None:
            piece, batch, last, wait = inflight
            inflight = start(next(work, None))
            t = time.perf_counter()
            outs = wait()
            clock["wait_backend_s"] += time.perf_counter() - t
            if current is None:
                current = _PieceFill(piece, layout, pool, lengths, names, keys)
            current.add(batch, outs, seqs, fill)
            bar.update(sum(lengths[i] for i in batch))
            if last:
                t = time.perf_counter()
                writer.put(current)  # the writer owns it from here
                current = None
                clock["wait_writers_s"] += time.perf_counter() - t
    finally:
        if current is not None:  # stop its copies before the pool frees the buffers
            current.settle()
            current.bufs.release()
    return clock


def _gate(store: HiddenStore, target: Target, taps, cfg: dict, device: str) -> tuple[dict, bool]:
    cfg = dict(cfg or {})
    n, seed = int(cfg.pop("samples", 8)), int(cfg.pop("seed", 0))
    if n <= 0:  # benchmarks of the store path with synthetic states only
        log.warning("validation gate DISABLED (validate.samples: 0): nothing checks these states")
        return {"samples": 0, "disabled": True, "passed": True, "taps": {}}, True
    chosen = sorted(np.random.default_rng(seed).choice(len(store), size=min(n, len(store)), replace=False).tolist())

    def read(i):
        ids, aux, final = store.read(i)
        return ids, from_bits(aux), from_bits(final)

    t = time.time()
    with Reference(target, taps, device=device) as ref:
        metrics, passed = run_gate(read, chosen, ref, cfg)
    metrics["sample_ids"] = [store.index[i]["id"] for i in chosen]
    metrics["seed"] = seed
    metrics["seconds"] = round(time.time() - t, 2)
    log.info(
        "validation gate %s on %d samples / %d tokens: %s",
        "passed" if passed else "FAILED",
        metrics["samples"],
        metrics["tokens"],
        ", ".join(f"{k} cos {v['cosine_mean']:.5f} rel {v['rel_err_mean']:.4f}" for k, v in metrics["taps"].items()),
    )
    return metrics, passed


def _finalize(work: WorkDir, out_dir: Path) -> None:
    for junk in work.store.rglob("*.partial"):  # temp files of writes a crash interrupted
        junk.unlink()
    write_checksums(work.store)  # the commit point of the store itself
    publish(work.store, out_dir)  # the previous store stays until the new one is in place
    for stale in work.stale_siblings():
        shutil.rmtree(stale, ignore_errors=True)
    shutil.rmtree(work.path, ignore_errors=True)
