"""Stage `evaluate`: speculative decoding on the MT-bench first turns with the target and
data/drafter, for each chain length in evaluate.k and each draft tree in evaluate.trees
([steps, topk, tokens]: SGLang's --speculative-num-steps, --speculative-eagle-topk,
--speculative-num-draft-tokens); compares to plain greedy decoding (must be identical) and measures
acceptance and the batch-1 decoding speedup, naming the fastest chain and tree (best_k, best_tree).

    python -m stages.evaluate
    params: evaluate.questions, k (an int or a list), trees, max_new_tokens, dtype, device, batch_size
            (questions decoded at once; >1 on a GPU), speed_questions (timed at batch 1; null = all),
            min_tau (the quality gate)
Writes metrics/evaluate.json (tau per k, lossless, what it ran on: `dvc metrics show`),
reports/evaluate.json (acceptance per position, verifications, mismatches per k),
metrics/evaluate_positions.csv (acceptance per k and draft position, for `dvc plots`),
reports/evaluate_questions.json (per question; outputs that differ from greedy decoding are named
and warned about) and reports/timing/evaluate.json (tokens/s, speedup per k, and the break-even
analysis: a target step's cost, a round's draft steps and verification, the tau a round needs to
pay off). The quality gate: if tau at any k is below evaluate.min_tau, the stage fails (exit 2)
after writing them, so a defective drafter (or the hidden states it learned from) never passes
`dvc repro` quietly.
"""

import argparse
import csv
import logging
from pathlib import Path

from eaglenest.decoding.tree import TreeShape
from eaglenest.evaluate import evaluate, mtbench_prompts
from eaglenest.files.atomic import replaced_file, write_json
from eaglenest.runtime.errors import EaglenestError, exit_on_error
from eaglenest.runtime.made_on import compute_dtype, made_on
from eaglenest.target.directory import load_target
from eaglenest.target.loading import pick_device

from . import _params
from . import _paths as paths

log = logging.getLogger("stages.evaluate")


@exit_on_error
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default=str(paths.DRAFTER))
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    p = _params.load("evaluate")
    ks = [int(k) for k in (p["k"] if isinstance(p["k"], list) else [p["k"]])]
    if not ks or min(ks) < 1:
        raise EaglenestError(f"evaluate.k must be a chain length >= 1 or a list of them, got {p['k']!r}")
    try:
        trees = [TreeShape(*t) for t in p["trees"]]
    except ValueError as e:
        raise EaglenestError(f"evaluate.trees: {e}") from None
    min_tau = p["min_tau"]
    metrics, timing, per_q = evaluate(
        load_target(paths.TARGET),
        Path(args.drafter),
        mtbench_prompts(p["questions"]),
        ks,
        max_new_tokens=int(p["max_new_tokens"]),
        dtype=compute_dtype(p["dtype"], pick_device(p["device"])),
        device=p["device"],
        batch_size=int(p["batch_size"]),
        speed_questions=p["speed_questions"],
        progress=not args.no_progress,
        trees=trees,
    )
    low = {k: t for k, t in metrics["tau"].items() if min_tau is not None and t < float(min_tau)}
    metrics["min_tau"], metrics["gate_passed"] = min_tau, not low
    lossless = all(n == metrics["questions"] for n in metrics["lossless"].values())
    write_json(paths.metrics("evaluate"), {"tau": metrics["tau"], "lossless": lossless, **made_on(metrics["device"])})
    write_json(paths.report("evaluate"), metrics)
    write_json(paths.timing("evaluate"), timing)
    with replaced_file(paths.metrics("evaluate_positions", ext="csv")) as tmp, open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["k", "position", "acceptance"])
        for k, rates in metrics["accept_rate_per_position"].items():
            for i, a in enumerate(rates):
                w.writerow([k, i + 1, round(a, 5)])
    write_json(paths.report("evaluate_questions"), per_q)
    for k, t in timing.get("k", {}).items():
        log.info(
            "k=%s: tau %.3f, speedup %.2fx at batch 1: a round costs %.1f ms (%s draft steps of %.1f ms, a "
            "verification of %.1f ms) against a %.1f ms target step, so it pays off from tau %.2f",
            k, t["tau"], t["speedup"], t["round_ms"], k, t["draft_step_ms"], t["verify_ms"],
            timing["target_step_ms"], t["break_even_tau"],
        )  # fmt: skip
    for name, t in timing.get("tree", {}).items():
        log.info("%s: tau %.3f, speedup %.2fx at batch 1 (a round %.1f ms, break-even tau %.2f)",
                 name, t["tau"], t["speedup"], t["round_ms"], t["break_even_tau"])  # fmt: skip
    if "best_k" in timing:
        best = f"chain k={timing['best_k']}"
        if "best_tree" in timing:
            best += f", tree {timing['best_tree']}"
        log.info("fastest at batch 1 on this device: %s (README: serving flags)", best)
    if low:
        raise EaglenestError(
            f"quality gate: tau {', '.join(f'{t:.3f} at k={k}' for k, t in low.items())} below "
            f"evaluate.min_tau {min_tau}; the drafter (or the hidden states it was trained on) is "
            f"not fit to ship. Figures: metrics/evaluate.json, reports/evaluate.json"
        )


if __name__ == "__main__":
    main()
