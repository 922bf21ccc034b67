"""Training: pack outputs, exact resume, DDP (2 gloo processes) == 1 process, speculative decoding."""

import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from eaglenest.data.packed import PackedSplit
from eaglenest.decoding.speculative import TargetRunner, greedy_decode, speculative_decode
from eaglenest.drafter.model import Eagle3Drafter
from eaglenest.runtime.errors import EaglenestError
from eaglenest.target.loading import load_model

from .conftest import REPO, build_packed, random_samples, run_py, train_params


def workspace_copy(src, dst, **train_over):
    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns(".eaglenest"))
    p = yaml.safe_load((dst / "params.yaml").read_text())
    p["train"] = train_params(**train_over)
    (dst / "params.yaml").write_text(yaml.safe_dump(p))
    return dst


def history(ws):
    return [h["loss"] for h in json.loads((ws / ".eaglenest/train/history.json").read_text())]


def ranks_env(tmp_path):
    """The environment for a stage that starts torchrun: one thread a rank, and an empty TMPDIR of
    its own, which must be empty again after the run (torchrun's log directory included)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return {"OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}, tmp


def test_pack_layout_and_vocab(tiny_packed):
    vocab = load_file(str(tiny_packed / "data/packed/vocab.safetensors"))
    sel, d2t, t2d = vocab["selected"], vocab["d2t"], vocab["t2d"]
    assert torch.equal(sel, torch.arange(48) + d2t) and t2d.sum() == 48 and t2d[sel].all()
    packed, hidden = tiny_packed / "data/packed", tiny_packed / "data/hidden"
    train, val = PackedSplit(packed, "train", hidden), PackedSplit(packed, "val", hidden)
    assert len(train) + len(val) == 48 and len(val) > 0
    manifest = json.loads((packed / "manifest.json").read_text())
    assert manifest["draft_vocab_size"] == 48 and set(manifest["stores"]) == {"a", "b"}
    # each state is stored once: the pack holds the split, the tokens and the index, no state
    files = {p.name for p in packed.rglob("*") if p.is_file()}
    assert files == {"vocab.safetensors", "manifest.json", "index.parquet", "input_ids.npy", "loss_mask.npy",
                     "in_vocab.npy", "offsets.npy"}, files  # fmt: skip
    # a sample as training reads it: the stored arrays of its store, its tokens and masks
    from eaglenest.store.hidden_store import HiddenStore

    for split in (train, val):
        for i in (0, len(split) - 1):
            part, row, _, n = split.samples[i]
            ids, stored = HiddenStore(hidden / part).read_stored(row)
            got = split.get(i)
            assert all(np.array_equal(got[k], v) for k, v in stored.items()) and np.array_equal(got["input_ids"], ids)
            assert len(got["loss_mask"]) == len(got["in_vocab"]) == n


def test_teacher_writes_the_same_bytes_with_worker_processes(tiny_packed, tiny_target, tmp_path):
    """Units of work are planned before any read, so 3 reader processes give the 1-process bytes
    exactly, and pack reads no state: its output from them is the fixture's, byte for byte."""
    from eaglenest.data.pack import pack
    from eaglenest.data.teacher import teach_parts
    from eaglenest.target.loading import load_heads

    data = tiny_packed / "data"
    head = load_heads(tiny_target)["lm_head"]
    teach_parts(["a", "b"], data / "hidden", data / "tokenized", tmp_path / "teacher", head, workers=3,
                unit_mb=0.05, progress=False)  # fmt: skip
    for part in ("a", "b"):
        for f in ("argmax.npy", "manifest.json"):
            assert (tmp_path / "teacher" / part / f).read_bytes() == (data / "teacher" / part / f).read_bytes()
    metrics = pack(["a", "b"], data / "hidden", data / "tokenized", tmp_path / "teacher", tmp_path / "packed", 48, 0.15)
    ref = sorted(p.relative_to(data / "packed") for p in (data / "packed").rglob("*") if p.is_file())
    got = sorted(p.relative_to(tmp_path / "packed") for p in (tmp_path / "packed").rglob("*") if p.is_file())
    assert got == ref and len([p for p in ref if p.name == "offsets.npy"]) == 2  # train and val
    for rel in ref:
        assert (tmp_path / "packed" / rel).read_bytes() == (data / "packed" / rel).read_bytes(), rel
    assert metrics["samples"] == 48 and 0 < metrics["teacher_argmax_in_vocab"] <= 1


