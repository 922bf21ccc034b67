"""bench/runcache_carry.py: a stage run's DVC run-cache entry, a directory output included, carried to
a fresh repository in chunks over several calls, restores the stage there ("is cached") with the same
outputs; a damaged or incomplete set restores nothing."""

import json
import random
import shutil
from pathlib import Path

import pytest

from bench import runcache_carry as rc

from .conftest import ran, sh

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


def carry(src_cache: Path, tmp: Path, tag: str, extra=None, calls: int | None = None) -> Path:
    """pack, then send/collect in calls of 250 kB (chunks of 100 kB) until nothing is left (or, given
    `calls`, after that many: a session cut short)."""
    rc.pack(src_cache, ("python make.py",), tmp / f"staging-{tag}", extra)
    for call in range(1, (calls or 20) + 1):
        out = tmp / f"out-{tag}-{call}"
        shutil.rmtree(out, ignore_errors=True)  # a call's $OUT starts empty
        out.mkdir()
        left = rc.send(tmp / f"staging-{tag}", out, 250_000)
        rc.collect(out, tmp / "carry", 250_000)
        if not left:
            return tmp / "carry"
    assert calls, "send never finished"
    return tmp / "carry"


@pytest.fixture
def made(tmp_path, monkeypatch):
    monkeypatch.setattr(rc, "CHUNK", 100_000)
    a = project(tmp_path / "a", "one")
    sh("dvc repro -q", a)
    return a


def test_a_carried_run_restores_the_stage_on_a_fresh_repository(made, tmp_path):
    folders = sorted(carry(made / ".dvc" / "cache", tmp_path, "1").iterdir())
    assert len(folders) >= 2  # the set spans several carried folders
    b = project(tmp_path / "b", "one")
    stash = tmp_path / "stash"
    for i, d in enumerate(folders):
        rc.receive(d, stash)
        runs = rc.unpack(stash, b / ".dvc" / "cache")
        assert (runs is None) == (i < len(folders) - 1)  # nothing goes into the cache until the set is whole
    assert runs == 1  # `count` was not asked for
    out = sh("dvc repro", b).stdout
    assert "Stage 'make' is cached" in out and ran(out) == {"count"}
    for f in ("out.txt", "outdir/a.bin", "outdir/b.bin", "count.txt"):
        assert (b / f).read_bytes() == (made / f).read_bytes(), f


def test_a_damaged_or_other_input_restores_nothing(made, tmp_path):
    carried = carry(made / ".dvc" / "cache", tmp_path, "1")
    chunk = sorted(carried.glob("*/runcache.tgz.*"))[1]
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF
    chunk.write_bytes(bytes(data))
    stash, b = tmp_path / "stash", project(tmp_path / "b", "one")
    for d in sorted(carried.iterdir()):
        rc.receive(d, stash)
    with pytest.raises(SystemExit, match="sha256"):
        rc.unpack(stash, b / ".dvc" / "cache")
    assert not (b / ".dvc" / "cache" / "runs").exists()
    assert not list(stash.glob(".runcache*"))  # no half-joined file left

    # another input: the carried run does not match, so DVC runs the stage
    shutil.rmtree(carried)
    shutil.rmtree(stash)
    for d in sorted(carry(made / ".dvc" / "cache", tmp_path, "2").iterdir()):
        rc.receive(d, stash)
    c = project(tmp_path / "c", "two")
    assert rc.unpack(stash, c / ".dvc" / "cache") == 1
    assert ran(sh("dvc repro", c).stdout) == {"make", "count"}


def test_a_new_set_replaces_the_old_one_only_once_it_is_whole(made, tmp_path):
    carry(made / ".dvc" / "cache", tmp_path, "1")
    old = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "carry").rglob("*") if p.is_file()}
    (made / "input.txt").write_text("three")
    sh("dvc repro -q", made)  # a second run of `make`: a new set with both runs
    carried = carry(made / ".dvc" / "cache", tmp_path, "2", calls=1)  # a session cut after one save call
    assert (carried / "next").is_dir()
    now = {p.relative_to(tmp_path): p.read_bytes() for p in carried.glob("[0-9]*/*")}
    assert now == old  # the older whole set is untouched, and still restores
    assert rc.contents(carried)[0] == ["python make.py"]
    carried = carry(made / ".dvc" / "cache", tmp_path, "2")  # the next call's save goes on with the set
    assert not (carried / "next").exists()
    assert rc.contents(carried)[0] == ["python make.py"] * 2
    sets = {(d / rc.MANIFEST).read_text() for d in carried.iterdir()}
    assert len(sets) == 1  # every folder holds the new set's manifest, no chunk of the old one


