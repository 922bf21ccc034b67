"""Collated training batches read from the stores by worker processes (`train.loader_workers`):
reading and digest-checking a sample costs ~0.7-4 ms of one core (store/shard_reader.py), which a GPU's
training step must not wait on. With no workers the batches are collated in the calling process.

Workers write each batch straight into a slot of one shared-memory buffer, page-locked on CUDA, so
the training process neither unpickles nor pins a batch: it copies the slot to the device and hands
the slot back (`release`) once that copy is done. Sending 67 MB batches through a pipe and pinning
them held an H200's trainer at 0.51x of memory-mapped copies (bench/RESULTS.md)."""

import logging
import multiprocessing as mp
import os
import queue
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

from eaglenest.data.packed import PackedSplit, as_tensors, batch_layout, collate, collate_into
from eaglenest.runtime import children
from eaglenest.runtime.errors import EaglenestError

log = logging.getLogger(__name__)
ALIGN = 4096
_worker: dict = {}  # a worker's open split and its view of the slots


def _init(packed: str, hidden_dir: str, names: list[str], slots: torch.Tensor, slot_bytes: int) -> None:
    children.worker_init()
    torch.set_num_threads(1)  # a worker reads; the trainer's process computes
    splits = {n: PackedSplit(Path(packed), n, Path(hidden_dir)) for n in names}
    _worker.update(splits=splits, slots=slots.numpy(), size=slot_bytes)


def _nbytes(dtype: np.dtype, shape: tuple) -> int:
    return int(np.prod(shape)) * dtype.itemsize


def _aligned(n: int) -> int:  # each array of a slot starts 64-byte aligned
    return -(-n // 64) * 64


def views(buf: np.ndarray, layout: dict) -> dict[str, np.ndarray]:
    """The arrays of `layout` laid one after another (64-byte aligned) in the byte buffer `buf`."""
    out, at = {}, 0
    for k, (dtype, shape) in layout.items():
        n = _nbytes(dtype, shape)
        out[k] = buf[at : at + n].view(dtype).reshape(shape)
        at += _aligned(n)
    return out


def layout_bytes(layout: dict) -> int:
    return sum(_aligned(_nbytes(d, s)) for d, s in layout.values())


def _collate(name: str, idx: list[int], shape: tuple[int, int], slot: int) -> None:
    split, size = _worker["splits"][name], _worker["size"]
    layout = batch_layout(split, *shape)
    buf = _worker["slots"][slot * size : slot * size + layout_bytes(layout)]
    buf[:] = 0
    collate_into(split, idx, views(buf, layout))


class SlotBatch(dict):
    """A collated batch whose tensors are views of loader slot `slot` (valid until `release`)."""

    slot: int


class BatchLoader:
    """`submit(idx, shape, split)` -> a future of that split's collated batch (torch tensors); `splits`
    names the packed splits it reads (train, and val: the per-epoch validation reads through the
    workers too, or it costs a GPU run ~15 s of one process's reading every epoch).

    With workers: `slots` buffers of `slot_bytes` each; a submit waits for a free one, and every batch
    it gives must be `release`d once copied off (the trainer holds at most `slots` at once)."""

    def __init__(
        self,
        packed: Path,
        hidden_dir: Path,
        splits: dict[str, PackedSplit],
        workers: int,
        slots: int = 0,
        slot_bytes: int = 0,
    ):
        self.splits, self.pool, self.pinned = splits, None, False
        if workers <= 0:
            return
        self.size = -(-slot_bytes // ALIGN) * ALIGN
        self.buf = torch.empty(slots * self.size, dtype=torch.uint8).share_memory_()
        if torch.cuda.is_available():  # page-locked in place: the device copies it by DMA, asynchronously
            err = torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), self.buf.numel(), 0)
            self.pinned = int(err) == 0
            if not self.pinned:
                log.warning("loader slots not page-locked (cudaHostRegister: %s): copies to the GPU wait", err)
        self.free = queue.Queue()
        for i in range(slots):
            self.free.put((i, None))
        self.pool = ProcessPoolExecutor(
            workers,
            mp_context=mp.get_context("spawn"),
            initializer=_init,
            initargs=(str(packed), str(hidden_dir), list(splits), self.buf, self.size),
        )

    def submit(self, idx: list[int], shape: tuple[int, int], split: str = "train") -> Future:
        if self.pool is None:
            done = Future()
            done.set_result(collate(self.splits[split], idx, shape))
            return done
        layout = batch_layout(self.splits[split], *shape)
        if layout_bytes(layout) > self.size:
            raise EaglenestError(f"a batch of shape {shape} does not fit a loader slot of {self.size} bytes")
        slot, copied = self.free.get()
        if copied is not None:
            copied.synchronize()  # the last copy out of this slot is done
        out = Future()

        def done(f: Future) -> None:
            if f.exception() is not None:
                self.free.put((slot, None))
                out.set_exception(f.exception())
                return
            arrays = views(self.buf[slot * self.size : (slot + 1) * self.size].numpy(), layout)
            batch = SlotBatch(as_tensors(arrays))
            batch.slot = slot
            out.set_result(batch)

        self.pool.submit(_collate, split, idx, shape, slot).add_done_callback(done)
        return out

    def release(self, batch: dict) -> None:
        """Give `batch`'s slot back once the copies queued from it on the current CUDA stream are done
        (a batch not from a slot: nothing to do)."""
        if not isinstance(batch, SlotBatch):
            return
        copied = None
        if self.pinned:
            copied = torch.cuda.Event()
            copied.record()
        self.free.put((batch.slot, copied))

    def close(self) -> None:
        if self.pool is None:
            return
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.pinned:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr())
            self.pinned = False
        self.pool = None


def shared_memory_free() -> int:
    """Bytes free where shared memory lives (/dev/shm: a container may mount it small)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize
