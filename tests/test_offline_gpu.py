"""tools/offline_gpu: the runner for GPU hosts without internet under a job time limit.

- `stop` (SIGTERM to a detached run) reaches the stage running in DVC's own process session, as the
  budget does, so a training stage saves its checkpoint and no stage outlives its runner.
- A stage run's DVC run-cache entry, a directory output included, carried to a fresh repository in
  chunks over several commands, restores the stage there ("is cached") with the same outputs; a
  damaged or incomplete set restores nothing; a newer set replaces an older one only once it is
  whole; a checkpoint travels with it and arrives whole."""

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.offline_gpu import __main__ as cli
from tools.offline_gpu import bundle, carry, runner

from .conftest import REPO, ran, sh

STAGE = """import signal, sys, time
def stop(signum, frame):  # as stages.train: finish the step, save a checkpoint, exit non-zero
    open("checkpoint.txt", "w").write(signal.Signals(signum).name)
    sys.exit(1)
signal.signal(signal.SIGINT, stop)
open("started.txt", "w").write("yes")
time.sleep(600)
"""


def test_setup_applies_the_profile_and_runs_again_over_its_own_records(tmp_path, monkeypatch):
    """Each command on the host starts with `setup` again: the second one, over the first one's work
    repo and records, commits the same profile and overrides (the runner's records stay out of git)."""
    code = tmp_path / "checkout"
    code.mkdir()
    for name in (".gitignore", "params.yaml", "dvc.yaml"):
        shutil.copy2(REPO / name, code / name)
    shutil.copytree(REPO / "profiles", code / "profiles")
    for d in ("data", "metrics", "reports", ".dvc"):  # a checkout before its first `dvc repro`
        (code / d).mkdir()
    shutil.copy2(REPO / ".dvc" / "config", code / ".dvc" / "config")
    monkeypatch.setattr(runner, "REPO", code)
    work = tmp_path / "work"
    for _ in range(2):
        runner.setup(work, "gpu", ["train.topk=10"])
    import yaml

    params = yaml.safe_load((work / "params.yaml").read_text())
    assert params["train"]["topk"] == 10 and params["generate"]["enabled"] is True  # -S, and the gpu profile
    assert (work / runner.STATE / "set.yaml").exists()
    tracked = subprocess.run(["git", "ls-files"], cwd=work, capture_output=True, text=True, check=True).stdout
    assert "params.yaml" in tracked.split() and runner.STATE not in tracked
    assert subprocess.run(["git", "status", "--porcelain"], cwd=work, capture_output=True, text=True).stdout == ""


