"""bench/runcache_carry.py: a stage run's DVC run-cache entry, a directory output included, carried to
a fresh repository in chunks over several calls, restores the stage there ("is cached") with the same
outputs; a damaged or incomplete set restores nothing."""

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


def carry(src_cache: Path, tmp: Path, tag: str) -> Path:
    """pack, then send/collect in calls of 250 kB (chunks of 100 kB) until nothing is left."""
    rc.pack(src_cache, ("python make.py",), tmp / f"staging-{tag}")
    for call in range(1, 20):
        out = tmp / f"out-{tag}-{call}"
        (out).mkdir()
        left = rc.send(tmp / f"staging-{tag}", out, 250_000)
        rc.collect(out, tmp / "carry", 250_000)
        if not left:
            return tmp / "carry"
    raise AssertionError("send never finished")


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


def test_a_new_set_replaces_the_old_one_in_the_carried_folders(made, tmp_path):
    carry(made / ".dvc" / "cache", tmp_path, "1")
    (made / "input.txt").write_text("three")
    sh("dvc repro -q", made)  # a second run of `make`: a new set with both runs
    carried = carry(made / ".dvc" / "cache", tmp_path, "2")
    assert rc.contents(carried)[0] == ["python make.py"] * 2
    sets = {(d / rc.MANIFEST).read_text() for d in carried.iterdir()}
    assert len(sets) == 1  # every folder holds the new set's manifest, no chunk of the old one
