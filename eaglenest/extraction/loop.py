"""Extract one part's hidden states into a Zarr store, crash-safe and resumable
(docs/design.md: Store, Extraction).

A work directory outside the DVC outputs, keyed by (input hash, target, extractor, layout), holds
the store being built. Each piece (= one zarr shard per array) is encoded and written by a
background writer (`writers`, `store.shard_writer`: temp name, fsync, rename), then its manifest is written
(temp + fsync + rename). A manifest commits a piece; a restart keeps committed pieces and
extracts only the rest. After the validation gate passes, the index is written and the store
is renamed into the output in one step; a failed gate commits nothing."""

import logging
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from eaglenest.extraction.devices import Job, cpu_threads, join, limit_threads, share, start, stop
from eaglenest.extraction.fingerprint import extractor_fingerprint, extractor_info, sample_key
from eaglenest.extraction.gate import replays_routing
from eaglenest.extraction.pipeline import extract_pieces, host_path_report
from eaglenest.extraction.plan import PLAN, plan_pieces, plan_windows, read_tokenized, tokenized_file
from eaglenest.extraction.reference import choose_streamed
from eaglenest.extraction.reference_process import LocalReference, ReferenceProcess, choose, start_reference
from eaglenest.extraction.work_dir import WorkDir, check_writable, part_lock
from eaglenest.extraction.writers import WriterProcesses
from eaglenest.files.hashing import sha256_file, sha256_text
from eaglenest.runtime.errors import EaglenestError
from eaglenest.store import states as state_format
from eaglenest.store.hidden_store import (
    SCHEMA_VERSION,
    TAP_SEMANTICS,
    HiddenStore,
    Layout,
    write_index,
)
from eaglenest.target.directory import Target, model_config

