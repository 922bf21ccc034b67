"""A server in another virtual environment (SGLang, vLLM: each pins its own torch/transformers),
run as one process group in its own session on 127.0.0.1: started, waited for, watched, stopped,
its output logged to a file that error messages quote. The server's TMPDIR is a directory of its own,
removed when it stops: a killed server's IPC sockets and scratch files (vLLM leaves both) go with it."""

import getpass
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from eaglenest.runtime.errors import EaglenestError

log = logging.getLogger(__name__)
BIND_FAILED = "error while attempting to bind on address"  # uvicorn's message


def free_port() -> int:
    """A free port BELOW the kernel's ephemeral range. A port that bind(0) hands out is free again
    once we close it, and the server's own internal sockets (bound to port 0 while it loads) can be
    given it before its HTTP server binds: that server then cannot bind and never answers."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    for port in random.sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    with socket.socket() as s:  # all taken: any free port, raced as before
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def post_json(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def installed_version(python: Path, package: str, make_target: str) -> str:
    """The version of `package` installed beside `python`, without starting anything."""
    code = f"from importlib.metadata import version; print(version({package!r}))"
    r = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    if r.returncode != 0:
        raise EaglenestError(
            f"{python}: cannot read the installed {package} version ({r.stderr.strip()[-300:]}); "
            f"`make {make_target}` builds the server environment"
        )
    return r.stdout.strip()


class ServerProcess:
    """`cmd` (a server listening on `port`) started in its own session, ready once GET `ready_path`
    answers; `name` is what messages call it."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        port: int,
        ready_path: str,
        log_path: Path,
        env: dict | None = None,
        startup_timeout: float = 600.0,
    ):
        self.name, self.cmd, self.port, self.ready_path = name, cmd, port, ready_path
        self.url = f"http://127.0.0.1:{port}"
        self.log_path, self.startup_timeout = Path(log_path), startup_timeout
        self.env = dict(os.environ) if env is None else env
        self.proc: subprocess.Popen | None = None
        self.tmp: str | None = None

    def start(self) -> str:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting %s on %s (log %s): %s", self.name, self.url, self.log_path, " ".join(self.cmd))
        self.tmp = tempfile.mkdtemp(prefix="eaglenest-server-")  # short: AF_UNIX paths stop at 107 bytes
        # torch's compile cache stays where it is by default, shared between launches; a process
        # limited to another CPU ISA (ATEN_CPU_CAPABILITY) keeps its own (a server aborted with heap
        # corruption after ISA-limited runs had filled the shared one, and ran with a fresh one)
        isa = os.environ.get("ATEN_CPU_CAPABILITY")
        cache = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}" + (f"-{isa}" if isa else ""))
        env = {"TORCHINDUCTOR_CACHE_DIR": cache, **self.env, "TMPDIR": self.tmp, "TMP": self.tmp, "TEMP": self.tmp}
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
        try:
            return self._wait_ready()
        except BaseException:  # not ready (or interrupted): no server, and no TMPDIR, is left behind
            self.stop()
            raise

    def _wait_ready(self) -> str:
        t0 = time.time()
        while time.time() - t0 < self.startup_timeout:
            self.check_alive()
            if BIND_FAILED in self.log_tail():  # the server then waits forever instead of exiting
                raise EaglenestError(
                    f"{self.name} could not bind its port {self.port} (another process took it); "
                    f"run again. Log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                urllib.request.urlopen(f"{self.url}{self.ready_path}", timeout=5).close()
                self.startup_s = time.time() - t0
                log.info("%s ready after %.0f s", self.name, self.startup_s)
                return self.url
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(1.0)
        raise EaglenestError(
            f"{self.name} did not become ready within {self.startup_timeout:.0f} s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise EaglenestError(
                f"{self.name} exited with code {self.proc.returncode}; log {self.log_path}:\n{self.log_tail()}"
            )

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 30.0) -> None:
        """The whole process group ended (TERM, then KILL), then the server's TMPDIR removed."""
        try:
            self._end_group(timeout)
        finally:
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
                self.tmp = None

    def _end_group(self, timeout: float) -> None:
        if self.proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)  # the group: workers the server forked outlive its own exit
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=timeout)
                if sig == signal.SIGKILL or not self._group_alive():
                    return
            except subprocess.TimeoutExpired:
                continue

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()
