"""The exported drafter in a real serving engine: vLLM (`make vllm-env`, vLLM's CPU build) serves
the target on 127.0.0.1 with `--speculative-config {"method": "eagle3", "model": <drafter>}`,
decodes MT-bench first turns greedily, and its own speculative-decoding counters (/metrics) give
the engine's tau and acceptance per position. The same engine without the drafter gives plain
greedy outputs to check losslessness against, and this project's decoder (`evaluate`) gives the
offline tau on exactly the same prompt tokens and budget. A gap beyond noise is a bug in one of
them (tap numbering, d2t, RoPE, norm placement, the bonus token). Command: `python -m
stages.serve_vllm` (not a DVC stage: it needs `.venv-vllm`)."""

import json
import logging
import os
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eaglenest.errors import EaglenestError
from eaglenest.evaluate import evaluate, prompt_ids
from eaglenest.server_process import ServerProcess, free_port, installed_version, post_json
from eaglenest.target import Target, load_tokenizer

log = logging.getLogger(__name__)
VLLM_PYTHON = Path(".venv-vllm/bin/python")
COUNTER = re.compile(r"^vllm:(spec_decode_\w+?)(?:_total)?(?:\{([^}]*)\})? ([0-9.eE+-]+)$")


def vllm_server(python: Path, model_dir: Path, drafter_dir: Path | None, k: int, log_path: Path) -> ServerProcess:
    """vLLM's OpenAI server for the target (float32, eager: greedy ties decided as in `evaluate`),
    with the drafter at k draft tokens when given."""
    if not Path(python).exists():
        raise EaglenestError(f"vLLM environment not found: {python} (run `make vllm-env`)")
    port = free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(Path(model_dir).resolve())]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager", "--seed", "0"]
    cmd += ["--max-model-len", "2048", "--max-num-seqs", "16", "--served-model-name", "target"]
    if drafter_dir is not None:
        spec = {"method": "eagle3", "model": str(Path(drafter_dir).resolve()), "num_speculative_tokens": k}
        cmd += ["--speculative-config", json.dumps(spec)]
    # CPU build: the KV cache is host memory, sized in GiB (its default share of RAM is too much
    # beside the other processes of a 24 GB box); threads bound to the cores this process may use
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    name = "vLLM server" + (f" (eagle3, k={k})" if drafter_dir is not None else "")
    return ServerProcess(name, cmd, port, "/health", log_path, env=env)


def complete(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int = 8) -> list[list[int]]:
    """Greedy completions of token-id prompts: the generated token ids (EOS included when reached)."""

    def one(ids):
        body = {"model": "target", "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0}
        r = post_json(f"{url}/v1/completions", {**body, "return_token_ids": True})
        return list(r["choices"][0]["token_ids"])

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


def spec_counters(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        return parse_spec_counters(r.read().decode())


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


def serve_check(
    target: Target,
    drafter_dir: Path,
    prompts: list[dict],
    k: int,
    max_new_tokens: int,
    python: Path = VLLM_PYTHON,
    log_dir: Path = Path(".eaglenest/serve"),
) -> tuple[dict, list[dict]]:
    ids = prompt_ids(load_tokenizer(target), prompts)
    outputs = {}
    for name, drafter in (("plain", None), ("spec", drafter_dir)):
        with vllm_server(python, target.model_dir, drafter, k, Path(log_dir) / f"vllm-{name}.log") as srv:
            outputs[name] = complete(srv.url, ids, max_new_tokens)
            if drafter is not None:
                c = spec_counters(srv.url)
    drafts = c.get("spec_decode_num_drafts", 0)
    if not drafts:
        raise EaglenestError(f"the vLLM server reported no speculative drafts (counters: {c}); log {log_dir}")
    offline, _, _ = evaluate(target, drafter_dir, prompts, [k], max_new_tokens, progress=False)
    same = [a == b for a, b in zip(outputs["spec"], outputs["plain"])]
    per_q = [{"id": p["id"], "tokens": len(s), "identical": ok} for p, s, ok in zip(prompts, outputs["spec"], same)]
    key = str(k)
    metrics = {
        "engine": "vllm",
        "engine_version": installed_version(python, "vllm-cpu", "vllm-env"),
        "k": k,
        "questions": len(prompts),
        "max_new_tokens": max_new_tokens,
        "tau_engine": 1 + c.get("spec_decode_num_accepted_tokens", 0) / drafts,
        "tau_offline": offline["tau"][key],
        "accept_per_position_engine": [a / drafts for a in c["spec_decode_num_accepted_tokens_per_pos"]],
        "accept_per_position_offline": offline["accept_rate_per_position"][key],
        "drafts": int(drafts),
        "draft_tokens": int(c.get("spec_decode_num_draft_tokens", 0)),
        "accepted_tokens": int(c.get("spec_decode_num_accepted_tokens", 0)),
        "verifications_offline": offline["verifications"][key],
        "identical_to_greedy": sum(same),
        "offline_identical_to_greedy": offline["identical_to_greedy"][key],
    }
    metrics["tau_gap"] = metrics["tau_engine"] - metrics["tau_offline"]
    return metrics, per_q
