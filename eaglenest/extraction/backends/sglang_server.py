"""Start, watch and stop an SGLang server through `python -m sglang_patch.launch` in the server's
own virtual environment (SGLang pins its own torch/transformers: `make sglang-env`)."""

import json
import logging
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from eaglenest.errors import EaglenestError

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


def sglang_version(python: Path) -> str:
    """The SGLang version installed beside `python`, without starting a server."""
    code = "from importlib.metadata import version; print(version('sglang'))"
    r = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    if r.returncode != 0:
        raise EaglenestError(
            f"{python}: cannot read the installed SGLang version ({r.stderr.strip()[-300:]}); "
            f"`make sglang-env` builds the server environment"
        )
    return r.stdout.strip()


class LaunchedServer:
    """One server process (and its children) in its own session, logged to `log_path`."""

    def __init__(
        self,
        python: Path,
        model_dir: Path,
        *,
        dtype: str,
        taps: list[int],
        capture_dir: Path,
        device: str,
        extra_args: list[str],
        log_path: Path,
        startup_timeout: float = 600.0,
    ):
        self.env = dict(os.environ)
        self.python, self.log_path, self.startup_timeout = Path(python), Path(log_path), startup_timeout
        if not self.python.exists():
            raise EaglenestError(
                f"SGLang server environment not found: {self.python} (run `make sglang-env`, "
                f"or set extract.sglang.python)"
            )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.capture_dir = Path(capture_dir)
        self.cmd = [
            str(self.python),
            "-m",
            "sglang_patch.launch",
            "--model-path",
            str(Path(model_dir).resolve()),
            "--dtype",
            dtype,
            "--port",
            str(self.port),
            "--device",
            "cpu" if device == "cpu" else "cuda",
            "--capture-dir",
            str(capture_dir),
            "--capture-taps",
            ",".join(map(str, taps)),
            *extra_args,
        ]
        self.proc: subprocess.Popen | None = None

    def start(self) -> str:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting SGLang server on %s (log %s): %s", self.url, self.log_path, " ".join(self.cmd))
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=self.env,
            )
        t0 = time.time()
        while time.time() - t0 < self.startup_timeout:
            self.check_alive()
            if BIND_FAILED in self.log_tail():  # SGLang then waits forever instead of exiting
                self.stop()
                raise EaglenestError(
                    f"SGLang server could not bind its port {self.port} (another process took "
                    f"it); run again. Log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                get_json(f"{self.url}/model_info", timeout=5)
                log.info("SGLang server ready after %.0f s", time.time() - t0)
                return self.url
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(1.0)
        self.stop()
        raise EaglenestError(
            f"SGLang server did not become ready within {self.startup_timeout:.0f} s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise EaglenestError(
                f"SGLang server exited with code {self.proc.returncode}; log {self.log_path}:\n{self.log_tail()}"
            )

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 30.0) -> None:
        if not self.alive():
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=timeout)
                return
            except subprocess.TimeoutExpired:
                continue