def test_extra_files_travel_with_the_set_and_arrive_whole(made, tmp_path):
    ckpt = tmp_path / "last.pt"
    ckpt.write_bytes(random.randbytes(300_000))
    staged = lambda: json.loads((tmp_path / "staging-1" / rc.MANIFEST).read_text())  # noqa: E731
    carried = carry(made / ".dvc" / "cache", tmp_path, "1", extra={".eaglenest/train/last.pt": ckpt})
    assert staged()["extra"] == [".eaglenest/train/last.pt"]
    b, stash = project(tmp_path / "b", "one"), tmp_path / "stash"
    for d in sorted(carried.iterdir()):
        rc.receive(d, stash)
    assert rc.unpack(stash, b / ".dvc" / "cache", root=b) == 1
    assert (b / ".eaglenest/train/last.pt").read_bytes() == ckpt.read_bytes()
    assert not (b / ".dvc" / "cache" / "extra").exists() and not list(b.rglob("*.tmp"))
    assert "Stage 'make' is cached" in sh("dvc repro", b).stdout

    first = staged()["sha256"]
    ckpt.write_bytes(random.randbytes(300_000))  # the checkpoint moved on: the same name, a new set
    rc.pack(made / ".dvc" / "cache", ("python make.py",), tmp_path / "staging-1", {".eaglenest/train/last.pt": ckpt})
    assert staged()["sha256"] != first and staged()["sent"] == []


def going_on_work(root: Path, finished_point: bool) -> Path:
    """A curve work repo as `run` leaves it: a point stopped inside training (its checkpoint, stage times
    and name), or one finished (its report; `run` removed its checkpoint and name)."""
    from bench import gpu_curve as gc
    from bench import gpu_profile as gp

    (root / ".dvc" / "cache").mkdir(parents=True)
    (root / gp.TIMES).parent.mkdir(parents=True)
    (root / gp.TIMES).write_text('{"extract@synth-000": 40.0, "train": 600.0}')
    if finished_point:
        (root / gc.CURVE / "syn1x").mkdir(parents=True)
        (root / gc.CURVE / "syn1x" / "gpu_profile.json").write_text("{}")
    else:
        (root / gc.CKPT).mkdir(parents=True)
        (root / gc.CKPT / "last-0123456789abcdef.pt").write_bytes(random.randbytes(250_000))
        (root / gc.CURVE).mkdir(parents=True)
        (root / gc.RUNNING).write_text("syn2x-13ep")
    return root


@pytest.mark.parametrize("finished_point", [False, True])
def test_a_point_stopped_inside_training_goes_on_from_its_checkpoint_on_the_next_machine(
    tmp_path, monkeypatch, finished_point
):
    """bench.gpu_curve save/collect/load: the unfinished point's checkpoint, stage times and name arrive
    whole in the next machine's work repo, where `run` goes on with that point; a finished point carries
    none of them."""
    from bench import gpu_curve as gc

    monkeypatch.setattr(rc, "CHUNK", 100_000)
    monkeypatch.setattr(gc, "CALL_BYTES", 250_000)
    monkeypatch.setattr(gc, "STASH", tmp_path / "stash")
    a = going_on_work(tmp_path / "a", finished_point)
    for call in range(1, 10):
        gc.save(a, tmp_path / f"out-{call}")
        rc.collect(tmp_path / f"out-{call}", tmp_path / "carry", 250_000)
        manifest = json.loads((a / "bench/out/saved" / rc.MANIFEST).read_text())
        if set(manifest["sent"]) == set(manifest["chunks"]):
            break
    b = tmp_path / "b"
    b.mkdir()
    for d in sorted((tmp_path / "carry").glob("[0-9]*")):
        gc.load(b, d)
    carried = [gc.CKPT / "last-0123456789abcdef.pt", Path(gc.RUNNING), Path("bench/out/gpu_profile_times.json")]
    if finished_point:
        assert manifest["extra"] == [] and not any((b / f).exists() for f in carried)
        assert gc.finished(b) == {"syn1x"}
    else:
        assert len(manifest["chunks"]) >= 3 and sorted(manifest["extra"]) == sorted(map(str, carried))
        for f in carried:
            assert (b / f).read_bytes() == (a / f).read_bytes(), f
