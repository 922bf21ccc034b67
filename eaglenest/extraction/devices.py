"""One part over several devices (docs/design.md: Extraction). Windows of pieces (`plan.plan_windows`)
are dealt round-robin over the devices: the calling process (rank 0) extracts its share with its own
backend, and torch.multiprocessing starts one worker per other device, each with its own backend,
writers and piece buffers, writing whole pieces into the same work store. The caller then gates and
publishes once. A piece's bytes depend only on its window's samples (the batches are planned per
window), so the store is the same for any device count."""

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as tmp
from torch.multiprocessing.spawn import ProcessException
from tqdm import tqdm

from eaglenest.extraction.plan import Piece
from eaglenest.runtime.errors import EaglenestError
from eaglenest.store.hidden_store import Layout
from eaglenest.target.directory import Target
from eaglenest.target.loading import use_device

log = logging.getLogger(__name__)


def devices_for(count: int | str, device: str) -> list[str]:
    """The devices of `extract.devices` (auto = every visible GPU, or 1 off CUDA) for `extract.device`."""
    on_cuda = device in ("auto", "cuda") and torch.cuda.is_available()
    if count == "auto":
        count = torch.cuda.device_count() if on_cuda else 1
    if int(count) < 1:
        raise EaglenestError(f"extract.devices must be auto or an integer >= 1, got {count!r}")
    if int(count) == 1:
        return [device]
    if on_cuda:
        if int(count) > torch.cuda.device_count():
            raise EaglenestError(f"extract.devices {count}: only {torch.cuda.device_count()} GPUs are visible")
        return [f"cuda:{i}" for i in range(int(count))]
    if device.startswith("cuda:"):
        raise EaglenestError(f"extract.devices {count} with extract.device {device}: use device auto or cuda")
    return [device] * int(count)  # several processes on one device: the CPU, or tests


def share(windows: list[list[Piece]], rank: int, world: int) -> list[list[Piece]]:
    return windows[rank::world]


def cpu_threads(devices: list[str]) -> int:
    """Torch threads per process: the cores split between the processes that compute on the CPU."""
    on_cpu = sum(d == "cpu" for d in devices)
    return max(1, (os.cpu_count() or 1) // on_cpu) if on_cpu else torch.get_num_threads()


@contextlib.contextmanager
def limit_threads(n: int | None):
    """This process's torch threads set to n (None: unchanged) for the block."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class Job:
    """What one worker needs; picklable (spawned processes)."""

    rank: int
    device: str
    backend: str
    backend_kw: dict
    target: Target
    tokenized: Path
    work_root: Path
    part: str
    work_key: str
    layout: Layout
    windows: list[list[Piece]]
    todo: set[int]  # the pending pieces' indices
    keys: list[str]
    batch_tokens: int
    writers: int
    threads: int


def start(jobs: list[Job]):
    """The workers, started; `join` waits for them."""
    return tmp.start_processes(_run, args=(jobs,), nprocs=len(jobs), join=False, start_method="spawn")


def join(ctx, jobs: list[Job]) -> None:
    """Waits for every worker; the first failure stops the others and is raised naming its worker
    (the pieces committed so far stay: a rerun resumes)."""
    try:
        while not ctx.join():
            pass
    except ProcessException as e:
        job = jobs[e.error_index]
        last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise EaglenestError(
            f"part {job.part}: extraction worker {job.rank} on {job.device} failed: {last}. "
            f"Committed pieces are kept; rerun to resume."
        ) from None
    finally:  # a failed worker's traceback file (torch's, in TMPDIR): read above, never removed by torch
        for f in ctx.error_files:
            if f:
                Path(f).unlink(missing_ok=True)


def stop(ctx) -> None:
    for p in ctx.processes:
        if p.is_alive():
            p.terminate()
    for p in ctx.processes:
        p.join()


def _run(i: int, jobs: list[Job]) -> None:
    from eaglenest.extraction.backends import make_backend
    from eaglenest.extraction.pipeline import extract_pieces
    from eaglenest.extraction.plan import read_tokenized
    from eaglenest.extraction.work_dir import WorkDir

    job = jobs[i]
    torch.set_num_threads(job.threads)
    use_device(job.device)  # the backend's streams and events go to the current device
    backend = make_backend(job.backend, target=job.target, device=job.device, **job.backend_kw)
    try:
        names, seqs = read_tokenized(job.tokenized)
        work = WorkDir(job.work_root, job.part, job.work_key)
        with tqdm(disable=True) as bar:
            _, _, pool, _ = extract_pieces(job.windows, job.todo, seqs, names, job.keys, backend, job.layout, work,
                                           job.batch_tokens, job.writers, bar)  # fmt: skip
        pool.close()
    finally:
        backend.close()
