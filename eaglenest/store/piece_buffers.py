"""Piece buffers (docs/design.md: Extraction): one piece's rows of every stored array, in process
memory or in shared memory that writer processes map, reused through a pool; shared-memory names
carry the creator's PID so a killed run's buffers are swept by the next run."""

import logging
import os
import secrets
import threading
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np

from eaglenest.store.hidden_store import Layout, fill_value

log = logging.getLogger(__name__)


class PieceBuffers:
    """One piece's rows of every stored array (`Layout.arrays`: input_ids int32, -1 = padding, and
    the state arrays), optionally in shared memory. Not initialised: the filler writes every
    sample row, then `pad_from` the tail. Taken from and given back to a `BufferPool`: fresh pages
    cost a page fault each (a 200 MB piece copied into new shared memory ran at ~1.3 GB/s, into
    touched memory at ~10 GB/s), so pieces reuse buffers."""

    def __init__(self, layout: Layout, shared: bool, pool: "BufferPool | None" = None):
        self.shm, self.arrays, self.pool = {}, {}, pool
        shapes = {}
        for name, (row, dtype) in layout.arrays().items():
            shapes[name] = (layout.shard_tokens, *row)
            size = int(np.prod(shapes[name])) * dtype.itemsize
            if shared:
                self.shm[name] = shared_memory.SharedMemory(create=True, size=size, name=shm_name())
                self.arrays[name] = np.ndarray(shapes[name], dtype=dtype, buffer=self.shm[name].buf)
            else:
                self.arrays[name] = np.empty(shapes[name], dtype=dtype)
        self.spec = (
            {name: (self.shm[name].name, shapes[name], a.dtype.str) for name, a in self.arrays.items()}
            if shared
            else None
        )

    def pad_from(self, row: int) -> None:
        """Rows past the last sample hold the fill values (ids -1, states 0)."""
        for name, a in self.arrays.items():
            a[row:] = fill_value(name)

    def release(self) -> None:
        """Back to the pool (its contents are rewritten before the next use), or freed."""
        if self.pool is not None:
            self.pool.give_back(self)
        else:
            self.destroy()

    def destroy(self) -> None:
        self.arrays = {}
        for shm in self.shm.values():
            try:
                shm.close()
            except BufferError:  # a view still alive (an error path): the mapping goes with it
                pass
            shm.unlink()
        self.shm = {}


SHM_PREFIX = "eaglenest-"  # /dev/shm/eaglenest-<creator pid>-<random>


def shm_name() -> str:
    return f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"


def sweep_stale_shm(root: Path = Path("/dev/shm")) -> int:
    """Unlink piece buffers whose creator is dead (a SIGKILLed run: no exit path of its own ran,
    and multiprocessing's resource tracker may be gone too). Returns how many."""
    n = 0
    for p in root.glob(f"{SHM_PREFIX}*-*"):
        try:
            pid = int(p.name[len(SHM_PREFIX) :].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            p.unlink(missing_ok=True)
            n += 1
        except (ValueError, PermissionError):  # not ours, or another user's live process
            pass
    return n


class BufferPool:
    """Piece buffers of one layout, reused; `close` frees them all (shared memory outlives the
    process otherwise; a killed run's are swept by the next shared pool)."""

    def __init__(self, layout: Layout, shared: bool):
        self.args, self.free, self.made = (layout, shared), [], []
        self.lock = threading.Lock()
        if shared and (n := sweep_stale_shm()):
            log.warning("removed %d shared-memory piece buffers left by a killed extraction", n)

    def get(self) -> PieceBuffers:
        with self.lock:
            if self.free:
                return self.free.pop()
        b = PieceBuffers(*self.args, pool=self)
        with self.lock:
            self.made.append(b)
        return b

    def give_back(self, b: PieceBuffers) -> None:
        with self.lock:
            self.free.append(b)

    def close(self) -> None:
        for b in self.made:
            b.destroy()
        self.made, self.free = [], []
