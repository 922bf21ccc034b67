"""The synthetic-data curve on the GPU profile: tau at k = 3 and 7 with ShareGPT alone, with 1x, 2x and
4x its conversations of synthetic ones added, and with synthetic ones alone at ShareGPT's count. Every
point trains the same epochs (--epochs, fewer than the profile's 13, to fit the lent machines' time)
and evaluates chains only (k 3 and 7, one speed question, no gate).

    python -m bench.gpu_curve plan [--epochs 3] [--turns 1]
        the points and an estimate of each one's device minutes, from bench/results/gpu_profile.json
    python -m bench.gpu_curve run [--budget 1700] [--epochs 3] [--turns 1] [--detach] [--count N] [-S k=v]
        the points not done yet, in order: for each, bench.gpu_profile's setup (the GPU profile with
        the point's data.parts) and run, then its report into <workdir>/bench/out/curve/<point>/;
        stops at the budget, and carries on where it stopped when called again (on this machine, or
        on a fresh one after `load`). --detach: in the background; follow it with `wait`.
    python -m bench.gpu_curve wait [--budget 560]
    python -m bench.gpu_curve save --out DIR
        what a fresh machine should not redo, in files a device call brings back (<= 15 MiB each):
        the DVC run-cache entries of the synthetic and generate stages with their outputs
        (texts.tgz.NNN: the GPU's costly text), and the finished points (points.tgz)
    python -m bench.gpu_curve load DIR
        on a fresh machine, before `run`: the saved runs into the work repo's DVC cache, so `dvc
        repro` restores those stages ("Stage ... is cached") instead of decoding again; points done
    python -m bench.gpu_curve table DIR [--results bench/results]
        here: the points' reports (DIR/points.tgz or DIR/<point>/) and their table (curve.json) into
        <results>/gpu_curve/, the synthetic parts' filter counts from the saved run-cache into
        <results>/gpu_curve/synthetic/, and `synthetic_curve` of <results>/gpu_profile.json where there is one

A lent machine is held ~30 minutes, so the curve takes several; between them the saved runs travel
through this machine (.carry/curve/, ignored by git): a DVC run-cache, restored as DVC restores any
stage run, is what keeps a part's synthetic prompts and answers from being decoded twice. Stores are
extracted again on each machine (~80 s for ShareGPT's 8M tokens): they are GBs, the texts MBs.

A session's calls, back to back (bench/gpu_carry.py for the packages):
    here:    python -m bench.gpu_carry prepare; python -m bench.gpu_curve plan
    device:  python3 -m bench.gpu_carry stash .carry/N                      (carry .carry/N; N = 1, 2)
    device:  stash .carry/3; install, its exports kept in ~/env.sh
    device:  . ~/env.sh; python3 -m bench.gpu_curve load .carry/curve (carry .carry/curve, where an
             earlier session saved one); python3 -m bench.gpu_curve run --detach --budget B (B: the
             session's device seconds left, less ~3 minutes); wait --budget 500
    device:  wait --budget 560, again until it ends; then python3 -m bench.gpu_curve save --out $OUT
    here:    the returned files into .carry/curve/ (replacing its files); once every point is in,
             python -m bench.gpu_curve table .carry/curve. The curve smoke-tested on the CPU with tiny
             parts (-S data.sharegpt=..., --count 4, --epochs 1): all five points, then save, load into
             a fresh work repo, and a rerun that restored every synthetic and generate stage from the
             saved run-cache."""

import argparse
import json
import os
import shutil
import sys
import tarfile
import time
from pathlib import Path

import yaml

from bench import gpu_profile as gp

SHAREGPT = ["sharegpt-h0", "sharegpt-h1"]
COUNT = 17333  # ShareGPT's usable conversations (profiles/gpu.yaml): "1x its volume"
POINTS = {
    "sharegpt": SHAREGPT,
    "syn1x": [*SHAREGPT, "synth-000"],
    "synonly": ["synth-000"],
    "syn2x": [*SHAREGPT, "synth-000", "synth-001"],
    "syn4x": [*SHAREGPT, "synth-000", "synth-001", "synth-002", "synth-003"],
}
CURVE = "bench/out/curve"
SAVED_STAGES = ("python -m stages.synthetic ", "python -m stages.generate ")
CHUNK = 15 * 2**20  # a device call brings back files of at most 16 MiB


