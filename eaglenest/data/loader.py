"""Collated training batches read from the stores by worker processes (`train.loader_workers`):
reading and digest-checking a sample costs ~10-30 ms of one core in zarr, which a GPU's training
step must not wait on. With no workers the batches are collated in the calling process."""

import multiprocessing as mp
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path

import torch

from eaglenest.data.packed import PackedSplit, collate

_splits: dict = {}  # a worker's open splits


def _init(packed: str, hidden_dir: str) -> None:
    torch.set_num_threads(1)  # a worker reads; the trainer's process computes
    _splits.update(train=PackedSplit(Path(packed), "train", Path(hidden_dir)))


def _collate(idx: list[int], shape: tuple[int, int]) -> dict:
    return {k: v.numpy() for k, v in collate(_splits["train"], idx, shape).items()}  # numpy: pickled by value


class BatchLoader:
    """`submit(idx, shape)` -> a future of the train split's collated batch (torch tensors)."""

    def __init__(self, packed: Path, hidden_dir: Path, split: PackedSplit, workers: int):
        self.split, self.pool = split, None
        if workers > 0:
            self.pool = ProcessPoolExecutor(
                workers, mp_context=mp.get_context("spawn"), initializer=_init, initargs=(str(packed), str(hidden_dir))
            )

    def submit(self, idx: list[int], shape: tuple[int, int]) -> Future:
        if self.pool is None:
            done = Future()
            done.set_result(collate(self.split, idx, shape))
            return done
        return _as_tensors(self.pool.submit(_collate, idx, shape))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _as_tensors(future: Future) -> Future:
    out = Future()

    def done(f: Future) -> None:
        if f.exception() is not None:
            out.set_exception(f.exception())
        else:
            out.set_result({k: torch.from_numpy(v) for k, v in f.result().items()})

    future.add_done_callback(done)
    return out
