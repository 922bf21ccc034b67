"""A fresh clone's `make repro` (venv included) on this CPU as it is, or limited to AVX2 (torch's
`ATEN_CPU_CAPABILITY=avx2` and oneDNN's `ONEDNN_MAX_CPU_ISA=AVX2`: bf16 then runs in emulation, as on
an AVX2-only CPU): wall clock, each stage's time, the compute dtype each stage resolved, one core's
float32 and bf16 matmul rate beside each compute-bound stage's achieved rate, and τ.

    python -m bench.cpu_kinds [--isa avx2] [--workdir /tmp/cpu-kind] [--out bench/results/cpu_kinds.json]

Each run is one entry of the JSON, keyed by the CPU kind torch reports (an ISA-limited run says so);
bench/RESULTS.md ("CPU default on each CPU kind") cites it."""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# one core, the shape of a SmolLM2 MLP projection at 512 tokens
MATMUL = """
import json, time, torch
from eaglenest.runtime.made_on import cpu_kind
torch.set_num_threads(1)
rates = {}
for dt in (torch.float32, torch.bfloat16):
    a, b = torch.randn(512, 576, dtype=dt), torch.randn(576, 1536, dtype=dt)
    a @ b
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < 2.0:
        a @ b
        n += 1
    rates[str(dt).split('.')[1]] = round(2 * 512 * 576 * 1536 * n / (time.perf_counter() - t) / 1e9, 1)
print(json.dumps({"cpu": cpu_kind(), "capability": torch.backends.cpu.get_cpu_capability(), "gflops_1core": rates}))
"""


def timed_make_repro(work: Path, log: Path) -> tuple[float, dict[str, float]]:
    """(wall seconds, seconds per stage and for the venv): each stage from its "Running stage" line
    to the next one's (or the end)."""
    t0 = time.time()
    marks = [("venv", t0)]
    with open(log, "w") as f:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # each line as it happens: the stage marks are its times
        p = subprocess.Popen(
            ["make", "repro"], cwd=work, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for line in p.stdout:
            f.write(line)
            m = re.search(r"Running stage '([^']+)'", line)
            if m:
                marks.append((m.group(1), time.time()))
        rc = p.wait()
    end = time.time()
    if rc != 0:
        sys.exit(f"make repro failed ({rc}); its output: {log}")
    times = {name: round(b - a, 1) for (name, a), (_, b) in zip(marks, [*marks[1:], ("end", end)])}
    return round(end - t0, 1), times


def decoder_params(model_dir: Path) -> int:
    """The target's parameters less its embedding (a lookup, no FLOPs), from the safetensors headers."""
    n = 0
    for f in model_dir.glob("*.safetensors"):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, t in header.items():
            if name != "__metadata__" and "embed_tokens" not in name:
                count = 1
                for d in t["shape"]:
                    count *= d
                n += count
    return n


def achieved(work: Path, target_params: float) -> dict:
    """GFLOP/s each compute-bound stage reached on its own clock: the target's decoder (2 x its
    parameters a token) in extract, the lm_head (2 x vocab x hidden a token) in the teacher."""
    read = lambda rel: json.loads((work / rel).read_text())
    target = read("reports/target.json")
    out = {}
    for f in sorted((work / "reports/timing/extract").glob("*.json")):
        t = read(f.relative_to(work))
        out[f"extract@{f.stem}"] = round(2 * target_params * t["tokens_per_s"] / 1e9, 1)
    for f in sorted((work / "reports/timing/teacher").glob("*.json")):
        t = read(f.relative_to(work))
        out[f"teacher@{f.stem}"] = round(2 * target["vocab_size"] * target["hidden_size"] * t["tokens_per_s"] / 1e9, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", choices=["native", "avx2"], default="native")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/cpu-kind"))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cpu_kinds.json")
    a = ap.parse_args()
    env = AVX2 if a.isa == "avx2" else {}
    os.environ.update(env)  # the clone's make, DVC and every stage inherit it
    shutil.rmtree(a.workdir, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", str(REPO), str(a.workdir)], check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=a.workdir, capture_output=True, text=True).stdout.strip()
    log = a.workdir.with_name(a.workdir.name + "-make-repro.log")
    wall, times = timed_make_repro(a.workdir, log)
    py = str(a.workdir / ".venv" / "bin" / "python")
    kind = json.loads(subprocess.run([py, "-c", MATMUL], cwd=a.workdir, capture_output=True, text=True,
                                     check=True).stdout)  # fmt: skip
    read = lambda rel: json.loads((a.workdir / rel).read_text())
    params = decoder_params(a.workdir / "data/target/model")
    ev = read("reports/evaluate.json")
    dtypes = {f"extract@{p.stem}": read(f"reports/extract/{p.stem}.json").get("dtype") for p in
              (a.workdir / "reports/timing/extract").glob("*.json")}  # fmt: skip
    dtypes["train"] = read("reports/train.json").get("dtype")
    entry = {
        "commit": head,
        "isa_limit": env or None,
        **kind,
        "compute_dtype": dtypes,
        "make_repro_s": wall,
        "stage_s": times,
        "decoder_params": params,
        "achieved_gflops": achieved(a.workdir, params),
        "train_tokens_per_s": read("reports/timing/train.json")["tokens_per_s"],
        "tau": ev["tau"],
        "identical_to_greedy": ev["identical_to_greedy"],
        "questions": ev["questions"],
        "evaluate_batch_size": ev["batch_size"],
        "speed": read("reports/timing/evaluate.json"),
        "reproduced_committed_lock": not subprocess.run(
            ["git", "status", "--porcelain"], cwd=a.workdir, capture_output=True, text=True
        ).stdout.strip(),  # fmt: skip
    }
    key = kind["cpu"] + (" (ISA-limited: " + ", ".join(f"{k}={v}" for k, v in env.items()) + ")" if env else "")
    results = json.loads(a.out.read_text()) if a.out.is_file() else {}
    results[key] = entry
    a.out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    json.dump({key: {k: entry[k] for k in ("make_repro_s", "stage_s", "compute_dtype", "tau")}}, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