def synthetic_parts(turns: int, count: int = COUNT) -> dict:
    spec = {"count": count, "temperature": 1.0, **({"turns": turns} if turns > 1 else {})}
    return {f"synth-{i:03d}": {**spec, "seed": i} for i in range(4)}


def point_sets(name: str, epochs: int, turns: int, count: int = COUNT, extra: list[str] = ()) -> list[str]:
    """bench.gpu_profile setup's -S overrides of one point, then `extra` (every point declares the same
    synthetic parts, so each part's stages are the same DVC stages, run-cached, whichever point runs them)."""
    flow = lambda v: yaml.safe_dump(v, default_flow_style=True, width=10**6).strip()  # noqa: E731
    return [
        f"data.parts={flow(POINTS[name])}",
        f"data.synthetic={flow(synthetic_parts(turns, count))}",
        f"train.epochs={epochs}",
        "evaluate.trees=[]",
        "evaluate.speed_questions=1",
        "evaluate.min_tau=null",
        *extra,
    ]


def plan(epochs: int) -> None:
    """Device minutes per point, scaled from the committed GPU profile run's own stage times."""
    prof = json.loads((gp.REPO / "bench/results/gpu_profile.json").read_text())
    wall, tokens = prof["wall_s"], prof["train_tokens"]
    train_rate = tokens * prof["train"]["epochs"] / wall["train"]
    share_data = sum(wall[k] for k in ("sharegpt", "generate", "tokenize", "extract")) + 60  # + teacher
    synth_tokens = COUNT * (prof["generate"]["generated_tokens"] / prof["samples"] + 60)  # answer + prompt
    synth_data = (share_data - wall["sharegpt"]) * synth_tokens / tokens + 60  # + the prompts' decoding
    print(f"train {train_rate / 1e3:.0f}k tok/s and the data stages of {prof['run'][:60]}...")
    total = wall["target"]
    for name, parts in POINTS.items():
        n_syn = sum(p.startswith("synth") for p in parts)
        toks = tokens * (len(parts) > n_syn) + synth_tokens * n_syn
        train_s = epochs * toks / train_rate + 60  # + compile and loaders
        new_data = share_data * (name == "sharegpt") + synth_data * (name in ("syn1x", "syn2x", "syn4x"))
        new_data *= {"syn2x": 1, "syn4x": 2}.get(name, 1)  # parts that point adds
        s = new_data + train_s + 90 + 30  # + evaluate (chains) + pack
        total += s
        print(f"{name:9s} {', '.join(parts):62s} ~{toks / 1e6:5.1f}M tokens  ~{s / 60:4.1f} min")
    print(f"all points: ~{total / 60:.0f} device minutes on one machine (a fresh machine extracts its parts again)")


def finished(work: Path) -> set[str]:
    return {p.parent.name for p in (work / CURVE).glob("*/gpu_profile.json")}


def run(work: Path, budget: float, epochs: int, turns: int, count: int, profile: str, extra: list[str]) -> None:
    t0 = time.time()
    for name in POINTS:
        if name in finished(work):
            print(f"== {name}: done before")
            continue
        left = budget - (time.time() - t0)
        if left < 180:
            print(f"budget spent; next point: {name}")
            return
        print(f"== point {name}: {', '.join(POINTS[name])}, {epochs} epochs", flush=True)
        gp.setup(work, profile, point_sets(name, epochs, turns, count, extra))
        (work / gp.TIMES).parent.mkdir(parents=True, exist_ok=True)
        (work / gp.TIMES).write_text("{}")  # this point's own stage times (stages restored or skipped: none)
        if not gp.run(work, left, 60):
            print(f"budget spent inside point {name}; it carries on next call")
            return
        gp.report(work, work / CURVE / name)
    print("curve: all points done")