log = logging.getLogger(__name__)


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
    devices: list[str] | None = None,
    backend_spec: tuple[str, dict] | None = None,
) -> dict:
    """devices: more than one shares the pending pieces round-robin with worker processes, each
    building its backend from backend_spec (name, options without the device): `devices`."""
    t0 = time.time()
    layout = Layout.for_sizes(target.hidden_size, len(taps), max_seq_len=max_seq_len, **layout_cfg)
    described = backend.describe()
    info = extractor_info(described, taps, dtype, revision)
    efp = extractor_fingerprint(info)
    forward = "transformers' forward" if str(described.get("version", "")).startswith("transformers") else "own layers"
    if described.get("backend") == "hf":  # which code computes the states (docs/design.md: Extraction)
        log.info("%s: hf backend on %s: %s (%s)", part, described.get("device"), forward, described.get("version"))
    input_sha = sha256_file(tokenized_file(tokenized))
    work_key = sha256_text(input_sha, target.fingerprint, efp, str(asdict(layout)), PLAN)
    work = WorkDir(work_root, part, work_key)
    # the gate's reference, whole or streamed (`reference.choose_streamed`), chosen before any work: a
    # checkpoint, architecture or memory budget it cannot work with fails the part with nothing written.
    # Before the backend loads: `beside` counts the extraction's weights as still to come
    streamed = replay = None
    if gate_samples(validate_cfg) > 0:
        streamed, why = choose_streamed(target, described.get("device", "cpu"), validate_cfg or {},
                                        beside=described.get("backend") == "hf")  # fmt: skip
        replay = replays_routing(validate_cfg or {}, model_config(target))
        log.info("%s: the gate's float32 reference on %s: %s%s", part, described.get("device", "cpu"), why,
                 "; it replays the experts the bf16 forward chose" if replay else "")  # fmt: skip
    if not work.committed() and hasattr(backend, "start_load"):  # not a resume: the target will be needed
        backend.start_load()  # it loads (and its kernels build) while the part is read and planned
    names, seqs = read_tokenized(tokenized)
    if not seqs:
        raise EaglenestError(f"{tokenized}: no samples to extract")
    lengths = [len(s) for s in seqs]
    if max(lengths) > max_seq_len:
        raise EaglenestError(f"{tokenized}: a sample has {max(lengths)} tokens > max_seq_len {max_seq_len}")
    pieces = plan_pieces(lengths, layout.shard_tokens)
    windows = plan_windows(pieces, lengths, batch_tokens)
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
    work.open_store(layout, len(pieces), attrs)
    done = work.committed()
    pending = [p for p in pieces if p.index not in done]
    todo = {p.index for p in pending}
    # the unit of work (and of sharing between devices) is a window: its batches span its pieces
    open_windows = [w for w in windows if any(p.index in todo for p in w)]
    if done:
        log.info("%s: resuming: %d of %d pieces already committed in %s", part, len(done), len(pieces), work.path)
    keys = [sample_key(target.fingerprint, efp, s.tobytes()) for s in seqs]

    todo_tokens = sum(lengths[i] for p in pending for i in p.samples)
    devices = devices or [described.get("device", "cpu")]
    world = len(devices)
    # half the cores, at most 8, over the devices: a GPU host's 16 cores write ~1.7 GB/s of zstd-1
    # shards with 8; the other half run the loops, the fill copies and the backends
    writers = max(1, (writers or min(8, (os.cpu_count() or 2) // 2)) // world)
    mine = share(open_windows, 0, world)
    t_compute = time.time()
    workers = freeing = None
    # the gate's reference: on a GPU in a process of its own from here on, loading and taking the gate's
    # samples' states while this process loads and compiles; on the CPU here, after the loop
    # (`reference_process`)
    n_gate, seed = gate_samples(validate_cfg), int((validate_cfg or {}).get("seed", 0))
    reference = captured = processes = None
    try:
        if writers > 1 and mine:  # spawned while the target loads, so no piece waits for one
            processes = WriterProcesses(writers)
        if n_gate > 0:
            chosen = choose(len(seqs), n_gate, seed)
            # a mixture of experts: the gate replays the experts this very forward chose (`routing.Capture`)
            # handed to the reference as soon as kept (`reference` is bound by then: the loop has begun)
            captured = (
                replay
                and hasattr(backend, "watch_routing")
                and backend.watch_routing([seqs[i] for i in chosen], then=lambda kept: reference.take_routing(kept))
            )
            if captured:  # the windows holding the gate's samples first: the reference's states beside the rest
                gate_set = set(chosen)
                mine.sort(key=lambda w: not any(i in gate_set for p in w for i in p.samples))
            reference = start_reference(target, taps, described.get("device", "cpu"), tokenized, chosen, streamed,
                                        replay, captured)  # fmt: skip
        if mine and getattr(backend, "loaded", True) is False:  # the hf backend (or waits for `start_load`)
            backend.load()
        if world > 1 and len(open_windows) > 1:
            if backend_spec is None:
                raise EaglenestError(f"{part}: extraction over {world} devices needs the backend's name and options")
            jobs = [
                Job(rank=r, device=devices[r], backend=backend_spec[0], backend_kw=backend_spec[1], target=target,
                    tokenized=Path(tokenized), work_root=Path(work_root), part=part, work_key=work_key, layout=layout,
                    windows=share(open_windows, r, world), todo=todo, keys=keys, batch_tokens=batch_tokens,
                    writers=writers, threads=cpu_threads(devices))
                for r in range(1, world)
            ]  # fmt: skip
            workers = start(jobs)
            log.info("%s: %d of %d windows of pieces on %s here, the rest on %s", part, len(mine), len(open_windows),
                     devices[0], ", ".join(devices[1:]))  # fmt: skip
        elif world > 1:
            mine = open_windows  # one window (or none) left: nothing to share
        with (
            limit_threads(cpu_threads(devices) if workers else None),
            tqdm(
                total=sum(lengths[i] for w in mine for p in w if p.index in todo for i in p.samples),
                unit="tok",
                unit_scale=True,
                desc=f"extract {part}" + (f" [1 of {world} devices]" if workers else ""),
                disable=not progress,
                smoothing=0.1,
            ) as bar,
        ):
            clock, writer, pool, drain_s = extract_pieces(
                mine, todo, seqs, names, keys, backend, layout, work, batch_tokens, writers, bar, processes
            )
        # The piece buffers (GBs of shared memory, ~0.25 s per GB to free) are freed beside the gate
        freeing = threading.Thread(target=pool.close, name="free-piece-buffers")
        freeing.start()
        if workers is not None:
            join(workers, jobs)
            workers = None
        compute_s = time.time() - t_compute
        host_path = host_path_report(part, clock, writer, writers, drain_s, compute_s)
        rows = [r for m in work.committed().values() for r in m["samples"]]
        if len(rows) != len(seqs):
            raise EaglenestError(f"{part}: {len(rows)} samples committed, expected {len(seqs)}")
        position = {name: i for i, name in enumerate(names)}
        write_index(work.store, sorted(rows, key=lambda r: position[r["id"]]))  # the part's order, not the pieces
        store = HiddenStore(work.store, check_metadata=False)  # not committed yet

        t_gate = time.time()
        gate_metrics, passed = _gate(
            store, reference, validate_cfg, getattr(backend, "routing", None) if captured else None
        )
        gate_s = time.time() - t_gate
        stored_bytes = sum(f.stat().st_size for f in work.store.rglob("*") if f.is_file())
        raw = sum(lengths) * (len(taps) + 1) * target.hidden_size * 2  # as bf16, uncompressed
        metrics = {
            "part": part,
            "samples": len(seqs),
            "tokens": sum(lengths),
            "pieces": len(pieces),
            "windows": len(windows),
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
            "devices": world,
            "forward_path": forward if described.get("backend") == "hf" else described.get("backend"),
            "host_path": host_path,
            "validation": gate_metrics,
            # everything in this call that is not the forward loop; the stage adds imports and the
            # fingerprint check (stages/extract.py)
            "fixed_cost": {
                "prepare_s": round(t_compute - t0, 2),  # read tokens, input digest, plan, sample keys
                **getattr(backend, "timings", {}),  # load_s, warm_up_s: inside extract_seconds
                "gate_s": round(gate_s, 2),  # waiting for the reference's states + comparing
                # its load and states: on a GPU in its own process beside the load, compile and loop (not
                # in gate_s); on the CPU its load is part of gate_s
                **{k: gate_metrics.get(k, 0.0) for k in ("reference_load_s", "reference_states_s")},
            },
        }
        if not passed:
            metrics["committed"] = False
            raise GateFailed(metrics)
        t_publish = time.time()
        work.finish(out_dir)
        # milliseconds: renames and fsyncs, often under the 5 ms that two decimals would show as 0
        metrics["fixed_cost"]["publish_s"] = round(time.time() - t_publish, 3)
        metrics["total_seconds"] = round(time.time() - t0, 2)
        metrics["committed"] = True
        return metrics
    finally:
        if workers is not None:  # this process failed first: the workers stop too
            stop(workers)
        if freeing is not None:
            freeing.join()
        if reference is not None:  # the reference process ends with the run, whatever happened
            reference.close()
        if processes is not None:  # closed already after a loop; not after a failure before it
            processes.close()


class GateFailed(EaglenestError):
    def __init__(self, metrics: dict):
        self.metrics = metrics
        super().__init__(
            f"part {metrics['part']}: validation gate FAILED, nothing committed: "
            + "; ".join(metrics["validation"]["failures"])
        )


def gate_samples(cfg: dict | None) -> int:
    return int((cfg or {}).get("samples", 8))


def _gate(store: HiddenStore, reference: ReferenceProcess | LocalReference | None, cfg: dict, routing=None):
    if reference is None:  # validate.samples <= 0: benchmarks of the store path with synthetic states only
        log.warning("validation gate DISABLED (validate.samples: 0): nothing checks these states")
        return {"samples": 0, "disabled": True, "passed": True, "taps": {}}, True
    t = time.time()
    metrics, passed = reference.compare(store.path, cfg or {}, routing.chosen if routing is not None else None)
    metrics["sample_ids"] = [store.index[i]["id"] for i in reference.chosen]
    metrics["seed"] = int((cfg or {}).get("seed", 0))
    metrics["seconds"] = round(time.time() - t, 2)
    log.info(
        "validation gate %s on %d samples / %d tokens: %s",
        "passed" if passed else "FAILED",
        metrics["samples"],
        metrics["tokens"],
        ", ".join(f"{k} cos {v['cosine_mean']:.5f} rel {v['rel_err_mean']:.4f}" for k, v in metrics["taps"].items()),
    )
    return metrics, passed
