"""Hidden states through vLLM's own extraction path: a vLLM server (`make vllm-env`) on 127.0.0.1
runs the target with the `extract_hidden_states` speculative method and `vllm_patch.capture`'s
connector, which writes each request's states at vLLM ids = our taps + [L] to a private capture
dir. A request is the sample's token ids with max_tokens 1; its response names the file.

vLLM's id j is the input of layer j (HF `hidden_states[j]`), so taps pass unchanged; id L is the
last layer's output before the final norm, which this client applies (float32, the target's weight
and eps) to get the store's `final`. Everything then goes through the same gate as the other
backends: a store is published only if vLLM's states agree with the float32 reference."""

import fcntl
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from eaglenest.runtime.errors import EaglenestError
from eaglenest.runtime.server_process import ServerProcess, free_port, installed_version, post_json
from eaglenest.runtime.versions import CAPTURE_VERSIONS
from eaglenest.target.directory import Target, model_config
from eaglenest.target.loading import load_heads

from . import SampleFailed

REPO = Path(__file__).resolve().parents[3]


def tensor_parallel_size(args: list[str]) -> int:
    """--tensor-parallel-size / -tp N (or =N) among vLLM server arguments; 1 without."""
    for i, a in enumerate(args):
        name, _, value = a.partition("=")
        if name in ("--tensor-parallel-size", "-tp"):
            return int(value or args[i + 1])
    return 1


def split_cores(workers: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `workers` CPU workers: this process's cores in as many
    contiguous groups. vLLM binds each worker's threads to a NUMA node of its own unless told, and
    fails on a one-node host ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers")."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < workers:
        raise EaglenestError(f"extract.vllm.server_args: tensor parallel size {workers} > the {len(cores)} cores here")
    groups = [cores[i * len(cores) // workers : (i + 1) * len(cores) // workers] for i in range(workers)]
    return "|".join(f"{g[0]}-{g[-1]}" for g in groups)


class VLLMBackend:
    def __init__(
        self,
        target: Target,
        taps: list[int],
        dtype: str = "bfloat16",
        device: str = "auto",
        python: str = ".venv-vllm/bin/python",
        server_args=(),
        concurrency: int = 8,
        startup_timeout_s: float = 600.0,
        log_dir: str = ".eaglenest/vllm",
    ):
        self.target, self.taps, self.dtype = target, list(taps), dtype
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        self.python, self.server_args = Path(python), [str(a) for a in server_args]
        if not self.python.exists():
            raise EaglenestError(f"vLLM environment not found: {self.python} (run `make vllm-env`)")
        self.concurrency, self.startup_timeout, self.log_dir = int(concurrency), startup_timeout_s, Path(log_dir)
        heads = load_heads(target)
        if heads["final_norm"] is None:
            raise EaglenestError(f"{target.model_dir}: no final norm found; the vllm backend needs it for `final`")
        self.norm_w = heads["final_norm"].float()
        cfg = model_config(target)
        self.eps = float(cfg.get("text_config", cfg).get("rms_norm_eps", 1e-6))
        self.server: ServerProcess | None = None
        self.pool: ThreadPoolExecutor | None = None
        self.timings = {}  # load_s: the server start, itemised in the part's fixed cost
        self.capture_dir: Path | None = None
        self._version: str | None = None

    def describe(self) -> dict:
        if self._version is None:  # vLLM's CPU build is the `vllm-cpu` distribution
            try:
                self._version = installed_version(self.python, "vllm-cpu", "vllm-env")
            except EaglenestError:
                self._version = installed_version(self.python, "vllm", "vllm-env")
        return {
            "backend": "vllm",
            "version": f"vllm-{self._version}",
            "capture_version": CAPTURE_VERSIONS["vllm"],
            "device": self.device,
        }

    def _command(self, port: int) -> list[str]:
        ids = [*self.taps, self.target.num_layers]
        spec = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}},
        }
        kv = {
            "kv_connector": "CaptureConnector",
            "kv_connector_module_path": "vllm_patch.capture",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(self.capture_dir)},
        }
        return [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.target.model_dir.resolve()), "--served-model-name", "target",
            "--host", "127.0.0.1", "--port", str(port), "--dtype", self.dtype, "--seed", "0",
            "--enforce-eager", "--max-model-len", str(self._max_len()),
            # a cached prefix is not recomputed, so its states would be missing from the capture
            "--no-enable-prefix-caching",
            "--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv),
            *self.server_args,
        ]  # fmt: skip

    def _max_len(self) -> int:
        """8,192 tokens (the KV space a CPU server reserves grows with it), or the target's own limit
        where that is shorter: vLLM refuses a longer --max-model-len."""
        cfg = model_config(self.target)
        cfg = cfg.get("text_config", cfg)
        return min(8192, int(cfg.get("max_position_embeddings") or 8192))

    def _ensure_started(self) -> None:
        if self.pool is not None:
            return
        base = "/dev/shm" if Path("/dev/shm").is_dir() else None
        self.capture_dir = Path(tempfile.mkdtemp(prefix="eaglenest-vllm-", dir=base))  # 0700
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of host memory for the CPU build's cache
        workers = tensor_parallel_size(self.server_args)
        if self.device == "cpu" and workers > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
            env["VLLM_CPU_OMP_THREADS_BIND"] = split_cores(workers)
        port = free_port()
        self.server = ServerProcess(
            "vLLM server",
            self._command(port),
            port,
            "/health",
            self.log_dir / f"server-{time.strftime('%Y%m%d-%H%M%S')}.log",
            env=env,
            startup_timeout=self.startup_timeout,
        )
        self.server.start()
        self.timings["load_s"] = round(self.server.startup_s, 2)  # the server start: a fixed cost
        self.pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="vllm-client")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.capture_dir is not None:
            shutil.rmtree(self.capture_dir, ignore_errors=True)
            self.capture_dir = None

    def extract(self, batch: list[np.ndarray]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self._ensure_started()
        return list(self.pool.map(self._one, range(len(batch)), batch))

    def _one(self, position: int, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        body = {"model": "target", "prompt": [int(x) for x in ids], "max_tokens": 1, "temperature": 0.0}
        try:
            r = post_json(f"{self.server.url}/v1/completions", body)
        except OSError as e:
            self.server.check_alive()
            raise SampleFailed(position, f"vLLM request failed: {e}") from None
        path = Path(str((r.get("kv_transfer_params") or {}).get("hidden_states_path", "")))
        if path.parent != self.capture_dir:
            raise SampleFailed(position, f"vLLM named no capture file in {self.capture_dir} (got {str(path)!r})")
        lock_path = Path(f"{path}.lock")
        try:
            if lock_path.exists():  # the connector holds it exclusively until the file is written
                with open(lock_path) as lock:
                    fcntl.flock(lock, fcntl.LOCK_SH)
            data = load_file(str(path))
        except OSError as e:
            raise SampleFailed(position, f"vLLM capture file unreadable: {e}") from None
        finally:
            for p in (path, Path(f"{path}.lock")):
                p.unlink(missing_ok=True)
        states, got = data["hidden_states"], data["token_ids"]
        n, k = len(ids), len(self.taps)
        if got.tolist() != [int(x) for x in ids] or tuple(states.shape[:2]) != (n, k + 1):
            raise SampleFailed(
                position,
                f"vLLM captured {tuple(states.shape)} for tokens {got.tolist()[:8]}..., "
                f"expected ({n}, {k + 1}, H) for the sample's {n} tokens",
            )
        last = states[:, k].float()
        final = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_w
        return states[:, :k].to(torch.bfloat16), final.to(torch.bfloat16)
