"""The pipelined batch loop of an extraction (docs/design.md: Extraction): the batches of each window
that holds a pending piece through the backend, the next launched before the current one's outputs are
awaited; outputs copied into their pieces' buffers by fill threads; each piece handed to the writer once
its last sample is in. And the account of where that loop waited (`host_path_report`): on the backend
(compute-bound) or on the writers."""

import concurrent.futures
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from eaglenest.extraction.backends import SampleFailed
from eaglenest.extraction.plan import Piece, window_batches
from eaglenest.extraction.work_dir import WorkDir
from eaglenest.extraction.writers import PieceWriter, WriterProcesses
from eaglenest.runtime.errors import EaglenestError
from eaglenest.store import states as state_format
from eaglenest.store.hidden_store import Layout
from eaglenest.store.piece_buffers import BufferPool

log = logging.getLogger(__name__)


def _launch(backend, batch: list[int], seqs, names, piece_of: dict[int, Piece]):
    """Start one batch; returns a callable that waits for its outputs. A backend with
    `extract_async` (hf) computes while the caller copies the previous batch out."""

    def named(fn, *a):
        try:
            return fn(*a)
        except SampleFailed as e:
            i = batch[e.position]
            raise EaglenestError(
                f"sample {names[i]!r} (part piece {piece_of[i].index}): {e.reason}. "
                f"Committed pieces are kept; rerun to resume."
            ) from None

    launch = getattr(backend, "extract_async", None)
    if launch is None:
        outs = named(backend.extract, [seqs[i] for i in batch])
        return lambda: outs
    wait = named(launch, [seqs[i] for i in batch])
    return lambda: named(wait)


class PieceFill:
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


def extract_pieces(windows, todo, seqs, names, keys, backend, layout: Layout, work: WorkDir, batch_tokens: int,
                   writers: int, bar, processes: WriterProcesses | None = None
                   ) -> tuple[dict, PieceWriter, BufferPool, float]:  # fmt: skip
    """The pieces of `windows` (`plan.plan_windows`) whose index is in `todo` through the backend into
    the work store: `writers` background writers (processes when > 1: `processes` if started already),
    pooled piece buffers, two fill threads. Returns
    (where the loop waited, the closed writer, the pool, seconds spent draining the writers); the pool
    still holds its buffers (GBs) for the caller to free, beside the gate. On failure the pool is
    freed here."""
    lengths = [len(s) for s in seqs]
    if processes is None and writers > 1:
        processes = WriterProcesses(writers)
    writer = PieceWriter(work, layout, workers=writers, processes=processes)
    pool = BufferPool(layout, shared=writer.shared)
    try:
        with ThreadPoolExecutor(2, thread_name_prefix="piece-fill") as fill:
            try:
                t_loop = time.perf_counter()
                clock = run_pieces(
                    windows, todo, seqs, lengths, names, keys, backend, layout, batch_tokens, bar, fill, writer, pool
                )  # fmt: skip
                t_drain = time.perf_counter()
            finally:
                writer.close()  # no copy or writer touches the buffers after this
        # a piece handed to a writer process that was not up yet waited for it (`WriterProcesses`)
        clock["writers_ready_s"] = writer.processes.ready_after(t_loop) if writer.processes else 0.0
        return clock, writer, pool, time.perf_counter() - t_drain
    except BaseException:
        pool.close()
        raise


def run_pieces(windows, todo, seqs, lengths, names, keys, backend, layout, batch_tokens, bar, fill, writer,
               pool) -> dict:  # fmt: skip
    """Every batch of each window that holds a piece in `todo`, the next batch always launched before
    the current one's outputs are awaited, so the GPU never waits on the host; each piece goes to the
    writer (copies still running) once its last sample is in. A batch is run whole even where some of
    its samples belong to committed pieces (a resume): their outputs are dropped, and the pending ones
    come out of the same batches, bit for bit, as in an uninterrupted run. Returns where this loop
    waited, in seconds: on the backend (compute-bound) or on the writers (store-bound); launch_s =
    launching batches (all of the compute for a backend without `extract_async`); and the batches'
    padding (real_tokens and padded_tokens, count x longest, over the batches run)."""
    clock = {"launch_s": 0.0, "wait_backend_s": 0.0, "wait_writers_s": 0.0, "new_buffers_s": 0.0}
    t_loop = time.perf_counter()
    clock.update(batches=0, real_tokens=0, padded_tokens=0)
    piece_of, left, batches = {}, {}, []
    for window in windows:
        for p in window:
            piece_of.update(dict.fromkeys(p.samples, p))
            if p.index in todo:
                left[p.index] = len(p.samples)
        # a batch with no pending sample (all its pieces committed: a resume) is not run
        batches += [
            b for b in window_batches(window, lengths, batch_tokens) if any(piece_of[i].index in left for i in b)
        ]
    work = iter(batches)

    def start(batch):
        if batch is None:
            return None
        t = time.perf_counter()
        launched = batch, _launch(backend, batch, seqs, names, piece_of)
        clock["launch_s"] += time.perf_counter() - t  # a backend without extract_async computes here
        clock["batches"] += 1
        clock["real_tokens"] += sum(lengths[i] for i in batch)
        clock["padded_tokens"] += len(batch) * max(lengths[i] for i in batch)
        return launched

    filling: dict[int, PieceFill] = {}
    inflight = start(next(work, None))
    try:
        while inflight is not None:
            batch, wait = inflight
            inflight = start(next(work, None))
            t = time.perf_counter()
            outs = wait()
            clock["wait_backend_s"] += time.perf_counter() - t
            by_piece: dict[int, list] = {}
            for i, out in zip(batch, outs):
                if piece_of[i].index in left:  # else committed already (a resume)
                    by_piece.setdefault(piece_of[i].index, []).append((i, out))
            for k, got in by_piece.items():
                if k not in filling:
                    t = time.perf_counter()  # a piece buffer the pool lacks is allocated here
                    filling[k] = PieceFill(piece_of[got[0][0]], layout, pool, lengths, names, keys)
                    clock["new_buffers_s"] += time.perf_counter() - t
                filling[k].add([i for i, _ in got], [o for _, o in got], seqs, fill)
                bar.update(sum(lengths[i] for i, _ in got))
                left[k] -= len(got)
                if left[k] == 0:
                    t = time.perf_counter()
                    writer.put(filling.pop(k))  # the writer owns it from here
                    clock["wait_writers_s"] += time.perf_counter() - t
    finally:
        for f in filling.values():  # stop their copies before the pool frees the buffers
            f.settle()
            f.bufs.release()
    clock["loop_s"] = time.perf_counter() - t_loop  # the rest: hand-over and bookkeeping per batch
    return clock


def host_path_report(
    part: str, clock: dict, writer: PieceWriter, writers: int, drain_s: float, compute_s: float
) -> dict:
    """Where the extraction loop's time went, and which side bounds it: a loop that mostly waits on
    the backend is compute-bound (as it should be); one that waits on the writers is store-bound."""
    out = {k: round(v, 2) for k, v in {**clock, "drain_writers_s": drain_s}.items()}
    if clock.get("padded_tokens"):  # the forward's share spent on padding rows
        out["batch_padding"] = round(1 - clock["real_tokens"] / clock["padded_tokens"], 4)
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
