"""One exception type for bad input and failed checks, and the guard that turns it into an exit code."""

import contextlib
import errno
import functools
import logging
import os
import sys
from pathlib import Path

from eaglenest.runtime import children

log = logging.getLogger("eaglenest")


class EaglenestError(Exception):
    """A failure the user can act on. The message names the file, line or sample."""


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S", stream=sys.stderr
    )


def describe_os_error(e: OSError) -> str:
    """'<path>: <reason>' with a hint for the usual causes (permissions, a full disk)."""
    where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None) or "(no path)"
    hint = {
        errno.EACCES: "check the permissions of that path and its directory",
        errno.EPERM: "check the permissions of that path and its directory",
        errno.EROFS: "the filesystem is read-only",
        errno.ENOSPC: "the disk is full: free space and rerun (committed work is kept)",
        errno.EDQUOT: "the disk quota is exhausted: free space and rerun (committed work is kept)",
        errno.ENOTDIR: "a path component is a file where a directory is expected",
        errno.EISDIR: "a directory is where a file is expected",
    }.get(e.errno, "")
    return f"{where}: {e.strerror or e}" + (f" ({hint})" if hint else "")


def exit_on_error(fn):
    """Run a command-line main: EaglenestError, or an OSError (a path that cannot be read or
    written), -> one clear line on stderr and exit 2; never a bare traceback for those. SIGTERM,
    SIGHUP and SIGINT (Ctrl-C) -> one line and exit 128 + the signal. Either way, and on success,
    no process the command started outlives it (`children`)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        setup_logging()
        before, handlers = set(children.descendants()), children.raise_on_signals()
        try:
            out = fn(*args, **kwargs)
            children.close_compile_workers()  # torch's, by torch, on success (after a failure: ended below)
            return out
        except EaglenestError as e:
            fail(str(e))
        except OSError as e:
            fail(describe_os_error(e))
        except KeyboardInterrupt as e:
            log.error("interrupted by %s; what was committed is kept: rerun to resume", children.signal_name(e))
            sys.exit(children.exit_code(e))
        finally:
            log_gpu_peak()
            if left := children.end_descendants(keep=before):
                log.warning("ended %d process(es) this command had started and left running", len(left))
            children.restore(handlers)  # a main called inside another program leaves its handlers as they were

    return wrapper


# Set by eaglenest/runtime/torchrun.py for the ranks it starts: where a rank leaves its error line, which
# the launcher repeats last, after torchrun's own report, so the cause is what a user sees at the end.
RANK_ERRORS = "EAGLENEST_RANK_ERRORS"


def fail(message: str) -> None:
    log.error("%s", message)
    if folder := os.environ.get(RANK_ERRORS):
        with contextlib.suppress(OSError):  # the line on stderr above is the error either way
            Path(folder, f"rank-{int(os.environ.get('RANK', '0')):05d}.txt").write_text(message)
    sys.exit(2)


def log_gpu_peak() -> None:
    """A command that used the GPU logs its peak memory as it ends (also on an out-of-memory
    error): what stages run side by side on one GPU (DVC's queue workers) must share. Never
    imports torch itself: a command that did not is not on a GPU."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    try:
        reserved, allocated = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
    except Exception:  # a broken CUDA context: the error that broke it is the one to see
        return
    log.info("peak GPU memory: %.2f GB reserved, %.2f GB allocated", reserved / 1e9, allocated / 1e9)
