"""What a killed run, a second run, a full disk or a bad path must not do: delete the previous good
store, another part's resumable work, or leave processes and shared memory behind; and every such
failure ends in one line naming the path, not a traceback. Real files and real processes."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import yaml
import zarr

from eaglenest.data.conversations import read_jsonl
from eaglenest.extraction import work_dir as work_dir_mod
from eaglenest.extraction.work_dir import WorkDir, check_writable, part_lock, publish
from eaglenest.runtime.errors import EaglenestError
from eaglenest.store.hidden_store import HiddenStore, Layout, verify_store
from eaglenest.store.piece_buffers import SHM_PREFIX, sweep_stale_shm

from .conftest import REPO, base_params, random_samples, run_py, stage_workspace, write_tokenized

pytestmark = pytest.mark.slow


def test_publish_keeps_the_previous_store_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    out = tmp_path / "hidden" / "p"
    out.mkdir(parents=True)
    (out / "good").write_text("previous good store")
    new = tmp_path / "work" / "store"
    new.mkdir(parents=True)
    (new / "fresh").write_text("new store")
    real_rename, calls = os.rename, []

    def failing_second_rename(a, b):  # the new store cannot be renamed in (a full or read-only dir)
        calls.append((a, b))
        if len(calls) == 2:
            raise OSError(errno.EROFS, "Read-only file system", str(b))
        return real_rename(a, b)

    monkeypatch.setattr(os, "rename", failing_second_rename)
    with pytest.raises(OSError):
        publish(new, out)
    monkeypatch.setattr(os, "rename", real_rename)
    assert (out / "good").read_text() == "previous good store"  # put back
    assert [p.name for p in out.parent.iterdir()] == ["p"]  # nothing half-published beside it
    new.mkdir(parents=True)
    (new / "fresh").write_text("new store")
    publish(new, out)
    assert sorted(p.name for p in out.iterdir()) == ["fresh"] and [p.name for p in out.parent.iterdir()] == ["p"]
    # a crash between the two renames left only `.p.old-<pid>`: the next publish restores, then swaps
    os.rename(out, out.parent / ".p.old-99999")
    new.mkdir(parents=True)
    (new / "newest").write_text("x")
    publish(new, out)
    assert sorted(p.name for p in out.iterdir()) == ["newest"] and [p.name for p in out.parent.iterdir()] == ["p"]


def test_an_unwritable_output_dir_fails_before_any_work(tmp_path):
    blocker = tmp_path / "hidden"
    blocker.write_text("a file where the output directory should be")
    with pytest.raises(EaglenestError, match="not writable.*nothing was extracted"):
        check_writable(blocker / "p")


def test_clean_up_touches_only_the_parts_own_work_dirs(tmp_path):
    key = "0123456789abcdef0123"
    for name in ("s6-" + key, "s6-" + "f" * 20, "s6-b-" + key, "s6-b-" + "e" * 20, "s6-notakey"):
        (tmp_path / name).mkdir()
    assert sorted(p.name for p in WorkDir(tmp_path, "s6", key).stale_siblings()) == ["s6-" + "f" * 20]
    assert sorted(p.name for p in WorkDir(tmp_path, "s6-b", key).stale_siblings()) == ["s6-b-" + "e" * 20]


def test_a_work_dir_interrupted_while_being_created_is_rebuilt(tmp_path, monkeypatch):
    work = WorkDir(tmp_path, "p", "a" * 20)
    layout = Layout.for_sizes(64, 3, max_seq_len=128, chunk_mb=0.01, shard_mb=0.05, codec="none", level=1)
    attrs = {"work_key": "k"}
    real = work_dir_mod.create_arrays

    def disk_full_after_the_first_array(group, lay, n):
        group.create_array("input_ids", shape=(n, 8), dtype="int32")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(work_dir_mod, "create_arrays", disk_full_after_the_first_array)
    with pytest.raises(OSError):
        work.open_store(layout, 4, attrs)
    assert (work.store / "zarr.json").is_file() and not work.is_complete()
    monkeypatch.setattr(work_dir_mod, "create_arrays", real)
    group = work.open_store(layout, 4, attrs)  # was: KeyError 'aux' on every rerun
    assert work.is_complete() and set(layout.arrays()) <= set(zarr.open_group(str(work.store)).array_keys())
    assert group.attrs["work_key"] == "k"


def workspace(tmp_path, smollm2, n=30, **extract):
    ws = stage_workspace(
        tmp_path / "ws", smollm2, base_params(extract=extract, store={"chunk_mb": 0.02, "shard_mb": 0.3})
    )
    write_tokenized(ws / "data/tokenized/p.parquet", random_samples(n, 20000, 40, 128, seed=7))
    return ws


def test_a_second_run_of_a_part_fails_at_once_naming_the_first(smollm2, tmp_path):
    ws = workspace(tmp_path, smollm2)
    with part_lock(ws / ".eaglenest/work", "p"):
        t = time.time()
        p = run_py(["-m", "stages.extract", "p", "--no-progress"], cwd=ws, check=False)
        assert p.returncode == 2 and f"part p is being extracted by PID {os.getpid()}" in p.stderr
        assert "Traceback" not in p.stderr and time.time() - t < 120
    run_py(["-m", "stages.extract", "p", "--no-progress"], cwd=ws)  # the lock is released with its holder
    assert verify_store(ws / "data/hidden/p", progress=False) == []


def test_bad_paths_end_in_one_line_not_a_traceback(smollm2, tmp_path):
    ws = workspace(tmp_path, smollm2, n=4, work_dir="work-file/sub")
    (ws / "work-file").write_text("not a directory")
    r = run_py(["-m", "stages.extract", "p", "--no-progress"], cwd=ws, check=False)
    assert r.returncode == 2 and "work-file" in r.stderr and "Traceback" not in r.stderr, r.stderr
    bad = tmp_path / "bad.jsonl"
    good = json.dumps(
        {"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    )
    bad.write_bytes(
        good.encode() + b"\n" + b'{"id": "b", "messages": "\xff\xfe"}\n' + good.replace('"a"', '"c"').encode() + b"\n"
    )
    with pytest.raises(EaglenestError, match=r"bad.jsonl:2: not UTF-8"):
        read_jsonl(bad)
    convs, report = read_jsonl(bad, on_error="skip")
    assert [c["id"] for c in convs] == ["a", "c"] and sum(report.skipped.values()) == 1


def children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_sigkill_leaves_no_writer_processes_or_shared_memory(smollm2, tmp_path):
    ws = workspace(tmp_path, smollm2, n=60, writers=2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "stages.extract", "p", "--no-progress"],
        cwd=ws,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline, kids, shm = time.time() + 240, [], []
    while time.time() < deadline and proc.poll() is None:
        kids = [c for c in children(proc.pid) if "python" in c.name().lower()]
        shm = list(Path("/dev/shm").glob(f"{SHM_PREFIX}{proc.pid}-*"))
        if len(kids) >= 2 and shm:  # writers up and piece buffers allocated: mid-extraction
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the extraction finished before it could be killed; make it longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    gone, alive = psutil.wait_procs(kids, timeout=30)
    assert not alive, f"writer processes outlived their parent: {[p.pid for p in alive]}"
    sweep_stale_shm()  # what the next shared pool does first
    assert not list(Path("/dev/shm").glob(f"{SHM_PREFIX}{proc.pid}-*"))
    run_py(["-m", "stages.extract", "p", "--no-progress"], cwd=ws)  # resumes from committed pieces
    store = HiddenStore(ws / "data/hidden/p")
    assert len(store) == 60 and verify_store(store.path, progress=False) == []
    assert np.array_equal(store.read(0)[0], random_samples(60, 20000, 40, 128, seed=7)[0])


def test_a_bad_params_value_fails_before_any_work_naming_the_key(smollm2, tmp_path):
    ws = workspace(tmp_path, smollm2, n=4, batch_tokens=-5)
    r = run_py(["-m", "stages.extract", "p", "--no-progress"], cwd=ws, check=False)
    assert r.returncode == 2 and "`extract.batch_tokens` is -5; it must be auto or an integer >= 1" in r.stderr
    assert "Traceback" not in r.stderr and not (ws / ".eaglenest").exists()
    ws2 = workspace(tmp_path / "2", smollm2, n=4, batch_tokenz=4096)
    r = run_py(["-m", "stages.extract", "p", "--no-progress"], cwd=ws2, check=False)
    assert r.returncode == 2 and "unknown key `extract.batch_tokenz`" in r.stderr
    params = yaml.safe_load((ws2 / "params.yaml").read_text())
    del params["extract"]["batch_tokenz"], params["extract"]["work_dir"]
    (ws2 / "params.yaml").write_text(yaml.safe_dump(params))
    r = run_py(["-m", "stages.extract", "p", "--no-progress"], cwd=ws2, check=False)
    assert r.returncode == 2 and "missing `extract.work_dir`" in r.stderr and "Traceback" not in r.stderr
