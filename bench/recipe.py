"""The recipe's options screened side by side against today's recipe (docs/design.md: Recipe options):
the profile's run as it is (the baseline), then one DVC experiment per option on the same data and
epochs, queued by tools/offline_gpu and run by DVC's own queue; each option's τ at every k and tree,
per MT-bench category, lossless counts and training tok/s, beside the baseline's from the same run.

    python -m bench.recipe [--profile default|gpu] [--options topk align ...] [--workdir W]
                           [-S train.epochs=4 ...] [--budget S] [--jobs N] [--out bench/results/recipe.json]

An option is a name below, names joined by `+` (a combination: `topk+decay9`), or a recipe of one's
own, `LABEL:KEY=VALUE,KEY=VALUE` (today's recipe against a profile that has taken a new one:
`today:train.topk=0,train.decay=0.8`).

`-S` sets params of the base run, and so of every option's (a screen at fewer epochs than the
profile's: the same for all, the baseline included); the JSON's key is the profile with them. The
quality gate (`evaluate.min_tau`) is off in a screen: it would end a weak option's run before its figures.

Safe to run again under a job time limit: finished stages are skipped, queued experiments are not
queued twice, and the figures are written once every option has run (exit 3 until then). The JSON
holds one entry per profile and its `-S` params; a later screen whose baseline is the same run (`-S`
alike, in the same work directory) adds its options to that entry's, and one whose baseline ran
again starts an entry of its own (`KEY #2`)."""

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from eaglenest.files.atomic import write_json
from eaglenest.runtime import children
from eaglenest.runtime.errors import EaglenestError, exit_on_error
from tools.offline_gpu import runner

OPTIONS = {  # name: the -S overrides of one experiment (HASS's published K and weight; a tree's top-4)
    "topk": ["train.topk=10", "train.topk_weight=1.0"],
    "align": ["train.align_topk=4"],
    "ttt5": ["train.ttt_steps=5"],
    "decay9": ["train.decay=0.9"],
    "long": ["generate.max_new_tokens=512", "tokenize.max_seq_len=1024"],
    "vocab32k": ["pack.draft_vocab_size=32768"],  # EAGLE-3's drafters: 32k draft tokens
}


def option_sets(spec: str) -> list[str]:
    """The -S overrides of one option as `--options` gives it (see the module's doc)."""
    if ":" in spec:
        label, _, sets = spec.partition(":")
        pairs = [kv for kv in sets.split(",") if kv]
        if not label or not pairs or not all("=" in kv and kv.index("=") > 0 for kv in pairs):
            raise argparse.ArgumentTypeError(f"{spec!r}: a recipe of one's own is LABEL:KEY=VALUE[,KEY=VALUE...]")
        return pairs
    unknown = [n for n in spec.split("+") if n not in OPTIONS]
    if unknown:
        raise argparse.ArgumentTypeError(f"{spec!r}: no option {', '.join(unknown)} (options: {', '.join(OPTIONS)})")
    return [kv for n in spec.split("+") for kv in OPTIONS[n]]


def option_name(spec: str) -> str:
    """The experiment's name: the label of a recipe of one's own, else the names as given."""
    return spec.partition(":")[0]


def category_tau(questions: list[dict]) -> dict:
    """{mode: {category: τ}}: a category's tokens over its verifications (each question's tokens / τ)."""
    out = {}
    for mode in sorted({k.removeprefix("tau_") for q in questions for k in q if k.startswith("tau_")}):
        cats = {}
        for q in questions:
            tok, ver = cats.get(q["category"], (0, 0.0))
            cats[q["category"]] = (tok + q["tokens"], ver + q["tokens"] / q[f"tau_{mode}"])
        out[mode] = {c: round(t / v, 4) for c, (t, v) in sorted(cats.items())}
    return out


def figures(reports: dict) -> dict:
    """One run's figures from its evaluate, question and train reports."""
    ev, tr = reports["evaluate"], reports.get("train", {})
    return {
        "tau": {k: round(v, 4) for k, v in ev["tau"].items()},
        "lossless": {k: f"{v}/{ev['questions']}" for k, v in ev.get("lossless", ev["identical_to_greedy"]).items()},
        "tau_by_category": category_tau(reports.get("evaluate_questions", [])),
        "val_loss": tr.get("val_loss"),
        "val_acc_per_step": tr.get("val_acc_per_step"),
        "train_tokens_per_s": reports.get("timing/train", {}).get("tokens_per_s"),
        "train_wall_s": reports.get("timing/train", {}).get("wall_s"),
        # what an epoch holds: an option that changes the data (`long`) trains on more tokens
        "train_tokens": reports.get("pack", {}).get("train_tokens"),
        "loss_tokens": reports.get("pack", {}).get("masked_tokens"),
        "val_per_epoch": reports.get("curve", {}),
    }


