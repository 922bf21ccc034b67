"""`sglang` backend: a checking client for SGLang servers that run the eaglenest capture plugin.

Either `server_urls` (one or several servers on this host, requests spread over them) or, when
none is given, the backend launches one server itself (`sglang_server.LaunchedServer`) on first
use and stops it in `close()`. Each sample is one /generate request (max_new_tokens 1) with a
unique rid; its capture is checked (`capture_checks`), converted to bfloat16, and its file deleted.
A rejected capture or a transport error is retried; after `retries` the sample fails by name."""

import itertools
import json
import logging
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from eaglenest.runtime.errors import EaglenestError
from eaglenest.runtime.versions import CAPTURE_VERSIONS
from eaglenest.target.directory import Target
from sglang_patch.protocol import DEFAULT_RID_PREFIX, supported

from . import SampleFailed
from .capture_checks import CaptureRejected, capture_path, check_receipt, load_capture, remove
from .sglang_server import LaunchedServer, get_json, sglang_version

log = logging.getLogger(__name__)
TRANSPORT_ERRORS = (urllib.error.URLError, ConnectionError, TimeoutError, OSError)


class SpaceGate:
    """Holds requests back while the capture filesystem lacks room for their files."""

    def __init__(self, directory: Path | None, reserve_bytes: int, timeout_s: float):
        self.dir, self.reserve, self.timeout = directory, reserve_bytes, timeout_s
        self.inflight = 0
        self.lock = threading.Lock()

    def acquire(self, need: int) -> None:
        t0, warned = time.time(), False
        while True:
            with self.lock:
                free = shutil.disk_usage(self.dir).free if self.dir else None
                if free is None or free - self.inflight - need >= self.reserve:
                    self.inflight += need
                    return
            if not warned:
                log.warning(
                    "capture dir %s: %.1f MB free, %.1f MB in flight; the next request needs %.1f MB "
                    "(+%.0f MB reserve): waiting for space",
                    self.dir,
                    free / 1e6,
                    self.inflight / 1e6,
                    need / 1e6,
                    self.reserve / 1e6,
                )
                warned = True
            if time.time() - t0 > self.timeout:
                raise EaglenestError(
                    f"capture dir {self.dir}: only {free / 1e6:.1f} MB free, a request needs "
                    f"{(need + self.reserve) / 1e6:.1f} MB (incl. reserve); waited "
                    f"{self.timeout:.0f} s. Free space there (or set extract.sglang.capture_dir)"
                )
            time.sleep(0.5)

    def release(self, need: int) -> None:
        with self.lock:
            self.inflight -= need