def test_stop_interrupts_the_stage_in_dvc_and_the_run_exits(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "stop_test_stage.py").write_text(STAGE)
    (work / "dvc.yaml").write_text(
        "stages:\n  train:\n    cmd: python stop_test_stage.py\n    deps: [stop_test_stage.py]\n    outs: [out]\n"
    )
    sh("git init -q && dvc init -q", work)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    with open(tmp_path / "run.log", "w") as log:  # as `run --detach` starts it: a session of its own
        p = subprocess.Popen(
            [sys.executable, "-m", "tools.offline_gpu", "--workdir", str(work), "run", "--budget", "600"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        (work / runner.RUN_PID).parent.mkdir(parents=True, exist_ok=True)
        (work / runner.RUN_PID).write_text(str(p.pid))
        for _ in range(120):
            if (work / "started.txt").exists():
                break
            time.sleep(0.5)
        assert (work / "started.txt").exists(), (tmp_path / "run.log").read_text()
        runner.stop(work)
        assert p.wait(5) == 3  # the runner returned unfinished (the stage resumes next call), no traceback
        assert (work / "checkpoint.txt").read_text() == "SIGINT"  # the stage saw the interrupt
        log = (tmp_path / "run.log").read_text()
        assert "stopped train on signal SIGTERM" in log, log
        assert "train" in runner.record(work, runner.TIMES)  # its time so far is kept
        left = subprocess.run(["pgrep", "-f", "python stop_test_stage.py"], capture_output=True, text=True).stdout
        assert not left.strip(), f"the stage outlived its runner: {left}"
        assert runner.running_pid(work) is None
    finally:  # nothing, unless an assert failed: no stage outlives the test
        subprocess.run(["pkill", "-f", "python stop_test_stage.py"])
        p.kill()


MAKE = """import os, random
random.seed(open("input.txt").read())
os.makedirs("outdir", exist_ok=True)
for name in ("a.bin", "b.bin"):
    open(f"outdir/{name}", "wb").write(random.randbytes(150_000))
open("out.txt", "w").write("made from " + open("input.txt").read())
"""
DVC_YAML = """stages:
  make:
    cmd: python make.py
    deps: [make.py, input.txt]
    outs: [out.txt, outdir]
  count:
    cmd: python -c "print(len(open('out.txt').read()))" > count.txt
    deps: [out.txt]
    outs: [count.txt]
"""


def project(root: Path, text: str) -> Path:
    root.mkdir()
    (root / "make.py").write_text(MAKE)
    (root / "input.txt").write_text(text)
    (root / "dvc.yaml").write_text(DVC_YAML)
    sh("git init -q && dvc init -q && dvc config core.autostage false", root)
    return root


def carried(src_cache: Path, tmp: Path, tag: str, extra=None, calls: int | None = None) -> Path:
    """save, then send/collect in commands of 250 kB (chunks of 100 kB) until nothing is left (or,
    given `calls`, after that many: a session cut short)."""
    carry.save(src_cache, ("python make.py",), tmp / f"staging-{tag}", extra)
    for call in range(1, (calls or 20) + 1):
        out = tmp / f"out-{tag}-{call}"
        shutil.rmtree(out, ignore_errors=True)  # a command's $OUT starts empty
        left = bundle.send("runcache", tmp / f"staging-{tag}", out, 250_000)
        bundle.collect("runcache", out, tmp / "carry", 250_000)
        if not left:
            return tmp / "carry"
    assert calls, "send never finished"
    return tmp / "carry"


@pytest.fixture
def made(tmp_path, monkeypatch):
    monkeypatch.setattr(bundle, "CHUNK", 100_000)
    a = project(tmp_path / "a", "one")
    sh("dvc repro -q", a)
    return a


def test_a_carried_run_restores_the_stage_on_a_fresh_repository(made, tmp_path):
    folders = sorted(carried(made / ".dvc" / "cache", tmp_path, "1").iterdir())
    assert len(folders) >= 2  # the set spans several carried folders
    b, stash = project(tmp_path / "b", "one"), tmp_path / "stash"
    for i, d in enumerate(folders):
        bundle.receive(d, stash)
        runs = carry.load(stash, b / ".dvc" / "cache")
        assert (runs is None) == (i < len(folders) - 1)  # nothing goes into the cache until the set is whole
    assert runs == 1  # `count` was not asked for
    out = sh("dvc repro", b).stdout
    assert "Stage 'make' is cached" in out and ran(out) == {"count"}
    for f in ("out.txt", "outdir/a.bin", "outdir/b.bin", "count.txt"):
        assert (b / f).read_bytes() == (made / f).read_bytes(), f


def test_a_damaged_or_other_input_restores_nothing(made, tmp_path):
    chunk = sorted(carried(made / ".dvc" / "cache", tmp_path, "1").glob("*/runcache.tgz.*"))[1]
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF
    chunk.write_bytes(bytes(data))
    stash, b = tmp_path / "stash", project(tmp_path / "b", "one")
    for d in sorted((tmp_path / "carry").iterdir()):
        bundle.receive(d, stash)
    with pytest.raises(SystemExit, match="sha256"):
        carry.load(stash, b / ".dvc" / "cache")
    assert not (b / ".dvc" / "cache" / "runs").exists()
    assert not list(stash.glob(".runcache*"))  # no half-joined file left

    # another input: the carried run does not match, so DVC runs the stage
    shutil.rmtree(tmp_path / "carry")
    shutil.rmtree(stash)
    for d in sorted(carried(made / ".dvc" / "cache", tmp_path, "2").iterdir()):
        bundle.receive(d, stash)
    c = project(tmp_path / "c", "two")
    assert carry.load(stash, c / ".dvc" / "cache") == 1
    assert ran(sh("dvc repro", c).stdout) == {"make", "count"}


def test_a_new_set_replaces_the_old_one_only_once_it_is_whole(made, tmp_path):
    carried(made / ".dvc" / "cache", tmp_path, "1")
    old = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "carry").rglob("*") if p.is_file()}
    (made / "input.txt").write_text("three")
    sh("dvc repro -q", made)  # a second run of `make`: a new set with both runs
    into = carried(made / ".dvc" / "cache", tmp_path, "2", calls=1)  # a session cut after one save command
    assert (into / "next").is_dir()
    now = {p.relative_to(tmp_path): p.read_bytes() for p in into.glob("[0-9]*/*")}
    assert now == old  # the older whole set is untouched, and still restores
    assert carry.commands(into) == ["python make.py"]
    into = carried(made / ".dvc" / "cache", tmp_path, "2")  # the next command's save goes on with the set
    assert not (into / "next").exists()
    assert carry.commands(into) == ["python make.py"] * 2
    assert len({(d / "runcache.json").read_text() for d in into.iterdir()}) == 1  # no chunk of the old set


