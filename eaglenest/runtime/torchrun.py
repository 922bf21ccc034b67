"""How many ranks the train stage runs (`train.nproc`), and starting them under torchrun, so that
`dvc repro` trains on every GPU of a host without a hand-written launch command."""

import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from eaglenest.runtime.errors import RANK_ERRORS, EaglenestError

log = logging.getLogger("eaglenest.runtime.torchrun")


def under_torchrun() -> bool:
    """This process is one of torchrun's ranks (or a hand-made launch that set the same variables)."""
    return "WORLD_SIZE" in os.environ


def visible_gpus(device: str) -> int:
    """CUDA devices `train.device` gives a rank per GPU: all for auto or cuda, one for cuda:N."""
    import torch  # only the launcher's own process needs it, and only here

    if device == "cpu" or not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count() if device in ("auto", "cuda") else 1


def ranks(nproc: int | str, micro_batches: int, gpus: int) -> int:
    """The world size for `train.nproc` on a host with `gpus` visible CUDA devices (0: training on the
    CPU). auto: one rank per GPU, as many as split `train.micro_batches` evenly (each optimizer step's
    micro-batches are dealt out over the ranks, so the global batch stays the recipe's); 1 on the CPU.
    A number is taken as given (on the CPU: gloo processes) once it fits the GPUs and the micro-batches."""
    if nproc == "auto":
        n = max((r for r in range(1, max(gpus, 1) + 1) if micro_batches % r == 0), default=1)
        if n < gpus:
            log.warning(
                "%d GPUs visible, but train.micro_batches %d splits over %d rank(s) only: training on %d "
                "(make micro_batches a multiple of %d to use them all)",
                gpus, micro_batches, n, n, gpus,
            )  # fmt: skip
        return n
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise EaglenestError(f"train.nproc must be auto or an integer >= 1, got {nproc!r} (params.yaml `train`)")
    if gpus and nproc > gpus:
        raise EaglenestError(f"train.nproc {nproc}: train.device has only {gpus} GPU(s) (params.yaml `train`)")
    if micro_batches % nproc:
        raise EaglenestError(
            f"train.nproc {nproc} does not divide train.micro_batches {micro_batches}: each optimizer step's "
            f"micro-batches are dealt out over the ranks (params.yaml `train`)"
        )
    return nproc


def relaunch(n: int, module: str, argv: list[str]) -> int:
    """Run `python -m module argv` as n ranks under torchrun and return its exit status; where a rank
    failed on bad input, raise its error line instead (after torchrun's report, it is the last line).
    torchrun runs in a session of its own, so a Ctrl-C or DVC's SIGTERM reaches it once, through this
    process, and it stops its ranks; its log directory (which torchrun never removes) lives only as
    long as the run."""
    with tempfile.TemporaryDirectory(prefix="eaglenest-torchrun-") as logs:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
        env = {**os.environ, RANK_ERRORS: logs}
        child = subprocess.Popen([*cmd, f"--log-dir={logs}", "-m", module, *argv], env=env, start_new_session=True)

        def forward(sig, _frame):
            child.send_signal(sig)

        before = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            code = child.wait()
        finally:
            for s, handler in before.items():
                signal.signal(s, handler)
        failed = sorted(Path(logs).glob("rank-*.txt"))
        if code and failed:
            also = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
            rank = int(failed[0].stem.removeprefix("rank-"))
            raise EaglenestError(f"rank {rank} of {n} under torchrun{also}: {failed[0].read_text()}")
        return code