class SGLangBackend:
    def __init__(
        self,
        target: Target,
        taps: list[int],
        dtype: str = "bfloat16",
        device: str = "auto",
        server_url=None,
        python: str = ".venv-sglang/bin/python",
        server_args=(),
        concurrency: int = 8,
        retries: int = 2,
        request_timeout_s: float = 600.0,
        startup_timeout_s: float = 600.0,
        capture_dir: str | None = None,
        reserve_mb: float = 64.0,
        space_timeout_s: float = 600.0,
        log_dir: str = ".eaglenest/sglang",
    ):
        self.target, self.taps, self.dtype = target, list(taps), dtype
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        self.urls = [server_url] if isinstance(server_url, str) else list(server_url or [])
        self.python, self.server_args = Path(python), [str(a) for a in server_args]
        self.concurrency, self.retries, self.timeout = int(concurrency), int(retries), float(request_timeout_s)
        self.startup_timeout, self.log_dir = float(startup_timeout_s), Path(log_dir)
        self.server: LaunchedServer | None = None
        self.timings = {}  # load_s: the server start (launch mode), itemised in the part's fixed cost
        self.own_capture_dir = capture_dir is None and not self.urls
        if capture_dir is None and self.urls:
            raise EaglenestError(
                "extract.sglang.capture_dir is required with server_url: the client reads and "
                "deletes capture files only inside the directory it was given (the servers' "
                "--capture-dir)"
            )
        if self.own_capture_dir:
            base = "/dev/shm" if Path("/dev/shm").is_dir() else None
            capture_dir = tempfile.mkdtemp(prefix="eaglenest-capture-", dir=base)
        self.space = SpaceGate(Path(capture_dir) if capture_dir else None, int(reserve_mb * 1e6), space_timeout_s)
        self.pool: ThreadPoolExecutor | None = None
        self._next_url = itertools.count()
        self._version: str | None = None

    # -- identity ---------------------------------------------------------------------------------
    def describe(self) -> dict:
        if self._version is None:
            self._version = self._server_version()
        return {
            "backend": "sglang",
            "version": f"sglang-{self._version}",
            "capture_version": CAPTURE_VERSIONS["sglang"],
            "device": self.device,
        }

    def _server_version(self) -> str:
        if not self.urls:
            version = sglang_version(self.python)
        else:
            infos = {}
            for url in self.urls:
                try:
                    infos[url] = get_json(f"{url.rstrip('/')}/server_info")
                except TRANSPORT_ERRORS as e:
                    raise EaglenestError(f"SGLang server {url} not reachable: {e}") from None
            versions = {info.get("version") for info in infos.values()}
            if len(versions) != 1:
                raise EaglenestError(f"SGLang servers run different versions {sorted(map(str, versions))}: {self.urls}")
            version = versions.pop()
            for url, info in infos.items():
                if info.get("dtype") not in (self.dtype, "auto"):
                    raise EaglenestError(
                        f"SGLang server {url} runs dtype {info.get('dtype')}, extract.dtype is {self.dtype}"
                    )
        if not supported(version):
            raise EaglenestError(f"SGLang {version} is outside the range sglang_patch supports")
        return version

    # -- serving ----------------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        if self.pool is not None:
            return
        if not self.urls:
            self.server = LaunchedServer(
                self.python,
                self.target.model_dir,
                dtype=self.dtype,
                taps=self.taps,
                capture_dir=self.space.dir,
                device=self.device,
                extra_args=self.server_args,
                log_path=self.log_dir / f"server-{time.strftime('%Y%m%d-%H%M%S')}.log",
                startup_timeout=self.startup_timeout,
            )
            self.urls = [self.server.start()]
            self.timings["load_s"] = round(self.server.startup_s, 2)  # the server start: a fixed cost
        self.pool = ThreadPoolExecutor(self.concurrency * len(self.urls), thread_name_prefix="sglang-client")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        if self.server is not None:
            self.server.stop()
            self.urls, self.server = [], None
        if self.own_capture_dir and self.space.dir is not None:
            shutil.rmtree(self.space.dir, ignore_errors=True)

    def extract(self, batch: list[np.ndarray]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self._ensure_started()
        futures = [self.pool.submit(self._one, i, ids) for i, ids in enumerate(batch)]
        return [f.result() for f in futures]

    def _one(self, position: int, ids: np.ndarray):
        n = len(ids)
        need = n * (len(self.taps) + 1) * self.target.hidden_size * (4 if self.dtype == "float32" else 2) + 4096
        reasons = []
        for attempt in range(1 + self.retries):
            if self.server is not None:
                self.server.check_alive()
            url = self.urls[next(self._next_url) % len(self.urls)]
            self.space.acquire(need)
            rid = f"{DEFAULT_RID_PREFIX}{uuid.uuid4().hex}"
            path = capture_path(self.space.dir, rid)  # the only file this request may read or delete
            try:
                meta = self._generate(url, ids, rid)
                check_receipt(meta, n, self.taps, path)
                return load_capture(path, ids, len(self.taps), self.target.hidden_size)
            except CaptureRejected as e:
                reasons.append(f"attempt {attempt + 1}: {e}")
            except TRANSPORT_ERRORS as e:
                reasons.append(f"attempt {attempt + 1}: {url} not answering ({e})")
                time.sleep(min(2.0**attempt, 10.0))
            finally:
                remove(path)  # whether the capture passed or not
                self.space.release(need)
        if self.server is not None:
            self.server.check_alive()
        raise SampleFailed(position, f"SGLang capture failed {len(reasons)} times: " + "; ".join(reasons))

    def _generate(self, url: str, ids: np.ndarray, rid: str) -> dict:
        body = {
            "input_ids": [int(x) for x in ids],
            "rid": rid,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        }
        req = urllib.request.Request(
            f"{url.rstrip('/')}/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            raw = r.read()
        try:
            out = json.loads(raw)
        except ValueError:
            raise CaptureRejected(f"{url}/generate answered {len(raw)} bytes that are not JSON") from None
        if isinstance(out, list) and out:
            out = out[0]
        if not isinstance(out, dict) or not isinstance(out.get("meta_info"), dict):
            raise CaptureRejected(f"{url}/generate answered without a meta_info object")
        return out["meta_info"]
