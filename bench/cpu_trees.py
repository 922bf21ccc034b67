"""Draft trees against the chain on the CPU default's drafter. Not a test: writes
$BENCH_OUT/cpu_trees.json (default bench/out).

    python -m bench.cpu_trees [--questions 80] [--tree 5 4 8 --tree 3 4 8]

Run in a checkout where `make repro` has made data/target and data/drafter. The evaluate stage runs
in a scratch workspace (params.yaml with evaluate.trees set, the data linked), so the committed
metrics stay as they are: τ per chain and tree, lossless counts, and the batch-1 speed figures."""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

OUT = Path(os.environ.get("BENCH_OUT", "bench/out")) / "cpu_trees.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=80)
    ap.add_argument("--tree", type=int, nargs=3, action="append", metavar=("STEPS", "TOPK", "TOKENS"))
    args = ap.parse_args()
    repo = Path.cwd()
    for need in ("data/target", "data/drafter"):
        if not (repo / need).exists():
            sys.exit(f"{need}: missing; run `make repro` first")
    trees = args.tree or [[5, 4, 8], [3, 4, 8]]
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["evaluate"].update(trees=trees, questions=args.questions)
    with tempfile.TemporaryDirectory() as ws:
        ws = Path(ws)
        (ws / "data").mkdir()
        for name in ("target", "drafter"):
            (ws / "data" / name).symlink_to(repo / "data" / name)
        (ws / "params.yaml").write_text(yaml.safe_dump(params))
        env = {**os.environ, "PYTHONPATH": str(repo)}
        p = subprocess.run([sys.executable, "-m", "stages.evaluate", "--no-progress"], cwd=ws, env=env)
        if p.returncode not in (0, 2):  # 2: the quality gate, which still writes every figure
            sys.exit(p.returncode)
        report = json.loads((ws / "reports/evaluate.json").read_text())
        timing = json.loads((ws / "reports/timing/evaluate.json").read_text())
    out = {
        "questions": report["questions"],
        "max_new_tokens": report["max_new_tokens"],
        "cpu": report["cpu"],
        "tau": report["tau"],
        "identical_to_greedy": report["identical_to_greedy"],
        "accept_rate_per_position": report["accept_rate_per_position"],
        "timing": timing,
        "command": "python -m bench.cpu_trees " + " ".join(f"--tree {a} {b} {c}" for a, b, c in trees),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
