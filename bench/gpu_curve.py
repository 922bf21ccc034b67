"""The synthetic-data curve on the GPU profile: tau at k = 3 and 7 with ShareGPT alone, with 1x, 2x and
4x its conversations of synthetic ones added, and with synthetic ones alone at ShareGPT's count. Every
point trains the same epochs (--epochs, fewer than the profile's 13, to fit a GPU host's job time limit)
and evaluates chains only (k 3 and 7, one speed question, no gate). --points syn8x (+ 8x) goes beyond
those five, by request only: its stores outgrow a one-GPU host's disk (`plan` says by how much).

    python -m bench.gpu_curve plan [--epochs 3] [--points P,..] [--saved .carry/curve] [--machine-min 24]
        the points not finished yet, each one's minutes, the GPU host job(s) it falls on and its stores'
        GB against a machine's free disk, from the stage times of the finished point that trained on
        the most tokens (bench/results/gpu_curve/; before one, of the GPU profile's run; a stage
        restored there, of the next one that ran it) and what the saved run-cache already holds: a
        point's prompts, answers, tokens and teacher, and the training a saved checkpoint has done
    python -m bench.gpu_curve run [--budget 1700] [--epochs 3] [--points P,..] [--turns 1] [--detach]
                                  [--count N] [-S k=v]
        the points not done yet (--points: those, e.g. --points syn2x --epochs 13 for the profile's
        epochs), in order: for each, bench.gpu_profile's setup (the GPU profile with the point's
        data.parts) and run, then its report into <workdir>/bench/out/curve/<point>/ (<point>-<E>ep at
        other epochs than 3); stops at the budget, and carries on where it stopped when called again:
        on this machine, or on a fresh one after `load`, training too (from the checkpoint `save`
        carried). --detach: in the background; follow it with `wait`.
    python -m bench.gpu_curve wait [--budget 560]
    python -m bench.gpu_curve stop
        a detached run stopped as its budget would: the running stage interrupted (training saves a
        checkpoint first); returns once the run has exited
    python -m bench.gpu_curve save --out DIR
        what a fresh machine should not redo, in files a bounded command brings back: the DVC run-cache
        entries of the synthetic, generate, tokenize and teacher stages with their outputs (chunks
        runcache.tgz.NNN + runcache.json, bench/runcache_carry.py), the finished points (points.tgz)
        and, where a point stopped inside training, its checkpoint (~260 MiB for the profile's drafter:
        5 calls) and stage times so far; a set over one call's 60 MiB goes on with `save` in the next
        call. Collected, a newer set replaces the older one only once it is whole.
    python -m bench.gpu_curve collect SRC [--into .carry/curve]
        here: a call's returned files into .carry/curve/1, 2, ... (one carried folder each)
    python -m bench.gpu_curve load DIR
        on a fresh machine, before `run`, once per carried folder: the saved runs into the work repo's
        DVC cache once all chunks are there, so `dvc repro` restores those stages ("Stage ... is
        cached") instead of running them again, and an unfinished point's checkpoint where stages.train
        resumes it ("resumed from ... at epoch E step S"); points done
    python -m bench.gpu_curve table DIR [--results bench/results]
        here: the points' reports (DIR/points.tgz or DIR/<point>/) and their table (curve.json) into
        <results>/gpu_curve/, the synthetic parts' filter counts from the saved run-cache into
        <results>/gpu_curve/synthetic/, and `synthetic_curve` of <results>/gpu_profile.json where there is one

A GPU host job is limited to ~30 minutes, so the curve takes several; between them the saved runs travel
through this machine (.carry/curve/, ignored by git: it lasts as long as this checkout, a session
given a fresh checkout starts without it, and `plan` counts only what it holds): a DVC run-cache,
restored as DVC restores any stage run, is what keeps a part's synthetic prompts and answers from
being decoded twice, and its tokenize and teacher stages from running twice where the store comes
out byte for byte the same.
Stores are extracted again on each machine (~40 s a 4M-token part): they are GBs, the rest MBs.

A session's calls, back to back (bench/gpu_carry.py for the packages):
    here:    python -m bench.gpu_carry prepare; python -m bench.gpu_curve plan
    device:  python3 -m bench.gpu_carry stash .carry/N                      (carry .carry/N; N = 1, 2)
    device:  stash .carry/3; install, its exports kept in ~/env.sh
    device:  . ~/env.sh; python3 -m bench.gpu_curve load .carry/curve/N (carry .carry/curve/N), one
             call per folder collected earlier in this checkout (a folder and .carry/3 share one call where
             both fit in 58 MiB); with the last, python3 -m bench.gpu_curve
             run --detach --budget B (B: the session's device seconds left, less ~4 minutes); wait
    device:  wait --budget 560, again until it ends (or `stop` it: training saves a checkpoint); then
             python3 -m bench.gpu_curve save --out $OUT, again in another call while it says chunks
             are left
    here:    python -m bench.gpu_curve collect /work/.device/<call> after each save call; once every
             point is in, python -m bench.gpu_curve table .carry/curve. The curve smoke-tested on the
             CPU with tiny parts (-S data.sharegpt=..., --count 4, --epochs 1): all five points, then
             save, load into a fresh work repo, and a rerun that restored every synthetic and generate
             stage from the saved run-cache. And a point stopped inside training (--epochs 40 --budget
             200): saved in 5 calls, loaded in a fresh work repo, its stores extracted again, it resumed
             at the step it stopped at; its drafter came out byte for byte the one the first work repo
             made on resuming there."""

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
from bench import runcache_carry as rc
from stages import _paths as paths