def save(work: Path, out: Path) -> None:
    """Run-cache entries of SAVED_STAGES whose outputs are all files in the cache, with those files."""
    cache = work / ".dvc" / "cache"
    members = []
    for entry in sorted((cache / "runs").glob("*/*/*")):
        run_ = yaml.safe_load(entry.read_text())
        outs = run_.get("outs") or []
        if not run_.get("cmd", "").startswith(SAVED_STAGES) or any(o["md5"].endswith(".dir") for o in outs):
            continue
        objs = [cache / "files" / "md5" / o["md5"][:2] / o["md5"][2:] for o in outs]
        if all(p.exists() for p in objs):
            members += [entry, *objs]
    out.mkdir(parents=True, exist_ok=True)
    tgz = out / "texts.tgz"
    with tarfile.open(tgz, "w:gz") as tar:
        for m in dict.fromkeys(members):
            tar.add(m, arcname=str(m.relative_to(cache)))
    n = split(tgz, CHUNK)
    with tarfile.open(out / "points.tgz", "w:gz") as tar:
        for name in sorted(finished(work)):
            tar.add(work / CURVE / name, arcname=name)
    runs = sum(1 for m in members if "runs" in m.parts)
    print(f"{out}: {runs} stage runs and their outputs in {n} file(s) texts.tgz.NNN; points {sorted(finished(work))}")


def split(path: Path, size: int) -> int:
    """path -> path.000, path.001, ... of at most `size` bytes each (the original removed)."""
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(size):
            (path.parent / f"{path.name}.{n:03d}").write_bytes(chunk)
            n += 1
    path.unlink()
    return n


def joined(src: Path, name: str) -> Path | None:
    """src/name.000... concatenated into a temporary file (None where there is none)."""
    pieces = sorted(src.glob(f"{name}.[0-9][0-9][0-9]"))
    if not pieces:
        return None
    tmp = src / f".{name}.joined"
    with open(tmp, "wb") as f:
        for p in pieces:
            f.write(p.read_bytes())
    return tmp


def load(work: Path, src: Path) -> None:
    if not work.exists():
        gp.setup(work, "gpu", [])
    cache = work / ".dvc" / "cache"
    texts = joined(src, "texts.tgz")
    if texts is None:
        sys.exit(f"{src}: no texts.tgz.NNN (bench.gpu_curve save writes them)")
    try:
        with tarfile.open(texts) as tar:
            tar.extractall(cache, filter="data")
            runs = sum(1 for m in tar.getnames() if m.startswith("runs/"))
    finally:
        texts.unlink()
    done = []
    if (src / "points.tgz").exists():
        with tarfile.open(src / "points.tgz") as tar:
            tar.extractall(work / CURVE, filter="data")
        done = sorted(finished(work))
    print(f"{work}: {runs} stage runs restored into the DVC cache; points done: {done}")


def saved_reports(src: Path, stage: str) -> dict[str, dict]:
    """The reports/<stage>/<part>.json outputs of the stage runs that `save` put in src/texts.tgz.NNN."""
    texts = joined(src, "texts.tgz")
    if texts is None:
        return {}
    found = {}
    try:
        with tarfile.open(texts) as tar:
            for m in tar.getmembers():
                if not m.name.startswith("runs/"):
                    continue
                for o in yaml.safe_load(tar.extractfile(m)).get("outs") or []:
                    rel = Path(o["path"])
                    if rel.parent == Path("reports", stage):
                        obj = tar.extractfile(f"files/md5/{o['md5'][:2]}/{o['md5'][2:]}")
                        found[rel.stem] = json.load(obj)
    finally:
        texts.unlink()
    return found