def test_fp8_states_stay_fp8_in_the_pack_and_decode_to_the_stores_values(tiny_target, tmp_path):
    import pyarrow.parquet as pq

    from eaglenest.data.packed import collate, decode_states
    from eaglenest.store.bf16 import from_bits
    from eaglenest.store.hidden_store import HiddenStore

    ws = build_packed(tmp_path / "ws", tiny_target, states="fp8")
    packed = ws / "data/packed"
    assert json.loads((packed / "manifest.json").read_text())["states"] == "fp8"
    split = PackedSplit(packed, "train", ws / "data/hidden")
    assert split.get(0)["aux"].dtype == np.uint8 and "aux_scale" in split.names  # read as stored
    rows = [r for r in pq.read_table(packed / "index.parquet").to_pylist() if r["split"] == "train"]
    stores = {p: HiddenStore(ws / "data/hidden" / p) for p in ("a", "b")}
    pos = {(p, r["id"]): i for p, s in stores.items() for i, r in enumerate(s.index)}
    for i in (0, 5, len(split) - 1):
        b = decode_states(collate(split, [i, 0]), split.states)
        _, aux, final = stores[rows[i]["part"]].read(pos[(rows[i]["part"], rows[i]["id"])])
        n = len(aux)
        assert b["aux"].dtype == torch.bfloat16 and torch.equal(b["aux"][0, :n], from_bits(aux))
        assert torch.equal(b["final"][0, :n], from_bits(final)) and not b["aux"][0, n:].any()
    # the trainer reads it as it reads bf16 packs
    run_py(["-m", "stages.train"], cwd=workspace_copy(ws, tmp_path / "train", epochs=1))
    assert (tmp_path / "train/data/drafter/model.safetensors").is_file()