SHAREGPT = ["sharegpt-h0", "sharegpt-h1"]
COUNT = 17333  # ShareGPT's usable conversations (profiles/gpu.yaml): "1x its volume"
SYNTH_PART_TOKENS = COUNT * 265  # a synthetic part's tokens before any was made (265 a sample)
POINTS = {
    "sharegpt": SHAREGPT,
    "syn1x": [*SHAREGPT, "synth-000"],
    "synonly": ["synth-000"],
    "syn2x": [*SHAREGPT, "synth-000", "synth-001"],
    "syn4x": [*SHAREGPT, "synth-000", "synth-001", "synth-002", "synth-003"],
    # beyond the five, on request only: + 8x, projected to reach tau 2.8 at 13 epochs, outgrows a
    # one-GPU host's disk (`plan --points syn8x` gives its GB and minutes)
    "syn8x": [*SHAREGPT, *(f"synth-{i:03d}" for i in range(8))],
}
CURVE_POINTS = ["sharegpt", "syn1x", "synonly", "syn2x", "syn4x"]  # the curve `run` and `plan` take by default
EPOCHS = 3  # the curve's epochs: a point at other epochs is reported as <point>-<epochs>ep
CURVE = "bench/out/curve"
CKPT = paths.TRAIN_CKPT  # stages.train's checkpoints, in the work repo
RUNNING = f"{CURVE}/running"  # the point begun and not finished (its stage times are gp.TIMES)
CKPT_S = 90  # a run that goes on on the next machine: its checkpoint saved there, loaded here (calls)
# stages a fresh machine restores from the saved run-cache: the texts (the GPU's costly decoding) and
# the small per-part outputs of stages that read a store (a store is GBs: each machine extracts again;
# teacher@<part> is restored where that extraction comes out byte for byte the same)
SAVED_STAGES = tuple(f"python -m stages.{s} " for s in ("synthetic", "generate", "tokenize", "teacher"))
CALL_BYTES = 60 * 2**20  # a bounded command brings back <= 64 MiB
CARRY_BYTES = 58 * 2**20  # and carries <= 64 MiB with the working tree (as bench.gpu_carry's chunks)
STASH = Path.home() / "curve_in"


def label(name: str, epochs: int) -> str:
    return name if epochs == EPOCHS else f"{name}-{epochs}ep"


def point_of(lab: str) -> str:
    """The point a report directory (`label`) is of."""
    return lab.split("-")[0]


