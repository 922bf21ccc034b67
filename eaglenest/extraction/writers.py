"""The background piece writers of an extraction: threads, each handing its piece to a writer
process when there are several (spawned, dying with their parent: `store.shard_writer.writer_init`)."""

import os
import queue
import threading
import time
from concurrent.futures import ProcessPoolExecutor

from eaglenest.extraction.work_dir import WorkDir
from eaglenest.runtime.errors import EaglenestError
from eaglenest.store.hidden_store import Layout
from eaglenest.store.shard_writer import import_piece_io, write_piece, write_piece_shared, writer_init


class WriterProcesses:
    """`workers` writer processes, spawned and warmed at once: spawn re-imports the main module (torch
    included), ~4 s per writer on a GPU host. Started before the target loads, they are ready by the
    time the first piece is; started with the loop, each one's first piece waited for it."""

    def __init__(self, workers: int):
        import multiprocessing

        self.ready: list[float] = []  # when each process had run its no-op task
        # spawn: the parent may hold CUDA state. A worker whose parent is killed exits once its
        # current piece is written (`writer_init`): same bytes as the resumed run writes.
        self.pool = ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=writer_init, initargs=(os.getpid(),)
        )
        for _ in range(workers):  # one no-op task each: the pool spawns a process per task it cannot place
            self.pool.submit(import_piece_io).add_done_callback(lambda _: self.ready.append(time.perf_counter()))

    def ready_after(self, t: float) -> float:
        """Seconds after `t` until the last writer process was ready (0.0: all were by then)."""
        return max(0.0, max(self.ready, default=time.perf_counter()) - t)

    def close(self) -> None:
        self.pool.shutdown()


class PieceWriter:
    """Background writers: finished pieces are digested, zarr-encoded, written and fsynced while the
    caller computes the next piece — in `workers` threads, each handing its piece to a writer
    process when given `processes` (zarr encodes on one event loop per process). One piece = one
    shard file per array, so writers never share a file; a piece is committed by its manifest, in
    any order."""

    def __init__(self, work: WorkDir, layout: Layout, workers: int = 1, processes: WriterProcesses | None = None):
        self.work, self.layout = work, layout
        # pieces waiting beyond those being written: absorbs a disk's fsync stalls without stalling
        # the GPU (each holds one pooled piece buffer)
        self.q: queue.Queue = queue.Queue(maxsize=2 * workers)
        self.error: BaseException | None = None
        self.bytes_written = 0
        # seconds summed over pieces (writers run in parallel): where the store path spends its time
        self.seconds = {
            "wait_fill_s": 0.0,
            "fill_s": 0.0,
            "digest_s": 0.0,
            "encode_s": 0.0,
            "write_s": 0.0,
            "call_s": 0.0,
            "commit_s": 0.0,
            "piece_s": 0.0,
        }
        self.lock = threading.Lock()
        self.processes = processes
        self.pool = processes.pool if processes else None
        self.threads = [
            threading.Thread(target=self._run, name=f"piece-writer-{i}", daemon=True) for i in range(workers)
        ]
        for t in self.threads:
            t.start()

    @property
    def shared(self) -> bool:
        return self.pool is not None

    def put(self, item) -> None:
        """Queue a piece being filled (`pipeline.PieceFill`: bufs, piece, finish(), settle())."""
        while True:
            if self.error is not None:
                raise self.error
            try:
                self.q.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def close(self) -> None:
        """Waits for every queued piece (after an error they are skipped, their copies settled), so
        no buffer is freed under a running copy; then raises the first error."""
        for _ in self.threads:
            self.q.put(None)  # the threads keep draining the queue, error or not
        for t in self.threads:
            t.join()
        if self.processes is not None:
            self.processes.close()
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while (piece := self.q.get()) is not None:
            bufs, index = piece.bufs, piece.piece.index
            try:
                if self.error is not None:
                    continue
                t = time.perf_counter()
                rows, fill_s = piece.finish()  # its copies, then the padding tail
                filled = {"wait_fill_s": time.perf_counter() - t, "fill_s": fill_s}
                t = time.perf_counter()
                if self.pool is not None:
                    digests, written, phases = self.pool.submit(
                        write_piece_shared, str(self.work.store), index, self.layout, bufs.spec, rows
                    ).result()
                else:
                    digests, written, phases = write_piece(self.work.store, index, self.layout, bufs.arrays, rows)
                for r, d in zip(rows, digests):  # the digest of the exact bytes stored
                    r["digest"] = d
                t_commit = time.perf_counter()
                self.work.commit_piece(index, rows)  # its manifest, fsynced with its directory
                done = time.perf_counter()
                # piece_s = the writer's call_s (+ the hand-over to its process) + commit_s
                phases.update(filled, commit_s=done - t_commit, piece_s=done - t)
                with self.lock:
                    self.bytes_written += written
                    for k, v in phases.items():
                        self.seconds[k] += v
            except OSError as e:
                self.error = EaglenestError(
                    f"writing piece {index} of part {self.work.part} under {self.work.path} failed: {e} "
                    f"(disk full or a size limit?). Committed pieces are kept; free space and rerun to resume."
                )
            except BaseException as e:  # noqa: BLE001 - surfaced to the main thread
                self.error = e
            finally:
                piece.settle()  # an error path may leave copies running
                bufs.release()
