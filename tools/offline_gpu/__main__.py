"""python -m tools.offline_gpu: the pipeline on a GPU host without internet, under a job time limit
(tools/offline_gpu/README.md). Here (with internet) and there (the host), in that order:

  here   wheels [--out .carry/wheels]        the packages and data wheels, in carried folders 1, 2, ...
  there  receive DIR                         one carried folder into the stash (~/stash), once per folder
  there  install                             the wheels into /tmp/site; prints the environment to export
  there  setup [--profile gpu] [-S k=v ...]  this checkout's code into the work repo, profile applied
  there  load                                a received run-cache set into the work repo (before `run`)
  there  run [--budget S] [--until STAGE] [--detach]
                                             `dvc repro` stage by stage until the budget (exit 3: again to go on)
  there  wait [--budget S] | stop            follow a detached run (exit 3: still running) | stop it
  there  enqueue NAME -S k=v ... ; queue [--jobs N] [--budget S]
                                             DVC experiments from the profile, run side by side
  there  report [--out $OUT]                 the run's figures: gpu_profile.json and the stage reports
  there  save --out $OUT [--stages ...]      the run-cache (and the training checkpoint) in chunks;
                                             again in the next command until nothing is left
  here   collect SRC [--into .carry/runcache]  a command's returned chunks into carried folders

Each command there starts with `setup` again where code changed here: the work repo's lock, cache
and data stay while the host is up."""

import argparse
import os
import sys
from pathlib import Path

from tools.offline_gpu import carry, runner
from tools.offline_gpu.report import report

STASH = Path.home() / "stash"
CALL_BYTES = 58 * 2**20  # what one command carries or brings back, with room for its other files
SAVED_STAGES = ("python -m stages.synthetic", "python -m stages.generate", "python -m stages.tokenize",
                "python -m stages.sharegpt", "python -m stages.teacher")  # fmt: skip
CKPT = ".eaglenest/train"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.offline_gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--workdir", type=Path, default=Path.home() / "run", help="the work repo there (~/run)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wheels", help="here: download the wheels into carried folders")
    w.add_argument("--out", type=Path, default=Path(".carry/wheels"))
    w.add_argument("--python", default="3.12", help="the host image's Python")
    sub.add_parser("receive", help="there: a carried folder into the stash").add_argument("src", type=Path)
    sub.add_parser("install", help="there: the stashed wheels into /tmp/site")
    s = sub.add_parser("setup", help="there: the code into the work repo, a profile applied")
    s.add_argument("--profile", default="gpu", help="profiles/<name>.yaml, or default: params.yaml unchanged")
    s.add_argument("-S", dest="sets", action="append", default=[], help="section.key=yaml value, after the profile")
    r = sub.add_parser("run", help="there: `dvc repro` stage by stage until the budget")
    r.add_argument("--budget", type=float, default=540, help="seconds this command may take")
    r.add_argument("--min-left", type=float, default=60, help="start no stage with less than this left")
    r.add_argument("--until", help="the last stage to run (its @parts included), e.g. pack")
    r.add_argument("--detach", action="store_true", help="in the background, outliving this command; then `wait`")
    sub.add_parser("wait", help="there: follow a detached run").add_argument("--budget", type=float, default=560)
    sub.add_parser("stop", help="there: stop a detached run as its budget would")
    q = sub.add_parser("enqueue", help="there: queue an experiment (dvc exp run --queue) from the profile")
    q.add_argument("name")
    q.add_argument("-S", dest="sets", action="append", default=[], help="section.key=yaml value")
    qq = sub.add_parser("queue", help="there: run the queued experiments side by side")
    qq.add_argument("--jobs", type=int, default=2)
    qq.add_argument("--budget", type=float, default=540)
    o = sub.add_parser("report", help="there: the run's figures")
    o.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    o.add_argument("--with-drafter", action="store_true", help="also copy data/drafter (~45 MB)")
    sv = sub.add_parser("save", help="there: the run-cache and the checkpoint, chunks into --out")
    sv.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    sv.add_argument("--stages", nargs="*", default=list(SAVED_STAGES), help="commands whose runs are saved")
    c = sub.add_parser("collect", help="here: a command's returned chunks into carried folders")
    c.add_argument("src", type=Path)
    c.add_argument("--into", type=Path, default=Path(".carry/runcache"))
    sub.add_parser("load", help="there: the stashed run-cache set into the work repo")
    a = ap.parse_args(argv)
    work = a.workdir
    if a.cmd == "wheels":
        carry.wheels(a.out, a.python, CALL_BYTES)
    elif a.cmd == "receive":
        for name, (have, total) in carry.bundle.receive(a.src, STASH).items():
            print(f"{name}: {have} of {total} chunks in {STASH}")
    elif a.cmd == "install":
        carry.install(STASH)
    elif a.cmd == "setup":
        runner.setup(work, a.profile, a.sets)
    elif a.cmd == "run" and a.detach:
        runner.detach(work, ["--budget", str(a.budget), "--min-left", str(a.min_left),
                             *(["--until", a.until] if a.until else [])])  # fmt: skip
    elif a.cmd == "run" and not runner.run(work, a.budget, a.min_left, a.until):
        sys.exit(3)  # unfinished: run again to go on
    elif a.cmd == "wait":
        runner.wait(work, a.budget)
    elif a.cmd == "stop":
        runner.stop(work)
    elif a.cmd == "enqueue":
        runner.enqueue(work, a.name, a.sets)
    elif a.cmd == "queue":
        runner.run_queue(work, a.jobs, a.budget)
    elif a.cmd == "report":
        report(work, a.out, a.with_drafter)
    elif a.cmd == "save":
        extra = {str(p.relative_to(work)): p for p in (work / CKPT).glob("last-*.pt")}
        extra |= {runner.TIMES: work / runner.TIMES} if (work / runner.TIMES).exists() else {}
        staging = work / runner.STATE / "saved"
        m = carry.save(work / ".dvc" / "cache", tuple(a.stages), staging, extra)
        left = carry.bundle.send("runcache", staging, a.out, CALL_BYTES)
        print(f"runcache: {len(m['chunks'])} chunks, {len(left)} left to send" + ("; call save again" * bool(left)))
    elif a.cmd == "collect":
        carry.bundle.collect("runcache", a.src, a.into, CALL_BYTES)
    elif a.cmd == "load":
        runs = carry.load(STASH, work / ".dvc" / "cache", work)
        if runs is None:
            sys.exit(f"{STASH}: not every chunk of the run-cache set is there; `receive` each carried folder")
        print(f"{runs} stage runs restored into {work}/.dvc/cache")


if __name__ == "__main__":
    main()