def points_arg(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    if bad := [n for n in names if n not in POINTS]:
        raise argparse.ArgumentTypeError(f"no point {', '.join(bad)} (points: {', '.join(POINTS)})")
    return names


def synthetic_parts(turns: int, count: int = COUNT) -> dict:
    spec = {"count": count, "temperature": 1.0, **({"turns": turns} if turns > 1 else {})}
    return {f"synth-{i:03d}": {**spec, "seed": i} for i in range(8)}


def point_sets(name: str, epochs: int, turns: int, count: int = COUNT, extra: list[str] = ()) -> list[str]:
    """bench.gpu_profile setup's -S overrides of one point, then `extra`. A point declares only the synthetic
    parts it trains on (`dvc repro` makes every declared part): a part's stages are the same DVC stages,
    run-cached, whichever point runs them, as its command and params name only its own spec."""
    flow = lambda v: yaml.safe_dump(v, default_flow_style=True, width=10**6).strip()  # noqa: E731
    synthetic = {k: v for k, v in synthetic_parts(turns, count).items() if k in POINTS[name]}
    return [
        f"data.parts={flow(POINTS[name])}",
        f"data.synthetic={flow(synthetic)}",
        f"train.epochs={epochs}",
        "evaluate.trees=[]",
        "evaluate.speed_questions=1",
        "evaluate.min_tau=null",
        *extra,
    ]


def rates(results: Path) -> dict:
    """Seconds per unit of work on one lent GPU (H200 or H100). Training's, and the fixed stages', from
    the finished curve point that trained on the most tokens (tok/s differed between points at the same
    tokens a step: 121k ShareGPT alone, 185k + 1x); each per-part stage's from the <stage>@<part> runs
    that ran (not restored from the run-cache) in that point, else in the next most trained one that
    ran some. Before any point, from the committed GPU profile run."""
    found = {f: json.loads(f.read_text()) for f in (results / "gpu_curve").glob("*/gpu_profile.json")}
    if not found and (results / "gpu_profile.json").exists():
        found = {results / "gpu_profile.json": json.loads((results / "gpu_profile.json").read_text())}
    if not found:
        sys.exit(f"{results}: no GPU run to take stage times from")
    order = sorted(found, key=lambda f: found[f]["train_tokens"] * found[f]["train"]["epochs"], reverse=True)
    r = found[order[0]]
    w = r["wall_s"]

    def ran(stage: str) -> list[tuple[float, int]]:
        """(seconds, the part's tokens) of each <stage>@<part> run in the most trained point that ran any;
        tokens 0 for a part it did not pack (points before cb33eba decoded parts they did not train on)"""
        for rep in map(found.get, order):
            toks = {k: v["tokens"] for k, v in rep["pack"]["parts"].items()}
            runs = rep.get("wall_s_per_stage", {}).items()
            if got := [(s, toks.get(k.partition("@")[2], 0)) for k, s in runs if k.startswith(f"{stage}@")]:
                return got
        return []

    def per_token(stage: str) -> float:
        got = [(s, n) for s, n in ran(stage) if n]
        return sum(s for s, _ in got) / sum(n for _, n in got) if got else 60.0 / r["tokenized_tokens"]

    prompts = [s for s, _ in ran("synthetic")]
    return {
        "source": str(order[0]),
        "train_tok_s": r["train_tokens"] * r["train"]["epochs"] / w["train"],
        **{f"{k}_s_tok": per_token(k) for k in ("generate", "tokenize", "extract", "teacher")},  # s per token
        "prompts_s": sum(prompts) / len(prompts) if prompts else 80.0,  # one part's prompts
        "fixed_s": w["target"] + w["pack"] + w["evaluate"] + 60,  # + a point's setup and DVC
        "part_tokens": {k: v["tokens"] for k, v in r["pack"]["parts"].items()},
        "store_b_tok": r["pack"]["store_bytes"] / r["tokenized_tokens"],  # the stores' bytes per token
        "disk_free_gb": r["disk_after_stage"]["start"]["free_gb"],  # a GPU host's disk before the point
    }


def plan(epochs: int, points: list[str], saved: Path, machine_s: float, results: Path) -> None:
    """The points not yet finished, in `run`'s order, packed onto fresh machines of `machine_s` run-seconds.
    A machine extracts each part it uses once; a part's text (prompts, answers) and tokens are made once
    over all machines (the saved run-cache), and its teacher too where its store comes out the same. A
    point longer than a machine trains on over the next ones from its checkpoint (save carries it),
    each of them extracting the point's states again."""
    rt = rates(results)
    commands, found, carried = rc.contents(saved, ["generate"], [RUNNING, gp.TIMES])
    gen = found["generate"]
    going = carried.get(RUNNING, b"").decode()  # the point stopped inside training (its checkpoint saved)
    trained = json.loads(carried[gp.TIMES]).get("train", 0.0) if going and gp.TIMES in carried else 0.0
    done = set()
    if points_file := points_tgz(saved):
        with tarfile.open(points_file) as tar:
            done = {n.split("/")[0] for n in tar.getnames()}
    done |= {p.parent.name for p in (results / "gpu_curve").glob("*/gpu_profile.json")}
    synth = [g["prompt_tokens"] + g["generated_tokens"] for p, g in gen.items() if p.startswith("synth")]
    synth_tokens = sum(synth) / len(synth) if synth else SYNTH_PART_TOKENS  # tokens of one synthetic part

    def tokens(part):
        return rt["part_tokens"].get(part) or (
            gen[part]["prompt_tokens"] + gen[part]["generated_tokens"] if part in gen else synth_tokens
        )

    have = {stage: set() for stage in ("synthetic", "generate", "tokenize", "teacher")}
    for cmd in commands:  # "python -m stages.<stage> <part> ..."
        stage, part = cmd.split()[2].removeprefix("stages."), cmd.split()[3]
        have[stage].add(part)
    print(
        f"rates from {rt['source']}: train {rt['train_tok_s'] / 1e3:.0f}k tok/s; a part's states per M tokens: "
        f"tokenize {rt['tokenize_s_tok'] * 1e6:.1f} s, extract {rt['extract_s_tok'] * 1e6:.1f} s, teacher "
        f"{rt['teacher_s_tok'] * 1e6:.1f} s; saved: " + ", ".join(f"{k} {len(v)}" for k, v in have.items())
    )

    def cost(parts, on_machine, saved=have):
        """(seconds of the point before training on a machine holding on_machine's stores, of which
        before any extraction)"""
        text = states = 0.0
        for part in set(parts) - on_machine:
            n = tokens(part)
            text += rt["prompts_s"] * (part.startswith("synth") and part not in saved["synthetic"])
            text += n * rt["generate_s_tok"] * (part not in saved["generate"])
            text += n * rt["tokenize_s_tok"] * (part not in saved["tokenize"])
            states += n * rt["extract_s_tok"] + n * rt["teacher_s_tok"] * (part not in saved["teacher"])
        return rt["fixed_s"] + text + states, text

    def unsure(parts):  # teacher runs restored only where the store comes out byte for byte the same
        return sum(tokens(p) * rt["teacher_s_tok"] for p in set(parts) if p in have["teacher"])

    machine, used, on_machine, extra, todo = 1, 0.0, set(), 0.0, 0
    for name in points:
        parts, lab = POINTS[name], label(name, epochs)
        if lab in done:
            print(f"{lab:12s} done")
            continue
        todo += 1
        pre, text = cost(parts, on_machine)
        train = epochs * sum(map(tokens, parts)) / rt["train_tok_s"]
        alone = cost(parts, set(), {stage: () for stage in have})[0] + train  # on a machine, with no saved set
        if lab == going:  # its checkpoint goes on: the training time it had is not spent again
            train, pre = max(0.0, train - trained), pre + CKPT_S
        if used and used + pre + train > machine_s:  # a fresh machine; this one's last minutes make the texts
            if machine_s - used >= text:
                for stage in ("synthetic", "generate", "tokenize"):
                    have[stage] |= set(parts)
            machine, used, on_machine = machine + 1, 0.0, set()
            pre, _ = cost(parts, on_machine)
        extra += unsure(set(parts) - on_machine)
        first, total = machine, pre + train
        for stage in have.values():
            stage |= set(parts)
        while used + pre + train > machine_s and machine_s - used - pre - CKPT_S > 60:  # trains on next machine
            train -= machine_s - used - pre - CKPT_S
            machine, used = machine + 1, 0.0
            pre = cost(parts, set())[0] + CKPT_S  # its stores extracted again, the checkpoint loaded
            extra += unsure(parts)
            total += CKPT_S + pre  # the checkpoint saved there, and this machine's own start of the point
        used += pre + train
        on_machine = set(parts) if machine > first else on_machine | set(parts)
        where = f"machine {first}" + (f"-{machine}" if machine > first else "")
        warn = "  (over one machine: it cannot finish)" if used > machine_s else ""
        toks = sum(map(tokens, parts)) / 1e6
        fits = "fits" if alone <= machine_s else "does not fit"
        disk = toks * rt["store_b_tok"] / 1e3
        print(
            f"{lab:12s} {where:12s} ~{toks:5.1f}M tokens x {epochs} epochs  ~{total / 60:4.1f} min{warn}; "
            f"from nothing saved ~{alone / 60:4.1f} min ({fits} one machine); stores ~{disk:.0f} GB of the "
            f"~{rt['disk_free_gb']:.0f} GB a machine has free"
            + (" (over it: the point cannot run on one machine's disk)" if disk > rt["disk_free_gb"] else "")
            + (f"; goes on from its saved checkpoint, {trained / 60:.1f} min trained" if lab == going else "")
        )
    if not todo:
        print("every point asked for is done: no machine needed")
        return
    print(
        f"{machine} machine(s) of ~30 minutes each (start, carried packages and save included), counting "
        f"teacher@<part> restored from the saved run where the part has one; where a store does not come "
        f"out byte for byte the same, teacher runs again: +{extra / 60:.1f} min over all machines. A "
        f"session's device time (30 min) starts one machine, and the saved set lasts as long as this "
        f"checkout: a point that fits no machine from nothing saved needs machines of one checkout"
    )


def points_tgz(src: Path) -> Path | None:
    """save's points.tgz as returned (src/) or as collected (src/1/)."""
    return next((p for p in (src / "points.tgz", src / "1" / "points.tgz") if p.exists()), None)


def finished(work: Path) -> set[str]:
    return {p.parent.name for p in (work / CURVE).glob("*/gpu_profile.json")}


def run(
    work: Path, budget: float, epochs: int, turns: int, count: int, profile: str, extra: list[str], points: list[str]
) -> None:
    t0 = time.time()
    for name in points:
        lab = label(name, epochs)
        if lab in finished(work):
            print(f"== {lab}: done before")
            continue
        left = budget - (time.time() - t0)
        if left < 180:
            print(f"budget spent; next point: {lab}")
            return
        print(f"== point {lab}: {', '.join(POINTS[name])}, {epochs} epochs", flush=True)
        gp.setup(work, profile, point_sets(name, epochs, turns, count, extra))
        running = work / RUNNING
        if running.exists() and running.read_text() == lab:  # begun before, here or on an earlier machine
            ckpts = ", ".join(p.name for p in (work / CKPT).glob("last-*.pt")) or "none"
            print(f"{lab} goes on: its stage times so far are kept; training checkpoint(s) here: {ckpts}")
        else:  # this point's own stage times (stages restored or skipped: none)
            (work / gp.TIMES).parent.mkdir(parents=True, exist_ok=True)
            (work / gp.TIMES).write_text("{}")
            running.parent.mkdir(parents=True, exist_ok=True)
            running.write_text(lab)
        if not gp.run(work, left, 60):
            print(f"budget spent inside point {lab}; it carries on next call (save carries its checkpoint)")
            return
        gp.report(work, work / CURVE / lab)
        for ck in (work / CKPT).glob("last-*.pt"):  # done with: what `save` finds is an unfinished point's
            ck.unlink()
        (work / RUNNING).unlink(missing_ok=True)
    print("curve: all points done")


def save(work: Path, out: Path) -> None:
    """The saved stages' run-cache (bench/runcache_carry.py) and the finished points into out, at most
    one call's bytes; a set too big for one call goes on in the next call's `save`."""
    if pid := gp.running_pid(work):
        sys.exit(f"a run is going (pid {pid}): its checkpoint may change under save; `stop` it first")
    staging = work / "bench" / "out" / "saved"
    ckpts = sorted((work / CKPT).glob("last-*.pt"))  # an unfinished point's (a finished one's are removed)
    stopped_in_train = ckpts and (work / RUNNING).exists()
    going_on = [f for f in (*ckpts, work / gp.TIMES, work / RUNNING) if f.exists()] if stopped_in_train else []
    manifest = rc.pack(work / ".dvc" / "cache", SAVED_STAGES, staging, {str(f.relative_to(work)): f for f in going_on})
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / "points.tgz", "w:gz") as tar:
        for name in sorted(finished(work)):
            tar.add(work / CURVE / name, arcname=name)
    left = rc.send(staging, out, CALL_BYTES - (out / "points.tgz").stat().st_size)
    print(
        f"{out}: {manifest['runs']} stage runs in {len(manifest['chunks'])} chunk(s), "
        f"{len(manifest['chunks']) - len(left)} sent so far; points {sorted(finished(work))}"
        + (f"; {(work / RUNNING).read_text()} goes on from {ckpts[0].name}" if going_on else "")
        + (f"; {len(left)} chunk(s) left: call save again" if left else "")
    )