def test_a_checkpoint_travels_with_the_set_through_the_command_line(made, tmp_path, monkeypatch):
    """`save` on one host's work repo (a run stopped inside training: its checkpoint and stage times),
    `collect` here, `receive` and `load` on the next host's: both arrive whole."""
    monkeypatch.setattr(cli, "CALL_BYTES", 250_000)
    monkeypatch.setattr(cli, "STASH", tmp_path / "stash")
    ckpt = made / cli.CKPT / "last-0123456789abcdef.pt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(random.randbytes(300_000))
    runner.add_time(made, "train", 600.0)
    args = ["--workdir", str(made)]
    for call in range(1, 10):
        cli.main([*args, "save", "--out", str(tmp_path / f"out-{call}"), "--stages", "python make.py"])
        cli.main(["collect", str(tmp_path / f"out-{call}"), "--into", str(tmp_path / "carry")])
        m = bundle.manifest("runcache", made / runner.STATE / "saved")
        if set(m["sent"]) == set(m["chunks"]):
            break
    assert len(m["chunks"]) >= 3
    b = project(tmp_path / "b", "one")
    for d in sorted((tmp_path / "carry").glob("[0-9]*")):
        cli.main(["receive", str(d)])
    cli.main(["--workdir", str(b), "load"])
    for f in (ckpt.relative_to(made), Path(runner.TIMES)):
        assert (b / f).read_bytes() == (made / f).read_bytes(), f
    assert not (b / ".dvc" / "cache" / "extra").exists() and not list(b.rglob("*.tmp"))
    assert "Stage 'make' is cached" in sh("dvc repro", b).stdout

    first = m["sha256"]
    ckpt.write_bytes(random.randbytes(300_000))  # the checkpoint moved on: the same name, a new set
    cli.main([*args, "save", "--out", str(tmp_path / "out-new"), "--stages", "python make.py"])
    assert json.loads((tmp_path / "out-new" / "runcache.json").read_text())["sha256"] != first


