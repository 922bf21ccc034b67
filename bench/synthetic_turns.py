"""Multi-turn synthetic conversations on the CPU default's target: how many follow-up user turns the
target writes survive the filters, turn by turn, and what a conversation holds. Not a test: writes
$BENCH_OUT/synthetic_turns.json (default bench/out).

    python -m bench.synthetic_turns [--count 64] [--turns 3] [--temperature 1.0] [--max-new-tokens 128]

Run where `make repro` has made data/target. The stages themselves, in a scratch workspace with
generate on: `synthetic@part --turns T`, then `generate@part` (bf16 on the CPU, greedy answers)."""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

OUT = Path(os.environ.get("BENCH_OUT", "bench/out")) / "synthetic_turns.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=64)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    repo = Path.cwd()
    if not (repo / "data/target").exists():
        sys.exit("data/target: missing; run `make repro` first")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["generate"].update(enabled=True, max_new_tokens=args.max_new_tokens)
    flags = ["--count", str(args.count), "--seed", "0", "--temperature", str(args.temperature)]
    with tempfile.TemporaryDirectory() as ws:
        ws = Path(ws)
        (ws / "data").mkdir()
        (ws / "data" / "target").symlink_to(repo / "data" / "target")
        (ws / "params.yaml").write_text(yaml.safe_dump(params))
        env = {**os.environ, "PYTHONPATH": str(repo)}
        wall = {}
        for stage, extra in (("synthetic", [*flags, "--turns", str(args.turns)]), ("generate", [])):
            t0 = time.perf_counter()
            cmd = [sys.executable, "-m", f"stages.{stage}", "syn", *extra, "--no-progress"]
            subprocess.run(cmd, cwd=ws, env=env, check=True)
            wall[stage] = round(time.perf_counter() - t0, 1)
        gen = json.loads((ws / "reports/generate/syn.json").read_text())
        convs = [json.loads(line) for line in (ws / "data/generated/syn.jsonl").read_text().splitlines()]
    user_turns = [sum(m["role"] == "user" for m in c["messages"]) for c in convs]
    res = {
        "conversations": len(convs),
        "turns_asked": args.turns,
        "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens,
        "user_turns_histogram": {n: user_turns.count(n) for n in range(1, args.turns + 1)},
        "follow_ups_asked": gen["follow_ups_written"] + sum(v for k, v in gen.items() if "dropped" in k),
        **{k: v for k, v in gen.items() if k.startswith("follow_up")},
        "assistant_turns": gen["regenerated"],
        "generated_tokens": gen["generated_tokens"],
        "wall_s": wall,
        "cpu": gen.get("cpu"),
        "example": convs[0]["messages"],
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "example"}, indent=1))


if __name__ == "__main__":
    main()
