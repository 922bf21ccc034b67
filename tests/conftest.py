"""Shared fixtures: the real SmolLM2 target (converted once, cached under .eaglenest/test-cache)
and a tiny random Llama built from a config (no download)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from eaglenest.data import chat
from eaglenest.runtime.made_on import compute_dtype
from eaglenest.target.directory import load_target, materialize
from eaglenest.target.files import fingerprint

REPO = Path(__file__).resolve().parents[1]
# what the stages compute in here (`dtype: auto`): bf16 on a CPU with bf16 units, float32 on one that
# would emulate bf16 ~60x slower; tests of the real target's engines use it as a user's run would
CPU_DTYPE = compute_dtype("auto")
CACHE = REPO / ".eaglenest" / "test-cache"
# the tests' own DVC projects have no `core.analytics false`: with no internet, each DVC command's
# analytics report (a file in /tmp) is never sent and never removed
os.environ["DVC_NO_ANALYTICS"] = "1"


@pytest.fixture(scope="session")
def smollm2():
    """The builtin target, materialised once per machine (the conversion takes ~20 s)."""
    out = CACHE / "smollm2"
    try:
        t = load_target(out)
        if fingerprint(t.model_dir) == t.fingerprint:
            return t
    except Exception:
        pass
    shutil.rmtree(out, ignore_errors=True)
    return materialize("builtin:smollm2-135m-instruct", out)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2):
    from eaglenest.target.loading import load_tokenizer

    return load_tokenizer(smollm2)


def make_tiny_target(root: Path):
    """An 8-layer random Llama (hidden 64, seed 0) saved under root/model, materialised as root/target."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(root / "model")
    return materialize(str(root / "model"), root / "target")


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("tiny"))


def random_samples(n, vocab, lo, hi, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(lo, hi + 1))).astype(np.int32) for _ in range(n)]


def write_tokenized(path: Path, seqs, names=None) -> Path:
    return chat.write_tokenized(chat.token_table(seqs, names), path)


def run_py(args, cwd, check=True, timeout=600, env_extra=None, **kw):
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    p = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} exited {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr[-4000:]}")
    return p


def stage_workspace(root: Path, target, params: dict) -> Path:
    """A directory where `python -m stages.<x>` runs: params.yaml and data/target pointing at `target`."""
    import yaml

    root.mkdir(parents=True, exist_ok=True)
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    tdir = root / "data" / "target"
    tdir.mkdir(parents=True, exist_ok=True)
    info = (
        json.loads((target.model_dir.parent / "target.json").read_text())
        if (target.model_dir.parent / "target.json").exists()
        else {}
    )
    info.update(
        spec=target.spec,
        model_dir=str(target.model_dir),
        fingerprint=target.fingerprint,
        num_layers=target.num_layers,
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
    )
    (tdir / "target.json").write_text(json.dumps(info))
    return root


def gate(samples: int) -> dict:
    """The validation gate's thresholds as params.yaml sets them (their one home), on `samples` samples."""
    import yaml

    return {**yaml.safe_load((REPO / "params.yaml").read_text())["validate"], "samples": samples}


def base_params(**over) -> dict:
    """The extraction sections of the repository's params.yaml (every key: the stages take no
    defaults of their own), made small and CPU-bound, then `over` per section."""
    import yaml

    repo = yaml.safe_load((REPO / "params.yaml").read_text())
    p = {k: repo[k] for k in ("tokenize", "extract", "store", "validate")}
    p["tokenize"].update(max_seq_len=128, on_error="fail")
    # dtype auto, as params.yaml: float32 on a CPU that emulates bf16, where bf16 would take ~60x longer
    p["extract"].update(backend="hf", taps="auto", dtype="auto", device="cpu", batch_tokens=1024)
    p["store"].update(states="bf16", codec="zstd", level=1, chunk_mb=0.05, shard_mb=0.5)
    p["validate"] = gate(4)
    for k, v in over.items():
        p[k] = {**p.get(k, {}), **v}
    return p