def test_wheels_carried_in_chunks_install_without_an_index(tmp_path, monkeypatch):
    """The wheels go the same way as the run-cache: a set in chunks, received folder by folder,
    installed by pip (no index) only once whole."""
    import zipfile

    monkeypatch.setattr(bundle, "CHUNK", 40_000)
    monkeypatch.setattr(carry, "SITE", tmp_path / "site")
    monkeypatch.setattr(carry, "BIN", tmp_path / "bin")
    whl = tmp_path / "dl" / "carried_pkg-0.1-py3-none-any.whl"
    whl.parent.mkdir()
    info = "carried_pkg-0.1.dist-info"
    files = {
        "carried_pkg.py": f"BLOB = {random.randbytes(60_000)!r}\n",  # larger than a chunk
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: carried-pkg\nVersion: 0.1\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{n},,\n" for n in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(whl, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    bundle.pack("wheels", [(whl, f"wheels/{whl.name}")], tmp_path / "staging")
    folders = bundle.collect("wheels", tmp_path / "staging", tmp_path / "carry", 50_000)
    assert len(folders) >= 2
    stash = tmp_path / "stash"
    bundle.receive(folders[0], stash)
    with pytest.raises(SystemExit, match="not every chunk"):
        carry.install(stash)
    assert not (tmp_path / "site").exists()
    for d in folders[1:]:
        bundle.receive(d, stash)
    carry.install(stash)
    code = "import carried_pkg; print(len(carried_pkg.BLOB))"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    p = subprocess.run([str(tmp_path / "bin" / "python"), "-c", code], env=env, capture_output=True, text=True)
    assert p.stdout.strip() == "60000", p.stderr


def test_recipe_options_combine_and_a_bad_one_is_named_before_anything_runs(tmp_path):
    from bench.recipe import OPTIONS, option_name, option_sets

    assert option_sets("topk+decay9") == OPTIONS["topk"] + OPTIONS["decay9"]
    assert option_name("topk+decay9") == "topk+decay9"
    assert option_sets("today:train.topk=0,train.decay=0.8") == ["train.topk=0", "train.decay=0.8"]
    assert option_name("today:train.topk=0") == "today"
    for bad, named in (("topk+nope", "no option nope"), ("mine:train.topk", "LABEL:KEY=VALUE")):
        out = subprocess.run([sys.executable, "-m", "bench.recipe", "--workdir", str(tmp_path / "w"), "--options", bad],
                             cwd=REPO, capture_output=True, text=True)  # fmt: skip
        assert out.returncode == 2 and named in out.stderr, out.stderr
        assert not (tmp_path / "w").exists()  # nothing was set up


def test_a_later_screen_on_the_same_baseline_adds_its_options_and_a_new_baseline_gets_its_own_entry():
    from bench.recipe import add_screen

    base = {"tau": {"3": 1.5777}, "lossless": {"3": "80/80"}}
    first = {"date": "d1", "runs": {"baseline": base, "topk": {"tau": {"3": 1.5886}}}}
    results = {"default": {"runs": {"baseline": {"tau": {"3": 1.2}}}}}
    assert add_screen(results, "gpu", first) == "gpu"
    later = {"date": "d2", "runs": {"baseline": dict(base), "seed1": {"tau": {"3": 1.5774}}}}
    assert add_screen(results, "gpu", later) == "gpu"
    assert list(results["gpu"]["runs"]) == ["baseline", "topk", "seed1"] and results["gpu"]["date"] == "d2"
    # options of another baseline's run would not compare with the first run's: an entry of their own
    rerun = {"date": "d3", "runs": {"baseline": {**base, "tau": {"3": 1.6}}, "long": {"tau": {"3": 1.7}}}}
    assert add_screen(results, "gpu", rerun) == "gpu #2"
    assert results["gpu #2"] == rerun and list(results["gpu"]["runs"]) == ["baseline", "topk", "seed1"]
    again = {"date": "d4", "runs": {"baseline": rerun["runs"]["baseline"], "lr2": {"tau": {"3": 1.65}}}}
    assert add_screen(results, "gpu", again) == "gpu #2"
    assert list(results["gpu #2"]["runs"]) == ["baseline", "long", "lr2"]
    assert add_screen(results, "gpu train.epochs=4", first) == "gpu train.epochs=4"  # another key's prefix


TRAIN_LINE = """import sys, yaml
a = yaml.safe_load(open("params.yaml"))["a"]
open("out.txt", "w").write(str(a))
print("12:00:00 INFO eaglenest.train: trained 3 epochs: %s tokens/s over %s s" % (1000.0 * a, 10 * a), file=sys.stderr)
"""


def test_each_queued_experiment_reports_its_own_training_speed(tmp_path, monkeypatch):
    """An experiment's reports/timing stays in its temporary workspace: its speed comes from its own log."""
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    (tmp_path / "train.py").write_text(TRAIN_LINE)
    (tmp_path / "params.yaml").write_text("a: 1\n")
    (tmp_path / "dvc.yaml").write_text(
        "stages:\n  train:\n    cmd: python train.py\n    deps: [train.py]\n    params: [a]\n    outs: [out.txt]\n"
    )
    sh("git init -q && dvc init -q && git add -A && git commit -qm base", tmp_path)
    for name, a in (("topk+decay9", 2), ("today", 3)):
        sh(f"dvc exp run --queue -n '{name}' -S a={a}", tmp_path)
    sh("dvc queue start -j 1", tmp_path)
    for _ in range(240):
        if sorted(runner.queue_status(tmp_path).values()) == ["Success", "Success"]:
            break
        time.sleep(0.5)
    assert runner.train_speed(tmp_path, "topk+decay9") == {"tokens_per_s": 2000.0, "wall_s": 20.0}
    assert runner.train_speed(tmp_path, "today") == {"tokens_per_s": 3000.0, "wall_s": 30.0}
    assert runner.train_speed(tmp_path, "never-queued") == {}


def test_the_screen_reads_each_epochs_val_figures_as_the_train_stage_logged_them(tmp_path):
    """Where a short screen's run was heading: the per-epoch val curve, read back from DVCLive's plots."""
    from stages.train import log_epochs

    val = [(5.79, 1.1877), (4.9, 1.2956), (4.679, 1.3388)]
    epochs = [{s: {"loss": loss, "simulated_tau": tau, "acc_per_step": [0.2]} for s in ("train", "val")}
              for loss, tau in val]  # fmt: skip
    log_epochs(epochs, tmp_path / "dvclive")
    assert runner.epoch_curve(tmp_path) == {"loss": [v[0] for v in val], "simulated_tau": [v[1] for v in val]}
    assert runner.epoch_curve(tmp_path / "none") == {}  # a run that never trained