def load(work: Path, src: Path) -> None:
    """One carried folder (collect's src/N): its chunks kept on this machine until the set is whole,
    then into the work repo's DVC cache; points done from its points.tgz."""
    if not work.exists():
        gp.setup(work, "gpu", [])
    have, total = rc.receive(src, STASH)
    if (src / "points.tgz").exists():
        with tarfile.open(src / "points.tgz") as tar:
            tar.extractall(work / CURVE, filter="data")
    runs = rc.unpack(STASH, work / ".dvc" / "cache", root=work)
    state = f"{runs} stage runs restored into the DVC cache" if runs is not None else f"{have} of {total} chunks here"
    if runs is not None and (work / RUNNING).exists():
        state += f"; {(work / RUNNING).read_text()} goes on from its checkpoint"
    print(f"{work}: {state}; points done: {sorted(finished(work))}")


def by_category(questions: Path) -> dict | None:
    """τ at k = 3 per MT-bench category from evaluate's per-question figures: each question weighted by
    its verifications, taken as its tokens / τ (the prompt's own token and a cut last round aside)."""
    if not questions.exists():
        return None
    tokens, rounds = {}, {}
    for q in json.loads(questions.read_text()):
        if q.get("tau_k3"):
            tokens[q["category"]] = tokens.get(q["category"], 0) + q["tokens"]
            rounds[q["category"]] = rounds.get(q["category"], 0) + q["tokens"] / q["tau_k3"]
    return {c: round(tokens[c] / rounds[c], 3) for c in tokens}