def build_packed(root: Path, tiny_target, states: str = "bf16") -> Path:
    """Two parts of random token sequences extracted from the tiny target (states in `states`)
    and packed; returns a stage workspace holding data/target and data/packed."""
    from eaglenest.data.pack import pack
    from eaglenest.data.teacher import teach_parts
    from eaglenest.extraction.backends.hf import HFBackend
    from eaglenest.extraction.loop import extract_part
    from eaglenest.target.loading import load_heads
    from eaglenest.target.taps import resolve_taps

    ws = stage_workspace(root, tiny_target, base_params())
    taps = resolve_taps("auto", tiny_target.num_layers)
    rng = np.random.default_rng(7)
    for part, seed in (("a", 1), ("b", 2)):
        seqs = random_samples(24, 64, 20, 60, seed=seed)  # a small alphabet: learnable statistics
        masks = [(rng.random(len(s)) < 0.7).astype(np.uint8) for s in seqs]
        names = [f"{part}{i}" for i in range(len(seqs))]
        tok = chat.write_tokenized(chat.token_table(seqs, names, masks), ws / "data" / "tokenized" / f"{part}.parquet")
        extract_part(
            part=part,
            tokenized=tok,
            target=tiny_target,
            backend=HFBackend(tiny_target, taps, device="cpu", states=states),
            taps=taps,
            dtype="bfloat16",
            revision=0,
            layout_cfg=dict(chunk_mb=0.01, shard_mb=0.1, codec="zstd", level=1, states=states),
            validate_cfg=gate(2),
            out_dir=ws / "data" / "hidden" / part,
            work_root=ws / ".eaglenest" / "work",
            batch_tokens=512,
            max_seq_len=64,
            progress=False,
        )
    data = ws / "data"
    teach_parts(["a", "b"], data / "hidden", data / "tokenized", data / "teacher", load_heads(tiny_target)["lm_head"],
                unit_mb=0.05, progress=False)  # fmt: skip
    pack(["a", "b"], data / "hidden", data / "tokenized", data / "teacher", data / "packed", 48, 0.15)
    return ws


@pytest.fixture(scope="session")
def tiny_packed(tiny_target, tmp_path_factory):
    return build_packed(tmp_path_factory.mktemp("packed") / "ws", tiny_target)


def pack_workspace(tiny_packed: Path, dst: Path, workers: int = 1) -> Path:
    """A copy of `tiny_packed` where `python -m stages.pack` runs again (its params: both parts)."""
    import yaml

    shutil.copytree(tiny_packed, dst, symlinks=True)
    params = yaml.safe_load((dst / "params.yaml").read_text())
    params["data"] = {"parts": ["a", "b"]}
    params["pack"] = {"draft_vocab_size": 48, "val_fraction": 0.15}
    params["teacher"] = {"device": "cpu", "workers": workers, "unit_mb": 0.05}
    (dst / "params.yaml").write_text(yaml.safe_dump(params))
    return dst


def generate_params(**over) -> dict:
    """The generate and tokenize sections of a stage workspace that decodes on the CPU in float32."""
    g = {
        "enabled": True,
        "max_new_tokens": 6,
        "temperature": 0.0,
        "max_turns": 0,
        "seed": 0,
        "dtype": "float32",
        "device": "cpu",
        "batch_tokens": 4096,
        "max_rows": 8,
    }
    return {"generate": {**g, **over}, "tokenize": {"max_seq_len": 256, "on_error": "fail", "workers": "auto"}}


def train_params(**over) -> dict:
    t = {
        "epochs": 2,
        "lr": 0.003,
        "warmup": 0.1,
        "weight_decay": 0.0,
        "grad_clip": 0.5,
        "ttt_steps": 3,
        "decay": 0.8,
        "topk": 0,
        "topk_weight": 0.0,
        "align_topk": 0,
        "batch_tokens": 240,
        "micro_batches": 2,
        "seed": 0,
        "autocast": "none",
        "ckpt_every": 1,
        "device": "cpu",
        "attention": "auto",
        "compile": "auto",
        "intermediate_size": None,
        "loader_workers": 0,
        "nproc": 1,
    }
    t.update(over)
    return t


