"""Processes a command starts end with it: on success, on an error, and on SIGTERM, SIGINT or SIGHUP (a
job scheduler's time limit, Ctrl-C, a closed terminal). The signals become an exception in the main
thread, so every `with` and `finally` block stops what it started (servers, pools, loaders); whatever
is still running when the command ends is ended by `end_descendants`. Pool workers leave Ctrl-C (which
a terminal sends to the whole process group) to their parent, so one line is printed, not one
traceback per process."""

import functools
import os
import signal
import sys
import threading
import time


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the main thread is, as Python raises KeyboardInterrupt for SIGINT."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum, frame):
    raise Interrupted(signum)


def _redeliver(previous, unraisable) -> None:
    """A signal that lands while a finalizer runs (a `__del__` the garbage collector called, a weakref
    callback) raises there, where nothing can catch it: Python would print "Exception ignored" and
    the command would run on as if never signalled. Send the signal again instead: it is raised
    where the main thread runs next, which is ordinary code once the finalizers are done. From a
    thread, a moment later: sent from here, it would be raised inside this hook, and ignored again."""
    e = unraisable.exc_value
    if not isinstance(e, KeyboardInterrupt):
        return previous(unraisable)
    again = threading.Timer(0.1, os.kill, (os.getpid(), signum(e)))
    again.daemon = True
    again.start()


def raise_on_signals() -> dict:
    """SIGTERM and SIGHUP raise `Interrupted`, SIGINT KeyboardInterrupt, one swallowed by a finalizer is
    delivered again (`_redeliver`); returns the handlers and hook they replaced, for `restore`.
    SIGINT is set explicitly: a command started in the background by a script (`cmd &`, `setsid cmd &`,
    so every stage of a detached `dvc repro`) inherits it ignored, and Python then leaves it so; an
    interrupt sent to its process group (`tools.offline_gpu` at a budget's end) would do nothing."""
    replaced = {"unraisablehook": sys.unraisablehook}
    sys.unraisablehook = functools.partial(_redeliver, replaced["unraisablehook"])
    replaced[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    return replaced | {s: signal.signal(s, _raise) for s in (signal.SIGTERM, signal.SIGHUP)}


def restore(replaced: dict) -> None:
    for s, h in replaced.items():
        if s == "unraisablehook":
            sys.unraisablehook = h
        else:
            signal.signal(s, h)


def signum(e: KeyboardInterrupt) -> int:
    """The signal behind an interruption (a plain KeyboardInterrupt: SIGINT)."""
    return e.signum if isinstance(e, Interrupted) else signal.SIGINT


def signal_name(e: KeyboardInterrupt) -> str:
    return signal.Signals(signum(e)).name


def exit_code(e: KeyboardInterrupt) -> int:
    """128 + the signal's number, as a shell reports a command a signal ended."""
    return 128 + signum(e)


def worker_init() -> None:
    """First thing in a pool worker: Ctrl-C is its parent's to handle (the parent then ends the pool),
    and SIGTERM ends it at once, as the pool's own terminate() expects (a forked worker inherits
    `raise_on_signals`, whose exception there would leave the pool's queue locked)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def descendants(pid: int | None = None) -> list[int]:
    """Every living process below `pid` (default: this one), children first, from /proc."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # it ended meanwhile
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])  # after "(comm)": state, ppid
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(children.get(root, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += children.get(p, [])
    return out


def close_compile_workers() -> None:
    """torch.compile's worker pool on CUDA (a process with ~one worker per core: 17 on a 16-core GPU
    host) lives until the interpreter exits, so a command that compiled would end with it still
    running; closed by torch's own call, it is no leftover for `end_descendants` to find."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is not None and hasattr(async_compile, "shutdown_compile_workers"):
        async_compile.shutdown_compile_workers()


def end_descendants(grace_s: float = 3.0, keep: set[int] = frozenset()) -> list[int]:
    """SIGTERM to every descendant still running but those in `keep` (what ran before a command
    started, when it runs inside another program), SIGKILL to those left after `grace_s`; returns the
    pids that had to be ended. multiprocessing's resource tracker is left to end by itself: it goes
    when this process does, after unlinking the shared memory a killed worker left."""
    found = pids = [p for p in descendants() if p not in keep and _running(p) and not _is_resource_tracker(p)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + (grace_s if sig == signal.SIGTERM else 1.0)
        while time.time() < deadline and any(_running(p) for p in pids):
            time.sleep(0.05)
        pids = [p for p in pids if _running(p)]
        if not pids:
            break
    return found


def _is_resource_tracker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"resource_tracker" in f.read()
    except OSError:
        return False


def _running(pid: int) -> bool:
    """Alive and not a zombie (a child of ours that ended but is not reaped yet counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] != b"Z"
