"""The exported drafter in a real serving engine (`serve_vllm.VLLM`: chains; `serve_sglang.SGLang`:
chains and draft trees): the engine serves the target on 127.0.0.1 with the drafter, decodes
MT-bench first turns greedily, and its own speculative-decoding counters give the engine's tau and
acceptance per position. The same engine without the drafter gives plain greedy outputs to check
losslessness against, and this project's decoder (`evaluate`) gives the offline tau on exactly the
same prompt tokens, budget and draft shape. A gap beyond noise is a bug in one of them (tap
numbering, d2t, RoPE, norm placement, the bonus token, the tree's mask or its walk). Command:
`python -m stages.serve_check` (not a DVC stage: the engines have environments of their own)."""

import logging
from pathlib import Path
from typing import Protocol

from eaglenest.decoding.modes import depth, mode_key
from eaglenest.decoding.tree import TreeShape
from eaglenest.evaluate import evaluate, prompt_ids
from eaglenest.runtime.errors import EaglenestError
from eaglenest.runtime.server_process import ServerProcess
from eaglenest.target.directory import Target
from eaglenest.target.loading import load_tokenizer

log = logging.getLogger(__name__)


class Engine(Protocol):
    name: str

    def version(self) -> str: ...

    def server(self, model_dir: Path, drafter_dir: Path | None, mode, log_path: Path) -> ServerProcess:
        """The target served greedily; with the drafter drafting `mode` when given, the same flags otherwise."""

    def decode(self, url: str, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], dict]:
        """Greedy completions, and the speculative counters: verifications, accepted_tokens,
        draft_tokens, accepted_per_position (counts)."""


def serve_check(
    engine: Engine,
    target: Target,
    drafter_dir: Path,
    prompts: list[dict],
    mode: int | TreeShape,
    max_new_tokens: int,
    log_dir: Path = Path(".eaglenest/serve"),
) -> tuple[dict, list[dict]]:
    ids = prompt_ids(load_tokenizer(target), prompts)
    key = mode_key(mode)
    outputs = {}
    for name, drafter in (("plain", None), ("spec", drafter_dir)):
        log_path = Path(log_dir) / f"{engine.name}-{name}-{key}.log"
        with engine.server(target.model_dir, drafter, mode, log_path) as srv:
            try:
                outputs[name], counts = engine.decode(srv.url, ids, max_new_tokens)
            except OSError as e:  # refused, reset, closed without a response: name the server and its log
                srv.check_alive()
                raise EaglenestError(f"{srv.name}: a request failed ({e}); log {log_path}:\n{srv.log_tail()}") from e
    if not counts.get("verifications"):
        raise EaglenestError(
            f"the {engine.name} server reported no speculative verifications ({counts}); logs in {log_dir}"
        )
    ks, trees = ([], [mode]) if isinstance(mode, TreeShape) else ([mode], [])
    offline, _, _ = evaluate(target, drafter_dir, prompts, ks, max_new_tokens, progress=False, trees=trees)
    same = [a == b for a, b in zip(outputs["spec"], outputs["plain"])]
    per_q = [
        {"id": p["id"], "tokens": len(s), "identical": ok, "output_ids": s}
        for p, s, ok in zip(prompts, outputs["spec"], same)
    ]
    n = counts["verifications"]
    per_pos = counts["accepted_per_position"] + [0] * (depth(mode) - len(counts["accepted_per_position"]))
    metrics = {
        "engine": engine.name,
        "engine_version": engine.version(),
        "mode": key,
        **({"k": mode} if not isinstance(mode, TreeShape) else {}),
        "questions": len(prompts),
        "max_new_tokens": max_new_tokens,
        "tau_engine": 1 + counts["accepted_tokens"] / n,
        "tau_offline": offline["tau"][key],
        "accept_per_position_engine": [a / n for a in per_pos],
        "accept_per_position_offline": offline["accept_rate_per_position"][key],
        "drafts": n,
        "draft_tokens": counts["draft_tokens"],
        "accepted_tokens": counts["accepted_tokens"],
        "verifications_offline": offline["verifications"][key],
        "identical_to_greedy": sum(same),
        "offline_identical_to_greedy": offline["identical_to_greedy"][key],
    }
    metrics["tau_gap"] = metrics["tau_engine"] - metrics["tau_offline"]
    return metrics, per_q
