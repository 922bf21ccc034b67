"""Faults: SIGKILL at 20 random points of an extraction, flipped bytes anywhere in a store."""

import random
import signal
import subprocess
import sys
import time

import pytest
import yaml

from eaglenest.store.hidden_store import HiddenStore, verify_store

from .conftest import REPO, base_params, pack_workspace, random_samples, run_py, stage_workspace, write_tokenized
from .test_store import flip_byte

pytestmark = pytest.mark.slow


def test_twenty_random_sigkills_then_resume(smollm2, tmp_path):
    seqs = random_samples(30, 20000, 40, 128, seed=11)
    ws = stage_workspace(tmp_path / "ws", smollm2, base_params(store={"chunk_mb": 0.02, "shard_mb": 0.5}))
    write_tokenized(ws / "data/tokenized/p.parquet", seqs)
    rng = random.Random(20)
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    kills = 0
    while kills < 20:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stages.extract", "p", "--no-progress"],
            cwd=ws,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(rng.uniform(0.2, 4.0))  # anywhere: imports, model load, forward, zarr write, manifest
        if proc.poll() is not None:
            break  # it finished before this kill
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        # a store published before this kill (publishing is one rename) reads back whole
        if (ws / "data/hidden/p").exists():
            assert verify_store(ws / "data/hidden/p", progress=False) == []
    run_py(["-m", "stages.extract", "p", "--no-progress"], cwd=ws)
    store = HiddenStore(ws / "data/hidden/p")
    assert verify_store(store.path, progress=False) == []
    assert [r["id"] for r in store.index] == [f"s{i}" for i in range(len(seqs))]  # none lost, none twice
    assert kills >= 10, "the kills must land mid-extraction"

    clean = stage_workspace(tmp_path / "clean", smollm2, yaml.safe_load((ws / "params.yaml").read_text()))
    write_tokenized(clean / "data/tokenized/p.parquet", seqs)
    run_py(["-m", "stages.extract", "p", "--no-progress"], cwd=clean)
    ref = HiddenStore(clean / "data/hidden/p")
    assert [(r["key"], r["digest"]) for r in store.index] == [(r["key"], r["digest"]) for r in ref.index]


def test_flipped_byte_anywhere_is_named_and_stops_the_teacher(tiny_packed, tmp_path):
    """The teacher stage is the one read of a part's states before training: a flipped byte anywhere
    in the store fails it (exit 2) naming the store, and its earlier output stays as it was."""
    ws = pack_workspace(tiny_packed, tmp_path / "ws", workers=2)
    store = ws / "data/hidden/a"
    files = sorted(p for p in store.rglob("*") if p.is_file())
    rng = random.Random(5)
    for f in rng.sample(files, min(8, len(files))):
        original = f.read_bytes()
        offset = rng.randrange(len(original))
        flip_byte(f, offset)
        where = f"{f.relative_to(store)}@{offset}"
        bad = verify_store(store, progress=False)
        assert bad, f"flip at {where} went unnoticed"
        assert all(str(store) in b for b in bad), where
        p = run_py(["-m", "stages.teacher", "a", "--no-progress"], cwd=ws, check=False)
        assert p.returncode == 2 and "data/hidden/a" in p.stderr, (where, p.stderr[-1500:])
        kept = ws / "data/teacher/a/argmax.npy"
        assert kept.read_bytes() == (tiny_packed / "data/teacher/a/argmax.npy").read_bytes()
        f.write_bytes(original)
    assert verify_store(store, progress=False) == []
