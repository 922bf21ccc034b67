"""Stage `evaluate`: offline speculative decoding on the MT-bench first turns with the target and
data/drafter; compares to plain greedy decoding (must be identical) and measures acceptance.

    python -m stages.evaluate     (params: evaluate.questions, evaluate.k, evaluate.max_new_tokens, evaluate.dtype)
Writes metrics/evaluate.json and metrics/evaluate_positions.csv (acceptance per draft position).
"""
import argparse
import csv
from pathlib import Path

from eaglenest.atomic import write_json
from eaglenest.errors import exit_on_error
from eaglenest.evaluate import evaluate, mtbench_prompts
from eaglenest.target import load_target

from . import _params


@exit_on_error
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="data/drafter")
    args = ap.parse_args(argv)
    p = _params.load("evaluate")
    metrics, per_q = evaluate(load_target(Path("data/target")), Path(args.drafter), mtbench_prompts(p["questions"]),
                              k=int(p["k"]), max_new_tokens=int(p["max_new_tokens"]), dtype=p.get("dtype", "float32"),
                              device=p.get("device", "cpu"))
    write_json(Path("metrics/evaluate.json"), metrics)
    with open("metrics/evaluate_positions.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["position", "acceptance"])
        for i, a in enumerate(metrics["accept_rate_per_position"]):
            w.writerow([i + 1, round(a, 5)])
    write_json(Path("metrics/evaluate_questions.json"), per_q)


if __name__ == "__main__":
    main()