# --- real DVC pipelines in fresh clones ---------------------------------------------------------


def sh(cmd, cwd, check=True, timeout=900, env_extra=None):
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONUNBUFFERED": "1",
        **(env_extra or {}),
    }
    p = subprocess.run(cmd, cwd=cwd, env=env, shell=True, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{cmd} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


LOCAL_TARGET = CACHE / "smollm2" / "model"  # the built-in target as a local directory (the `smollm2` fixture)


def tiny_params(parts=("tiny-a", "tiny-b"), per_part=4, local_target: bool = False) -> dict:
    """local_target: the built-in target's converted directory as `target.path`, so the clone's
    target stage only fingerprints it (the GGUF conversion takes ~20 s a clone; test_pipeline keeps it)."""
    import yaml

    p = yaml.safe_load((REPO / "params.yaml").read_text())
    if local_target:
        p["target"]["path"] = str(LOCAL_TARGET)
    p["data"] = {
        "parts": list(parts),
        "sharegpt": {name: {"start": i * per_part, "count": per_part, "turns": 0} for i, name in enumerate(parts)},
        "synthetic": {},  # dvc.yaml's foreach reads it, even empty
    }
    p["tokenize"]["max_seq_len"] = 192
    p["store"].update(chunk_mb=0.1, shard_mb=1)
    p["validate"]["samples"] = 2
    p["pack"].update(draft_vocab_size=1024, val_fraction=0.25)
    p["train"].update(epochs=1, batch_tokens=512, micro_batches=1, ttt_steps=2)
    p["evaluate"].update(questions=2, max_new_tokens=6, k=2, min_tau=None)  # the gate and trees: test_evaluate
    return p


def write_params(repo: Path, params: dict) -> None:
    import yaml

    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def make_clone(root: Path, params: dict) -> Path:
    """A fresh repository holding the committed files of this one, with the given params."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    for f in filter(None, files):
        src = REPO / f
        if src.is_file() and not f.startswith(("data/", "metrics/", "bench/")) and f != "dvc.lock":
            (root / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / f)
    write_params(root, params)
    sh("git init -q && git add -A && git -c user.email=t@t -c user.name=t commit -qm init", root)
    return root


@pytest.fixture(scope="session")
def built(tmp_path_factory, smollm2):
    """A fresh clone, `dvc repro` run once and committed: (path, the repro's stdout). Read only
    (copy it to change anything: test_pipeline's `clone`)."""
    repo = make_clone(tmp_path_factory.mktemp("clone") / "repo", tiny_params())
    p = sh("dvc repro", repo)
    sh("git add -A && git -c user.email=t@t -c user.name=t commit -qm run1", repo)
    return repo, p.stdout


def commit(repo: Path, msg: str) -> None:
    sh(f"git add -A && git -c user.email=t@t -c user.name=t commit -qm '{msg}'", repo)


def ran(stdout: str) -> set[str]:
    """Stages DVC ran, from its own output."""
    import re

    return set(re.findall(r"Running stage '([^']+)'", stdout))


def cosine(a, b):
    import torch

    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def assert_stores_agree(store, ref, seqs, min_cosine: float) -> None:
    """Two backends' stores of the same samples: the same ids (those sent), and states whose per-token
    cosine to the reference store's is > 0.999 on average and > min_cosine everywhere."""
    from eaglenest.store.bf16 import from_bits

    for i in range(len(seqs)):
        ids, aux, fin = store.read(i)
        ids_r, aux_r, fin_r = ref.read(i)
        assert np.array_equal(ids, ids_r) and np.array_equal(ids, seqs[i])
        for x, y in ((from_bits(aux), from_bits(aux_r)), (from_bits(fin), from_bits(fin_r))):
            c = cosine(x, y)
            assert c.mean() > 0.999 and c.min() > min_cosine, (i, c.mean().item(), c.min().item())