def table(src: Path, results: Path) -> None:
    """The points' reports into <results>/gpu_curve/<point>/, the synthetic parts' filter counts (from the
    saved run-cache) into <results>/gpu_curve/synthetic/, and <results>/gpu_profile.json's synthetic_curve."""
    dst = results / "gpu_curve"
    if (src / "points.tgz").exists():
        with tarfile.open(src / "points.tgz") as tar:
            tar.extractall(dst, filter="data")
    elif src.resolve() != dst.resolve():
        shutil.copytree(src, dst, dirs_exist_ok=True)
    for part, rep in saved_reports(src, "synthetic").items():
        (dst / "synthetic").mkdir(parents=True, exist_ok=True)
        (dst / "synthetic" / f"{part}.json").write_text(json.dumps(rep, indent=1) + "\n")
    filters = {f.stem: json.loads(f.read_text()) for f in (dst / "synthetic").glob("*.json")}
    rows = []
    for name, parts in POINTS.items():
        f = dst / name / "gpu_profile.json"
        if not f.exists():
            continue
        r = json.loads(f.read_text())
        rows.append(
            {
                "point": name,
                "parts": parts,
                # pack's own counts: reports of parts outside the point may lie in the workspace
                "samples": {k: v["samples"] for k, v in r["pack"]["parts"].items()},
                "tokens": r["pack"]["tokens"],
                "train_tokens": r["pack"]["train_tokens"],
                "epochs": r["train"]["epochs"],
                "tau_k3": r["tau"].get("3"),
                "tau_k7": r["tau"].get("7"),  # the GPU profile's second k; a CPU curve may not ask it
                "identical_to_greedy": r["identical_to_greedy"],
                "val_loss": r["train"]["val_loss"],
                "synthetic_filter": {  # what each synthetic part's filter kept of what the target wrote
                    p: {k: v for k, v in filters[p].items() if k in ("sampled", "kept") or k.startswith("dropped_")}
                    for p in parts
                    if p in filters
                },
            }
        )
    (dst / "curve.json").write_text(json.dumps(rows, indent=1) + "\n")
    prof_path = results / "gpu_profile.json"
    if prof_path.exists():  # the GPU profile's page of figures gains the curve
        prof = json.loads(prof_path.read_text())
        prof["synthetic_curve"] = rows
        prof_path.write_text(json.dumps(prof, indent=1) + "\n")
    print(json.dumps(rows, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path.home() / "run")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    r = sub.add_parser("run")
    for x in (p, r):
        x.add_argument("--epochs", type=int, default=3, help="every point's epochs (the profile's: 13)")
        x.add_argument("--turns", type=int, default=1, help="user turns per synthetic conversation")
    r.add_argument("--budget", type=float, default=1700)
    r.add_argument("--count", type=int, default=COUNT, help="conversations per synthetic part (1x)")
    r.add_argument("--profile", default="gpu", help="profiles/<name>.yaml under the points' keys")
    r.add_argument("-S", dest="sets", action="append", default=[], help="section.key=yaml, after the point's")
    r.add_argument("--detach", action="store_true", help="in the background, outliving this call; then `wait`")
    w = sub.add_parser("wait")
    w.add_argument("--budget", type=float, default=560)
    s = sub.add_parser("save")
    s.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out/curve_saved")))
    ld = sub.add_parser("load")
    ld.add_argument("src", type=Path)
    t = sub.add_parser("table")
    t.add_argument("src", type=Path)
    t.add_argument("--results", type=Path, default=gp.REPO / "bench" / "results")
    a = ap.parse_args()
    if a.cmd == "plan":
        plan(a.epochs)
    elif a.cmd == "run" and a.detach:
        args = [f"--{k}={getattr(a, k)}" for k in ("budget", "epochs", "turns", "count", "profile")]
        gp.detach(a.workdir, [*args, *(f"-S{x}" for x in a.sets)], module="bench.gpu_curve")
    elif a.cmd == "run":
        run(a.workdir, a.budget, a.epochs, a.turns, a.count, a.profile, a.sets)
    elif a.cmd == "wait":
        gp.wait(a.workdir, a.budget, done=("curve: all points done", "budget spent"))
    elif a.cmd == "save":
        save(a.workdir, a.out)
    elif a.cmd == "load":
        load(a.workdir, a.src)
    else:
        table(a.src, a.results)


if __name__ == "__main__":
    main()