def test_resume_reproduces_the_uninterrupted_loss_curve(tiny_packed, tmp_path):
    full = workspace_copy(tiny_packed, tmp_path / "full")
    run_py(["-m", "stages.train"], cwd=full)
    ref = history(full)
    assert len(ref) >= 6
    half = workspace_copy(tiny_packed, tmp_path / "half")
    run_py(["-m", "stages.train", "--stop-after-steps", str(len(ref) // 2)], cwd=half)
    assert len(history(half)) == len(ref) // 2
    p = run_py(["-m", "stages.train"], cwd=half)
    assert "resumed from" in p.stderr
    np.testing.assert_allclose(history(half), ref, rtol=1e-6)
    a = Eagle3Drafter.from_pretrained(full / "data/drafter")
    b = Eagle3Drafter.from_pretrained(half / "data/drafter")
    for k, v in a.state_dict().items():
        assert torch.allclose(v.float(), b.state_dict()[k].float(), atol=1e-6), k
    m = json.loads((full / "reports/train.json").read_text())
    assert m["epochs"] == 2 and 1.0 <= m["val_simulated_tau"] <= 4.0


def training_at_step_3(ws, env_extra=None):
    """`python -m stages.train` started in ws, returned once its bar shows step 3 or later: the
    process, its stderr so far (a list that keeps filling) and the thread that fills it."""
    import subprocess
    import sys
    import threading
    import time

    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    p = subprocess.Popen(
        [sys.executable, "-m", "stages.train"], cwd=ws, env=env, stderr=subprocess.PIPE, text=True, bufsize=1
    )
    err = []
    reader = threading.Thread(target=lambda: err.extend(iter(lambda: p.stderr.read(1), "")), daemon=True)
    reader.start()
    deadline = time.time() + 300
    while not re.search(r"\|\s*([3-9]|\d\d+)/\d+ \[", "".join(err)):  # the bar shows step >= 3
        assert p.poll() is None and time.time() < deadline, "".join(err)[-3000:]
        time.sleep(0.05)
    return p, err, reader


def test_an_interrupt_checkpoints_the_step_it_stopped_at_and_the_rerun_resumes_there(tiny_packed, tmp_path):
    """SIGINT mid-training (as DVC, a scheduler or a time limit sends it): the running step finishes,
    a checkpoint is saved although ckpt_every is far off, the exit is non-zero, and a rerun resumes."""
    import signal

    ws = workspace_copy(tiny_packed, tmp_path / "ws", epochs=400, ckpt_every=10**6)
    p, err, reader = training_at_step_3(ws)
    p.send_signal(signal.SIGINT)
    assert p.wait(120) == 2
    reader.join(10)
    out = "".join(err)
    m = re.search(r"training interrupted \(SIGINT\) at step (\d+); checkpoint saved", out)
    assert m, out[-3000:]
    step = int(m.group(1))
    assert step >= 3
    state = torch.load(next((ws / ".eaglenest/train").glob("last-*.pt")), weights_only=False)["state"]
    assert state["global_step"] == step
    assert not (ws / "data/drafter").exists()  # nothing exported from an interrupted run
    p = run_py(["-m", "stages.train", "--stop-after-steps", str(step + 2)], cwd=ws)
    assert re.search(rf"resumed from .* step {state['step_in_epoch']}\b", p.stderr), p.stderr[-2000:]
    assert len(history(ws)) == step + 2


def test_ddp_two_gloo_processes_match_one_process(tiny_packed, tmp_path):
    """train.nproc 2: the plain stage command (what dvc.yaml runs) starts itself as 2 ranks under
    torchrun; the losses are the one-process run's, and torchrun's log directory is gone after."""
    one = workspace_copy(tiny_packed, tmp_path / "one", epochs=1)
    run_py(["-m", "stages.train"], cwd=one)
    two = workspace_copy(tiny_packed, tmp_path / "two", epochs=1, nproc=2)
    env, tmp = ranks_env(tmp_path)
    p = run_py(["-m", "stages.train"], cwd=two, env_extra=env)
    assert "training on 2 ranks under torchrun (train.nproc 2)" in p.stderr
    m = json.loads((two / "reports/train.json").read_text())
    assert m["world_size"] == 2, p.stderr[-2000:]
    np.testing.assert_allclose(history(two), history(one), rtol=2e-4)
    assert list(tmp.iterdir()) == []


def test_a_rank_s_error_is_the_stage_s_last_line(tiny_packed, tmp_path):
    """A store shard goes missing before a 2-rank run: a rank fails on it, torchrun reports its
    children, and the stage's last line is still the rank's own error, naming the file; exit 2."""
    ws = workspace_copy(tiny_packed, tmp_path / "ws", epochs=1, nproc=2)
    shutil.rmtree(ws / "data/hidden")
    shutil.copytree(tiny_packed / "data/hidden", ws / "data/hidden")
    (ws / "data/hidden/a/aux/c.0.0.0").unlink()
    env, tmp = ranks_env(tmp_path)
    p = run_py(["-m", "stages.train"], cwd=ws, check=False, env_extra=env)
    assert p.returncode == 2, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert re.search(
        r"ERROR eaglenest: rank [01] of 2 under torchrun.*: store a .*data/hidden/a/aux/c.0.0.0 missing", last
    ), last
    assert list(tmp.iterdir()) == []


def test_a_signal_to_the_stage_stops_every_rank_it_started(tiny_packed, tmp_path):
    """SIGTERM to the stage process (as DVC sends it) while its 2 ranks train: it reaches torchrun,
    which stops them; the stage exits non-zero, no process of the run is left, nor its log directory."""
    import signal

    ws = workspace_copy(tiny_packed, tmp_path / "ws", epochs=400, ckpt_every=10**6, nproc=2)
    env, tmp = ranks_env(tmp_path)
    p, err, reader = training_at_step_3(ws, env)
    p.send_signal(signal.SIGTERM)
    assert p.wait(120) != 0
    reader.join(10)

    def in_ws(pid):
        try:
            return os.readlink(f"/proc/{pid}/cwd") == str(ws)
        except OSError:  # gone meanwhile, or not ours to read
            return False

    assert [pid for pid in os.listdir("/proc") if pid.isdigit() and in_ws(pid)] == [], "".join(err)[-3000:]
    assert list(tmp.iterdir()) == []
    assert not (ws / "data/drafter").exists()


def test_train_nproc_resolves_to_ranks_that_split_the_micro_batches(caplog):
    from eaglenest.runtime.torchrun import ranks

    assert ranks("auto", 4, 0) == 1  # the CPU: one process
    assert ranks("auto", 8, 8) == 8 and ranks("auto", 4, 8) == 4 and ranks("auto", 6, 4) == 3
    with caplog.at_level("WARNING"):
        assert ranks("auto", 1, 2) == 1
    assert "make micro_batches a multiple of 2 to use them all" in caplog.text
    assert ranks(2, 4, 0) == 2 and ranks(4, 4, 8) == 4  # gloo processes on the CPU; fewer GPUs than there are
    for nproc, micro, gpus, says in [
        (3, 4, 0, "train.nproc 3 does not divide train.micro_batches 4"),
        (4, 4, 2, "train.nproc 4: train.device has only 2 GPU(s)"),
        (0, 4, 0, "train.nproc must be auto or an integer >= 1, got 0"),
        ("two", 4, 0, "train.nproc must be auto or an integer >= 1, got 'two'"),
    ]:
        with pytest.raises(EaglenestError, match=re.escape(says)):
            ranks(nproc, micro, gpus)


@pytest.fixture(scope="module")
def tiny_fp32(tiny_target):
    return load_model(tiny_target, dtype="float32", device="cpu")


def tiny_drafter(tiny_target, taps, seed):
    from eaglenest.drafter.config import DrafterConfig

    cfg = json.loads((tiny_target.model_dir / "config.json").read_text())
    torch.manual_seed(seed)
    d = Eagle3Drafter(DrafterConfig.from_target(cfg, 64, taps))
    d.set_vocab(torch.arange(3, 67))
    return d.eval()


def oracle_drafter(truth_tokens: list[int], prompt_len: int, rng, vocab: int = 200):
    """A drafter right up to a random position of each chain: exercises every accept length."""

    def draft(_d, _e, _f, tokens, k):
        n = len(tokens) - prompt_len
        truth = (truth_tokens + [0] * 8)[n : n + k]
        cut = int(rng.integers(0, k + 1))
        return truth[:cut] + [(t + 1) % vocab for t in truth[cut:]]

    return draft


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculative_decoding_is_lossless(tiny_target, tiny_fp32, seed):
    taps = [2, 4, 5]
    runner = TargetRunner(tiny_fp32, taps)
    embed = tiny_fp32.get_input_embeddings()
    drafter = tiny_drafter(tiny_target, taps, seed)
    rng = np.random.default_rng(seed)
    for prompt in random_samples(3, 200, 3, 40, seed=seed):
        prompt = prompt.tolist()
        g = greedy_decode(runner, prompt, 24, eos={2})
        s = speculative_decode(runner, drafter, embed, prompt, 24, eos={2}, k=3)
        assert s.tokens == g.tokens

        s2 = speculative_decode(
            runner, drafter, embed, prompt, 24, eos={2}, k=3, draft_fn=oracle_drafter(g.tokens, len(prompt), rng)
        )
        assert s2.tokens == g.tokens and max(s2.accepted) >= 1
        assert s2.target_forwards < g.target_forwards  # every accepted draft saved a forward


def test_a_checkpoint_of_other_training_code_is_not_resumed(tiny_packed, tmp_path, monkeypatch):
    """DVC reruns train after a code change; a finished checkpoint of the old code must not be
    'resumed' (it would export the old drafter as the new one)."""
    from eaglenest.drafter import train as T
    from eaglenest.drafter.train_config import TrainConfig
    from eaglenest.target.directory import load_target

    def trainer():
        cfg = TrainConfig(**train_params())
        return T.Trainer(
            tiny_packed / "data/packed",
            tiny_packed / "data/hidden",
            load_target(tiny_packed / "data/target"),
            cfg,
            tmp_path,
        )

    a = trainer()
    a.fit(stop_after_steps=2, progress=False)
    assert trainer().maybe_resume()  # same code: resumes
    monkeypatch.setattr(T, "training_code_digest", lambda: "edited")
    b = trainer()
    assert not b.maybe_resume() and b.state["global_step"] == 0


def test_bucketed_batches_have_few_fixed_shapes_and_hold_every_sample_once(tiny_packed):
    from eaglenest.data.packed import batch_shape, bucket_width, epoch_batches

    split = PackedSplit(tiny_packed / "data/packed", "train", tiny_packed / "data/hidden")
    lengths = [split.length(i) for i in range(len(split))]
    assert bucket_width(640) == 128 and bucket_width(2048) == 256 and bucket_width(100) == 128
    q, budget = 32, 256
    for epoch in (0, 1):
        batches = epoch_batches(split, epoch, 0, budget, bucket=q)
        assert sorted(i for b in batches for i in b) == list(range(len(split)))
        shapes = {batch_shape([lengths[i] for i in b], q, budget) for b in batches}
        by_len = {}
        for rows, T in shapes:
            assert T % q == 0 and (rows * T <= budget or rows == 1)
            by_len.setdefault(T, set()).add(rows)
        assert all(len(r) == 1 for r in by_len.values())  # one shape per padded length
        assert len(shapes) <= -(-max(lengths) // q)
    # bucket 0 keeps the previous grouping (CPU runs reproduce bit for bit)
    assert epoch_batches(split, 0, 0, budget) == epoch_batches(split, 0, 0, budget, bucket=0)


def test_loader_processes_give_the_batches_collated_here(tiny_packed):
    """train.loader_workers: the stores read in worker processes into shared slots, the same batches as
    in this process; a slot is reused only once released, and a read that fails frees its slot."""
    from concurrent.futures import TimeoutError as Pending

    from eaglenest.data.loader import BatchLoader, layout_bytes
    from eaglenest.data.packed import batch_layout, batch_shape, collate, epoch_batches

    packed, hidden = tiny_packed / "data/packed", tiny_packed / "data/hidden"
    split = PackedSplit(packed, "train", hidden)
    batches = epoch_batches(split, 0, 0, 240)
    shapes = [batch_shape([split.length(i) for i in b]) for b in batches]
    val = PackedSplit(packed, "val", hidden)
    val_batches = epoch_batches(val, 0, 0, 240)
    val_shapes = [batch_shape([val.length(i) for i in b]) for b in val_batches]
    assert val_batches
    size = max(layout_bytes(batch_layout(split, *s)) for s in shapes + val_shapes)
    loader = BatchLoader(packed, hidden, {"train": split, "val": val}, 2, slots=2, slot_bytes=size)
    try:
        held = [loader.submit(b, s) for b, s in zip(batches[:2], shapes[:2])]
        with ThreadPoolExecutor(1) as t:  # both slots held: a third submit waits for a release
            third = t.submit(loader.submit, batches[2], shapes[2])
            with pytest.raises(Pending):
                third.result(timeout=2)
            for j in range(3):
                there = (held[j] if j < 2 else third.result()).result()
                here = collate(split, batches[j], shapes[j])
                assert here.keys() == there.keys() and all(torch.equal(here[k], there[k]) for k in here)
                loader.release(there)
        with pytest.raises(EaglenestError, match="does not fit a loader slot"):
            loader.submit(list(range(len(split))), (len(split), max(s[1] for s in shapes)))
        for b, s in zip(batches[3:], shapes[3:]):  # more batches than slots, each released once compared
            here, there = collate(split, b, s), loader.submit(b, s).result()
            assert all(torch.equal(here[k], there[k]) for k in here)
            loader.release(there)
        for b, s in zip(val_batches, val_shapes):  # the val split through the same workers (per-epoch validation)
            here, there = collate(val, b, s), loader.submit(b, s, "val").result()
            assert all(torch.equal(here[k], there[k]) for k in here)
            loader.release(there)
        with pytest.raises(IndexError):
            loader.submit([len(split) + 5], shapes[0]).result()
        assert loader.free.qsize() == 2
    finally:
        loader.close()


def test_training_from_loader_processes_equals_training_in_process(tiny_packed, tmp_path):
    """The trainer's steps from slot-backed batches (copied off, then their slots handed back, more
    steps than slots) give the same weights, bit for bit, as batches collated in the process, and the
    same per-epoch validation, read through the same workers."""
    from eaglenest.drafter.train import Trainer
    from eaglenest.drafter.train_config import TrainConfig
    from eaglenest.target.directory import load_target

    def weights(workers: int) -> dict:
        cfg = TrainConfig(**train_params(loader_workers=workers, epochs=2))
        t = Trainer(
            tiny_packed / "data/packed", tiny_packed / "data/hidden", load_target(tiny_packed / "data/target"), cfg,
            tmp_path / f"w{workers}",
        )  # fmt: skip
        out = t.fit(progress=False)
        assert workers == 0 or t.loader.free.qsize() == (t.ahead + 1) * cfg.micro_batches  # all handed back
        return t.model.state_dict(), [e["val"] for e in out["epochs"]]

    (here, val_here), (there, val_there) = weights(0), weights(1)
    assert all(torch.equal(here[k], there[k]) for k in here)
    assert len(val_here) == 2 and val_here == val_there


def test_a_store_gone_or_changed_since_pack_is_named_with_its_fix(tiny_packed, tmp_path):
    """Training reads the states from the stores pack indexed: one deleted (or moved, or invalidated),
    or re-extracted with other content, fails the stage naming the part and the command that fixes it,
    never mixing data."""
    ws = workspace_copy(tiny_packed, tmp_path / "ws", epochs=1)
    store = ws / "data/hidden/a"
    shutil.move(store, tmp_path / "a-aside")
    p = run_py(["-m", "stages.train"], cwd=ws, check=False)
    assert p.returncode != 0
    line = p.stderr.strip().splitlines()[-1]
    assert "part a: its store is gone or unreadable since pack ran" in line and "dvc checkout data/hidden/a" in line
    shutil.copytree(ws / "data/hidden/b", store)  # another part's samples where part a's were
    p = run_py(["-m", "stages.train"], cwd=ws, check=False)
    assert p.returncode != 0
    line = p.stderr.strip().splitlines()[-1]
    assert "part a: data/hidden/a is not the store pack indexed" in line and "dvc repro" in line
    assert not (ws / "data/drafter").exists()


def test_states_kept_in_memory_are_read_and_checked_once_a_run(tiny_packed, tmp_path):
    """Reading in the training process (the CPU), states that fit a quarter of the free memory are kept
    once read: later epochs read no store. Past the budget nothing is kept."""
    ws = shutil.copytree(tiny_packed, tmp_path / "ws", symlinks=True)
    split = PackedSplit(ws / "data/packed", "train", ws / "data/hidden")
    assert not split.keep_in_memory(1024)  # too small: read every time
    assert split.keep_in_memory(10**9)
    first = [split.get(i) for i in range(len(split))]
    shutil.rmtree(ws / "data/hidden")  # no store left to read
    again = [split.get(i) for i in range(len(split))]
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(first, again) for k in a)
