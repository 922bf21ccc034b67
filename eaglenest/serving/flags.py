"""Serving flags from measurements: the chain length and draft tree that the evaluate stage found
fastest at batch 1 on its device (reports/timing/evaluate.json: best_k, best_tree), as SGLang's and
vLLM's command lines for the exported drafter. vLLM drafts EAGLE-3 as a chain; SGLang runs either."""

import json
from pathlib import Path

from eaglenest.runtime.errors import EaglenestError

SGLANG = (
    "python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
    "--speculative-draft-model-path {drafter} --speculative-num-steps {steps} "
    "--speculative-eagle-topk {topk} --speculative-num-draft-tokens {tokens}"
)
VLLM = (
    "vllm serve {target} --speculative-config "
    """'{{"method": "eagle3", "model": "{drafter}", "num_speculative_tokens": {steps}}}'"""
)


def sglang_shape(mode) -> tuple[int, int, int]:
    """SGLang's (num-steps, eagle-topk, num-draft-tokens) for a chain of k (a tree of top-1 nodes,
    k + 1 tokens verified) or a draft tree (anything with steps, topk and tokens)."""
    return (mode, 1, mode + 1) if isinstance(mode, int) else (mode.steps, mode.topk, mode.tokens)


def parse_tree(name: str) -> tuple[int, int, int]:
    """'tree-5x4x8' -> (steps, topk, tokens)."""
    try:
        steps, topk, tokens = (int(x) for x in name.removeprefix("tree-").split("x"))
    except ValueError:
        raise EaglenestError(f"{name!r}: not a tree name (tree-<steps>x<topk>x<tokens>)") from None
    return steps, topk, tokens


def flags(timing: dict, target: str, drafter: str) -> list[tuple[str, str]]:
    """(what, command) for the fastest chain and tree in an evaluate timing report."""
    if "best_k" not in timing:
        raise EaglenestError("the evaluate timing has no speed figures (no question was timed at batch 1)")
    k, out = int(timing["best_k"]), []
    chain = timing["k"][str(k)]
    what = f"chain k={k}: tau {chain['tau']:.2f}, {chain['speedup']:.2f}x"
    steps, topk, tokens = sglang_shape(k)
    out.append(
        (f"SGLang, {what}", SGLANG.format(target=target, drafter=drafter, steps=steps, topk=topk, tokens=tokens))
    )
    out.append((f"vLLM, {what}", VLLM.format(target=target, drafter=drafter, steps=k)))
    if "best_tree" in timing:
        name = timing["best_tree"]
        steps, topk, tokens = parse_tree(name)
        t = timing["tree"][name]
        out.append(
            (
                f"SGLang, {name}: tau {t['tau']:.2f}, {t['speedup']:.2f}x",
                SGLANG.format(target=target, drafter=drafter, steps=steps, topk=topk, tokens=tokens),
            )
        )
    return out


def read_timing(path: Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise EaglenestError(f"{path}: no evaluate timing (run `dvc repro evaluate`, or pass --timing)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise EaglenestError(f"{path}: not JSON ({e})") from None
