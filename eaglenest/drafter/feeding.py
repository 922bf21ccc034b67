"""Feeding the trainer: a step's micro-batches from pack's split, read from the stores by loader
processes (or this one) ahead of the step that runs, pinned and decoded on the training device.
`Trainer` inherits it; the attributes it reads (cfg, device, world, rank, splits, loader, bucket,
longest, K, ahead) are the trainer's."""

import logging
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from eaglenest.data.loader import BatchLoader, SlotBatch, layout_bytes, shared_memory_free
from eaglenest.data.packed import PackedSplit, batch_layout, batch_shape, decode_states, epoch_batches
from eaglenest.runtime import host_memory
from eaglenest.runtime.errors import EaglenestError

log = logging.getLogger(__name__)


def step_counts(split: PackedSplit, idx: list[int], K: int) -> np.ndarray:
    """Masked-token count per TTT step of these samples (same rule as ttt.step_masks)."""
    out = np.zeros(K)
    for i in idx:
        x = split.token_arrays(i)
        lm, iv = np.asarray(x["loss_mask"], np.int64), np.asarray(x["in_vocab"], np.int64)
        for k in range(K):
            out[k] += (lm[2 + k :] * iv[1 + k : len(lm) - 1]).sum()
    return out


def auto_loader_workers() -> int:
    """Loader processes for a CUDA rank: three quarters of its share of the cores, 1 to 16. A worker
    read ~25k tokens/s of states through zarr (fp8, 3 taps of 576); the GPU profile's drafter takes
    ~230k/s: 4 workers held it at 99k tok/s (0.44x), 12 fed it at 22-25 steps/s (bench/RESULTS.md).
    The shard reader reads ~10x faster on the development box; on the H200 host not measured yet."""
    cores = len(os.sched_getaffinity(0)) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(16, cores * 3 // 4))


class BatchFeeding:
    """The host side of training steps, for `Trainer`."""

    def batches(self, split: PackedSplit, epoch: int) -> list[list[int]]:
        return epoch_batches(split, epoch, self.cfg.seed, self.cfg.batch_tokens, self.bucket)

    def _to_dev(self, b: dict) -> dict:
        # hidden states arrive as stored (bf16 bits or fp8 + scales) and are decoded on the device;
        # master math is fp32 (autocast, when on, picks bf16 kernels)
        on = {k: v.to(self.device, non_blocking=True, copy=isinstance(b, SlotBatch)) for k, v in b.items()}
        self.loader.release(b)  # a loader slot is free again once these copies are done
        b = decode_states(on, self.train_split.states)
        return {k: v.float() if v.is_floating_point() else v for k, v in b.items()}

    def fetch(self, mbs: list[list[int]], split: str = "train") -> list[dict]:
        """Collated micro-batches `mbs` of `split` from the loader, pinned on CUDA."""
        sp = self.splits[split]
        shapes = [batch_shape([sp.length(i) for i in mb], self.bucket, self.cfg.batch_tokens) for mb in mbs]
        batches = [f.result() for f in [self.loader.submit(mb, shape, split) for mb, shape in zip(mbs, shapes)]]
        if self.device.type == "cuda" and not self.loader.pinned:
            pinned = [{k: v.pin_memory() for k, v in b.items()} for b in batches]
            for b in batches:
                self.loader.release(b)
            batches = pinned
        return batches

    def load_step(self, micro: list[list[int]]) -> tuple[list, list[dict]]:
        """Host side of a step (this rank's collated micro-batches, pinned on CUDA, and the step's
        global mask counts): `fit` runs it for the next step while the GPU computes this one."""
        denom = step_counts(self.train_split, [i for mb in micro for i in mb], self.K).tolist()
        return denom, self.fetch(micro[self.rank :: self.world])

    def prefetched(self, steps: list, loader: ThreadPoolExecutor | None, ahead: int = 1, load=None):
        """(step, load(step)) per step, `load_step` by default; the next `ahead` steps' loads run in
        `loader` meanwhile (with loader processes, one a worker: a step's sample can take a core 0.1 s
        to read). No `loader`: each is loaded when its turn comes."""
        load = load or self.load_step
        if loader is None:
            yield from ((m, load(m)) for m in steps)
            return
        pending = deque(loader.submit(load, m) for m in steps[:ahead])
        for s, micro in enumerate(steps):
            loaded = pending.popleft().result()
            if s + ahead < len(steps):
                pending.append(loader.submit(load, steps[s + ahead]))
            yield micro, loaded

    def start_loader(self, workers: int | str) -> int:
        """Start `workers` loader processes (auto: `auto_loader_workers` on CUDA, none on the CPU) with
        slots for every micro-batch in flight: this rank's micro-batches of the step that runs and of
        `self.ahead` steps loading (2 a process), fewer steps ahead where shared memory is short.
        Returns `self.ahead`."""
        auto = workers == "auto"
        if auto:
            workers = auto_loader_workers() if self.device.type == "cuda" else 0
        workers, m = int(workers), self.cfg.micro_batches // self.world
        longest = -(-self.longest // self.bucket) * self.bucket if self.bucket else self.longest
        # a batch pads to at most batch_tokens, or to one sample's length: that layout bounds every one
        size = layout_bytes(batch_layout(self.train_split, 1, max(self.cfg.batch_tokens, longest)))
        budget = min(shared_memory_free(), host_memory.available() // 4)
        self.ahead = min(2 * workers, budget // (m * size) - 1) if workers else 1
        if workers and self.ahead < 1:
            need = f"{2 * m * size / 1e9:.2f} GB of shared memory for {2 * m} batches, {budget / 1e9:.2f} GB usable"
            if not auto:
                raise EaglenestError(f"train.loader_workers {workers}: {need}; set it to 0 or free /dev/shm")
            log.warning("no loader processes: %s", need)
            workers, self.ahead = 0, 1
        self.loader = BatchLoader(self.packed, self.stores, self.splits, workers, (self.ahead + 1) * m, size)
        log.info(
            "training batches read from the stores by %s",
            f"{workers} loader processes, {self.ahead} steps ahead, {(self.ahead + 1) * m} slots of "
            f"{size / 1e6:.1f} MB{' page-locked' if self.loader.pinned else ''}"
            if workers
            else "this process",
        )
        return self.ahead
