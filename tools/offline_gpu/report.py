"""A work repo's run as one JSON (bench/results/gpu_profile.json's format): tau, speed and trees from
the evaluate stage, the stage times and disk the runner recorded, what each stage made and read, the
experiments run beside it, and the footprint of the data and the DVC cache."""

import json
import shutil
import subprocess
import time
from pathlib import Path

import yaml

from tools.offline_gpu.runner import DISK, EXPS, STATE, TIMES, record

COPIED = ("evaluate.json", "train.json", "pack.json", "evaluate_questions.json", "timing/evaluate.json")


def du(*paths: Path) -> int:
    """Bytes on disk under paths together (a file hard-linked twice counted once, as DVC links them)."""
    out = subprocess.run(["du", "-sB1", "-c", *map(str, paths)], capture_output=True, text=True).stdout
    return int(out.splitlines()[-1].split()[0])


def footprint(work: Path) -> dict:
    disk = record(work, DISK)
    t = time.time()
    clean = subprocess.run(["dvc", "status", "-q"], cwd=work, capture_output=True).returncode == 0
    status_s = time.time() - t
    link = subprocess.run(["dvc", "config", "cache.type"], cwd=work, capture_output=True, text=True).stdout.strip()
    return {
        "workspace_data_gb": round(du(work / "data") / 1e9, 2),
        "dvc_cache_gb": round(du(work / ".dvc" / "cache") / 1e9, 2),
        "workspace_and_cache_gb": round(du(work / "data", work / ".dvc" / "cache") / 1e9, 2),
        "df_rise_gb": round(disk["evaluate"]["used_gb"] - disk["start"]["used_gb"], 1)
        if {"start", "evaluate"} <= set(disk)
        else None,  # fmt: skip
        "dvc_status_s": round(status_s, 2),
        "dvc_status_clean": clean,
        "link_type": link or "dvc default (reflink, copy)",
    }


def gather(work: Path) -> dict:
    r = work / "reports"
    load = lambda rel: json.loads((r / rel).read_text()) if (r / rel).exists() else {}  # noqa: E731
    parts = set(yaml.safe_load((work / "params.yaml").read_text())["data"]["parts"])
    # this run's parts only: reports of parts an earlier config had stay in reports/
    each = lambda stage: {p.stem: json.loads(p.read_text()) for p in (r / stage).glob("*.json") if p.stem in parts}  # noqa: E731,E501
    total = lambda rows, key: sum(v.get(key, 0) for v in rows.values())  # noqa: E731
    times = {k: v for k, v in record(work, TIMES).items() if not k.startswith("exp:")}
    ev, ev_time, tr = load("evaluate.json"), load("timing/evaluate.json"), load("train.json")
    gen, gen_time, wall = each("generate"), each("timing/generate"), each("timing/extract")
    by_kind = {}
    for stage, s in times.items():
        by_kind[stage.split("@")[0]] = round(by_kind.get(stage.split("@")[0], 0) + s, 1)
    chains = ev_time.get("k", {})
    res = {
        "tau": ev.get("tau"),
        "accept_per_position": ev.get("accept_rate_per_position"),
        "questions": ev.get("questions"),
        "identical_to_greedy": ev.get("identical_to_greedy"),
        "lossless": ev.get("lossless"),
        "speedup": {k: v["speedup"] for k, v in chains.items()},
        "tokens_per_s_plain": ev_time.get("tokens_per_s_plain"),
        "tokens_per_s_spec": {k: v["tokens_per_s"] for k, v in chains.items()},
        "break_even_tau": {k: v["break_even_tau"] for k, v in chains.items()},
        "max_new_tokens": ev.get("max_new_tokens"),
        "tree": {
            name: {
                "tau": ev["tau"][name],
                "identical_to_greedy": ev["identical_to_greedy"][name],
                "lossless": ev.get("lossless", {}).get(name),
                "accept_per_depth": ev["accept_rate_per_position"][name],
                "speedup": t["speedup"],
                "tokens_per_s": t["tokens_per_s"],
            }
            for name, t in ev_time.get("tree", {}).items()
        },  # fmt: skip
        "best_k": ev_time.get("best_k"),
        "best_tree": ev_time.get("best_tree"),
        "wall_s": {"total": round(sum(times.values()), 1), **by_kind},
        "wall_s_per_stage": times,
        "disk_after_stage": record(work, DISK),
        "conversations": total(each("sharegpt"), "conversations"),
        "generate": {
            k: total(gen, k)
            for k in (
                "regenerated",
                "assistant_turns",
                "cut_at_max_tokens",
                "cut_at_context",
                "skipped_context",
                "generated_tokens",
            )
        },  # fmt: skip
        "tokenized_tokens": total(each("tokenize"), "tokens"),
        "loss_tokens": total(each("tokenize"), "loss_tokens"),
        "extract": {
            k: {
                "gate_passed": e.get("validation", {}).get("passed"),
                **{f: wall.get(k, {}).get(f) for f in ("tokens_per_s", "wall_s", "forward_s", "fixed_cost")},
            }
            for k, e in each("extract").items()
        },  # fmt: skip
        "pack": load("pack.json"),
        "train": {
            k: tr.get(k) for k in ("epochs", "steps", "train_loss", "val_loss", "val_acc_per_step", "val_simulated_tau")
        }
        | {"tokens_per_s": load("timing/train.json").get("tokens_per_s")},  # noqa: E501  # fmt: skip
        "experiments": record(work, EXPS),
        "footprint": footprint(work),
    }
    decode_s = sum(g.get("decode_s", 0) for g in gen_time.values())
    res["generate"]["tokens_per_s"] = round(res["generate"]["generated_tokens"] / decode_s, 1) if decode_s else None
    return res


def report(work: Path, out: Path, with_drafter: bool = False) -> None:
    """gpu_profile.json and the evaluate, train and pack reports into out; the drafter too with --with-drafter."""
    res = gather(work)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_profile.json").write_text(json.dumps(res, indent=1) + "\n")
    for rel in COPIED:
        if (work / "reports" / rel).exists():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(work / "reports" / rel, out / rel)
    if with_drafter and (work / "data" / "drafter" / "config.json").exists():  # ~45 MB: to serve it elsewhere
        shutil.copytree(work / "data" / "drafter", out / "drafter", dirs_exist_ok=True)
    with open(out / "stage_logs.txt", "w") as f:  # the end of each stage's output
        for log in sorted((work / STATE / "logs").glob("*.log")):
            f.write(f"==== {log.stem}\n" + "".join(log.read_text(errors="replace").splitlines(True)[-25:]))
    print(json.dumps({k: res[k] for k in ("tau", "speedup", "wall_s", "identical_to_greedy")}, indent=1))