def add_screen(results: dict, key: str, entry: dict) -> str:
    """Files a screen's entry under key and returns the key used. A later screen on the same baseline
    run (its stages skipped, so the same figures) adds its options to that entry; a baseline that ran
    again (a fresh host, other code) starts an entry of its own, `key #2`, ...: its options compare
    only with it, and the earlier entry's figures stay."""
    same = [k for k in results if k == key or k.startswith(f"{key} #")]
    for k in same:
        if results[k]["runs"]["baseline"] == entry["runs"]["baseline"]:
            results[k] = {**entry, "runs": {**results[k]["runs"], **entry["runs"]}}
            return k
    k = f"{key} #{len(same) + 1}" if same else key
    results[k] = entry
    return k


def call(cmd: list[str]) -> int:
    """cmd to its end, its output passed through. SIGTERM or SIGHUP here (a job time limit) goes on to it
    as SIGTERM and is waited for: a run interrupts its stage as `tools.offline_gpu stop` does (the
    trainer keeps a checkpoint). Ctrl-C reaches the whole process group by itself."""
    p = subprocess.Popen(cmd)
    try:
        return p.wait()
    except KeyboardInterrupt as e:
        if children.signum(e) != signal.SIGINT:
            p.send_signal(signal.SIGTERM)
        p.wait()
        raise


def step(cmd: list[str]) -> None:
    if code := call(cmd):
        raise EaglenestError(f"{' '.join(cmd[2:])} failed (exit {code}); its output is above")


@exit_on_error
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="default", help="profiles/<name>.yaml, or default: params.yaml")
    ap.add_argument("--options", nargs="+", default=["topk", "align"], metavar="OPTION",
                    help=f"{', '.join(OPTIONS)}; a combination a+b; or LABEL:KEY=VALUE,...")  # fmt: skip
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/eaglenest-recipe"))
    ap.add_argument("-S", dest="set", action="append", default=[], metavar="KEY=VALUE", help="a param of every run")
    ap.add_argument("--budget", type=float, default=7200, help="seconds this command may take")
    ap.add_argument("--jobs", type=int, default=1, help="experiments at once (one per GPU's memory, one on 2 cores)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/recipe.json"))
    a = ap.parse_args()
    try:
        sets_of = {option_name(o): option_sets(o) for o in a.options}
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    end = time.time() + a.budget
    g = [sys.executable, "-m", "tools.offline_gpu", "--workdir", str(a.workdir)]
    left = lambda: str(max(0, round(end - time.time())))  # noqa: E731
    # a screen compares runs: the quality gate (evaluate.min_tau) would fail a weak option's run before its figures
    sets = ["evaluate.min_tau=null", *a.set]
    step([*g, "setup", "--profile", a.profile, *[x for kv in sets for x in ("-S", kv)]])
    if (code := call([*g, "run", "--budget", left()])) == 3:
        sys.exit(3)  # the baseline goes on next time
    if code:
        raise EaglenestError(f"the profile's run failed (exit {code}); its output is above")
    for name, option in sets_of.items():
        step([*g, "enqueue", name, *[x for s in option for x in ("-S", s)]])
    step([*g, "queue", "--jobs", str(a.jobs), "--budget", left()])
    state = a.workdir / ".offline_gpu"
    done = json.loads((state / "experiments.json").read_text()) if (state / "experiments.json").exists() else {}
    if any(n not in done for n in sets_of):
        print(f"not every option has run ({sorted(done)} of {list(sets_of)}); run again")
        sys.exit(3)
    reports = a.workdir / "reports"
    load = lambda rel: json.loads((reports / rel).read_text()) if (reports / rel).exists() else {}  # noqa: E731
    base = figures(
        {n: load(f"{n}.json") for n in ("evaluate", "train", "pack", "evaluate_questions", "timing/train")}
        | {"curve": runner.epoch_curve(a.workdir)}
    )
    rows = {"baseline": base}
    for name, option in sets_of.items():
        f = figures(done[name])
        f["set"] = option
        f["tau_gain"] = {k: round(v / base["tau"][k] - 1, 4) for k, v in f["tau"].items() if k in base["tau"]}
        f["jobs"] = a.jobs  # side by side: its tok/s compares only with runs of as many jobs
        rows[name] = f
    made = {k: v for k in ("cpu", "gpu") if (v := load("train.json").get(k)) is not None}
    results = json.loads(a.out.read_text()) if a.out.exists() else {}
    key = " ".join([a.profile, *a.set])
    entry = {"date": time.strftime("%Y-%m-%d"), **made, "set": a.set, "runs": rows}
    print(f"{a.out}: {add_screen(results, key, entry)!r}")
    write_json(a.out, results)
    print(json.dumps({n: (r["tau"], r.get("tau_gain")) for n, r in rows.items()}, indent=1))


if __name__ == "__main__":
    main()
