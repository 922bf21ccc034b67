"""The CPU default as a new user meets it: `make repro` in a fresh clone of the committed HEAD (its
venv included), timed stage by stage, then whether it reproduced what is committed (`git status`
clean: dvc.lock, metrics/ and reports/ byte for byte) and the figures it made.

    python -m bench.cpu_default [--workdir /tmp/cpu-default] [--out bench/results/cpu_default.json]

The clone's DVC cache is empty, so every stage runs whose outputs are not in git: when the drafter comes
out bit for bit as committed, DVC skips `evaluate` (its outputs are committed); it is then forced, for
its speed figures, and must reproduce its committed outputs too. Writes the JSON bench/RESULTS.md cites ("CPU
default"); the clone stays in --workdir for `dvc metrics diff`, its output beside it (<workdir>-make-repro.log)."""

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/cpu-default"))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cpu_default.json")
    a = ap.parse_args()
    shutil.rmtree(a.workdir, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", str(REPO), str(a.workdir)], check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=a.workdir, capture_output=True, text=True).stdout.strip()
    log = a.workdir.with_name(a.workdir.name + "-make-repro.log")  # outside the clone: git status stays its own
    wall, times = timed_make_repro(a.workdir, log)
    if not (a.workdir / "reports/timing/evaluate.json").exists():
        # evaluate's outputs are in git: with the drafter reproduced bit for bit, DVC skips the stage
        # (itself proof of reproduction). Run it anyway for its speed figures; its outputs must match too.
        t = time.time()
        dvc = str(a.workdir / ".venv" / "bin" / "dvc")
        env = {**os.environ, "PATH": f"{a.workdir / '.venv' / 'bin'}:{os.environ['PATH']}"}
        with open(log, "a") as f:
            subprocess.run([dvc, "repro", "--force", "--single-item", "evaluate"], cwd=a.workdir, env=env,
                           stdout=f, stderr=subprocess.STDOUT, check=True)  # fmt: skip
        times["evaluate (forced)"] = round(time.time() - t, 1)
    changed = subprocess.run(["git", "status", "--porcelain"], cwd=a.workdir, capture_output=True, text=True).stdout
    read = lambda rel: json.loads((a.workdir / rel).read_text())
    ev, timing = read("reports/evaluate.json"), read("reports/timing/evaluate.json")
    res = {
        "commit": head,
        "made_on": {k: ev[k] for k in ("cpu", "torch", "transformers")},
        "reproduced": not changed.strip(),  # git status clean: lock, metrics and reports as committed
        "changed": changed.split("\n")[:-1],
        "make_repro_s": wall,
        "stage_s": times,
        "tau": ev["tau"],
        "accept_per_position": ev["accept_rate_per_position"],
        "identical_to_greedy": ev["identical_to_greedy"],
        "questions": ev["questions"],
        "max_new_tokens": ev["max_new_tokens"],
        "speed": timing,
        "train": {**read("reports/train.json"), **read("reports/timing/train.json")},
        "data": read("metrics/data.json"),
        "extract": {p.stem: json.loads(p.read_text()) for p in (a.workdir / "reports/timing/extract").glob("*.json")},
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: res[k] for k in ("reproduced", "changed", "make_repro_s", "stage_s", "tau")}, indent=1))


if __name__ == "__main__":
    main()