def table(src: Path, results: Path) -> None:
    """The points' reports into <results>/gpu_curve/<point>/, the synthetic parts' filter counts (from the
    saved run-cache) into <results>/gpu_curve/synthetic/, and <results>/gpu_profile.json's synthetic_curve."""
    dst = results / "gpu_curve"
    if points := points_tgz(src):
        with tarfile.open(points) as tar:
            tar.extractall(dst, filter="data")
    elif src.resolve() != dst.resolve():
        shutil.copytree(src, dst, dirs_exist_ok=True)
    for part, rep in rc.contents(src, ["synthetic"])[1]["synthetic"].items():
        (dst / "synthetic").mkdir(parents=True, exist_ok=True)
        (dst / "synthetic" / f"{part}.json").write_text(json.dumps(rep, indent=1) + "\n")
    filters = {f.stem: json.loads(f.read_text()) for f in (dst / "synthetic").glob("*.json")}
    rows = []
    for f in sorted(dst.glob("*/gpu_profile.json"), key=lambda f: (list(POINTS).index(point_of(f.parent.name)), f)):
        r = json.loads(f.read_text())
        parts = POINTS[point_of(f.parent.name)]
        rows.append(
            {
                "point": f.parent.name,  # <point>, or <point>-<epochs>ep at other epochs than the curve's
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
                "tau_k3_by_category": by_category(f.parent / "evaluate_questions.json"),
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
        x.add_argument(
            "--epochs",
            type=int,
            default=EPOCHS,
            help="every point's epochs (the profile's: 13); other than "
            f"{EPOCHS}, a point is reported as <point>-<epochs>ep",
        )
        x.add_argument("--turns", type=int, default=1, help="user turns per synthetic conversation")
        x.add_argument(
            "--points",
            type=points_arg,
            default=CURVE_POINTS,
            help=f"comma-separated, of {', '.join(POINTS)} (default: {', '.join(CURVE_POINTS)})",
        )
    r.add_argument("--budget", type=float, default=1700)
    r.add_argument("--count", type=int, default=COUNT, help="conversations per synthetic part (1x)")
    r.add_argument("--profile", default="gpu", help="profiles/<name>.yaml under the points' keys")
    r.add_argument("-S", dest="sets", action="append", default=[], help="section.key=yaml, after the point's")
    r.add_argument("--detach", action="store_true", help="in the background, outliving this call; then `wait`")
    w = sub.add_parser("wait")
    w.add_argument("--budget", type=float, default=560)
    sub.add_parser("stop", help="stop a detached run as its budget would (training saves a checkpoint)")
    s = sub.add_parser("save")
    s.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out/curve_saved")))
    ld = sub.add_parser("load")
    ld.add_argument("src", type=Path)
    c = sub.add_parser("collect")
    c.add_argument("src", type=Path, help="a bounded command's returned files (save's --out)")
    c.add_argument("--into", type=Path, default=gp.REPO / ".carry" / "curve")
    t = sub.add_parser("table")
    t.add_argument("src", type=Path)
    t.add_argument("--results", type=Path, default=gp.REPO / "bench" / "results")
    p.add_argument("--saved", type=Path, default=gp.REPO / ".carry" / "curve", help="what `save` brought back")
    p.add_argument("--machine-min", type=float, default=24, help="run-minutes of one GPU host job")
    p.add_argument("--results", type=Path, default=gp.REPO / "bench" / "results")
    a = ap.parse_args()
    if a.cmd == "plan":
        plan(a.epochs, a.points, a.saved, a.machine_min * 60, a.results)
    elif a.cmd == "run" and a.detach:
        args = [f"--{k}={getattr(a, k)}" for k in ("budget", "epochs", "turns", "count", "profile")]
        args.append(f"--points={','.join(a.points)}")
        gp.detach(a.workdir, [*args, *(f"-S{x}" for x in a.sets)], module="bench.gpu_curve")
    elif a.cmd == "run":
        run(a.workdir, a.budget, a.epochs, a.turns, a.count, a.profile, a.sets, a.points)
    elif a.cmd == "wait":
        gp.wait(a.workdir, a.budget, done=("curve: all points done", "budget spent"))
    elif a.cmd == "stop":
        gp.stop(a.workdir)
    elif a.cmd == "save":
        save(a.workdir, a.out)
    elif a.cmd == "load":
        load(a.workdir, a.src)
    elif a.cmd == "collect":
        rc.collect(a.src, a.into, CARRY_BYTES)
    else:
        table(a.src, a.results)


if __name__ == "__main__":
    main()
