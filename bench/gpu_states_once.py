"""Training that reads the stores against training that read pack's copies, on one H200 (issue: states
stored once). Not a test: writes $BENCH_OUT/gpu_states_once.json (default bench/out).

    python -m bench.gpu_states_once --old OLD [--wheels DIR] [--samples 64] [--steps 40]

OLD: a checkout of the last code whose pack copied the states (ab0f517: `git archive ab0f517 eaglenest
stages params.yaml`); DIR: wheels the host lacks (zarr and its codecs), installed into /tmp/site.
A Llama-3.1-8B-shaped target with random bf16 weights; `--samples` samples of 2,048 tokens extracted
(the hf backend's own layers, no gate: synthetic states) into a bf16 + zstd store and an fp8 + zstd
one; each packed by this code (an index: no state copied) and the bf16 one by OLD's (copies in .npy
shards); then the real Trainer's step (TTT 7, one sample a step, as `bench.gpu`'s trainer figure) for
`--steps` steps after 3 of warm-up: tokens/s, with this code's loader processes (train.loader_workers
auto) and with OLD's thread over memory-mapped shards."""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(os.environ.get("BENCH_OUT", "bench/out")) / "gpu_states_once.json"
WS = Path("/tmp/states-once")
T = 2048
TRAIN = """
import json, sys, time, torch
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from eaglenest.target.loading import load_heads
from eaglenest.drafter.train import Trainer
from eaglenest.drafter.train_config import TrainConfig
from stages import _params
ws, T, steps, target_json = Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
from eaglenest.target.directory import Target
target = Target(**{**target_json, "model_dir": Path(target_json["model_dir"])})
from eaglenest.data.pack import pack
t = time.time()
pack(["p"], ws / "bf16" / "hidden", ws / "tokenized", ws / "old-packed", lm_head=load_heads(target)["lm_head"],
     draft_vocab_size=32000, val_fraction=0.05, shard_mb=256, progress=False, device="cuda")
pack_s = time.time() - t
cfg = TrainConfig.from_params({**_params.load("train"), "ttt_steps": 7, "batch_tokens": T, "micro_batches": 1,
                               "device": "cuda"})
tr = Trainer(ws / "old-packed", target, cfg, ws / "old-ckpt")
plan = [[[i]] for i in range(len(tr.train_split))][: steps + 3]
from concurrent.futures import ThreadPoolExecutor
with ThreadPoolExecutor(1) as loader:
    for s, (micro, loaded) in enumerate(tr.prefetched(plan, loader)):
        if s == 3:
            torch.cuda.synchronize(); t = time.time()
        float(tr.train_step(micro, loaded)[0, 0])
dt = time.time() - t
size = sum(f.stat().st_size for f in (ws / "old-packed").rglob("*") if f.is_file())
print(json.dumps({"tok_s": round((len(plan) - 3) * T / dt, 1), "pack_s": round(pack_s, 1), "pack_bytes": size}))
"""


def install(wheels: Path) -> None:
    site = Path("/tmp/site")
    if not (site / "zarr").is_dir():
        whl = [str(p) for p in sorted(wheels.glob("*.whl"))]
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), *whl],
                       check=True)  # fmt: skip
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))


def extract(target, states: str, seqs: list) -> dict:
    from eaglenest.extraction.backends.hf import HFBackend
    from eaglenest.extraction.loop import extract_part

    t = time.time()
    m = extract_part(part="p", tokenized=WS / "tokenized" / "p.parquet", target=target,
                     backend=HFBackend(target, [2, 16, 29], device="cuda:0", states=states), taps=[2, 16, 29],
                     dtype="bfloat16", revision=0, validate_cfg={"samples": 0}, out_dir=WS / states / "hidden" / "p",
                     layout_cfg=dict(chunk_mb=16, shard_mb=256, codec="zstd", level=1, states=states),
                     work_root=WS / "work", batch_tokens=16384, max_seq_len=T, progress=False)  # fmt: skip
    return {"extract_s": round(time.time() - t, 1), "stored_bytes": m["stored_bytes"]}


def train_new(target, states: str, steps: int, workers: int) -> dict:
    import torch

    from eaglenest.data.pack import pack
    from eaglenest.data.teacher import teach_parts
    from eaglenest.drafter.train import Trainer
    from eaglenest.drafter.train_config import TrainConfig
    from eaglenest.target.loading import load_heads
    from stages import _params

    hidden, packed = WS / states / "hidden", WS / states / "packed"
    t = time.time()
    teach_parts(["p"], hidden, WS / "tokenized", WS / states / "teacher", load_heads(target)["lm_head"],
                device="cuda", progress=False)  # fmt: skip
    figures = pack(["p"], hidden, WS / "tokenized", WS / states / "teacher", packed, 32000, 0.05)
    pack_s = time.time() - t
    cfg = TrainConfig.from_params(
        {**_params.load("train"), "ttt_steps": 7, "batch_tokens": T, "micro_batches": 1, "device": "cuda"}
    )
    tr = Trainer(packed, hidden, target, cfg, WS / states / "ckpt")
    plan = [[[i]] for i in range(len(tr.train_split))][: steps + 3]
    from concurrent.futures import ThreadPoolExecutor

    try:
        ahead = tr.start_loader(workers)
        pinned = tr.loader.pinned
        with ThreadPoolExecutor(ahead) as loader:  # as `Trainer.fit` runs them
            for s, (micro, loaded) in enumerate(tr.prefetched(plan, loader, ahead)):
                if s == 3:
                    torch.cuda.synchronize()
                    t = time.time()
                float(tr.train_step(micro, loaded)[0, 0])
        dt = time.time() - t
    finally:
        tr.loader.close()
    out = {"tok_s": round((len(plan) - 3) * T / dt, 1), "pack_s": round(pack_s, 1), "loader_workers": workers,
           "pinned": pinned, "ahead": ahead}  # fmt: skip
    return {**out, "pack_bytes": figures["pack_bytes"], "store_bytes": figures["store_bytes"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", type=Path, required=True)
    ap.add_argument("--wheels", type=Path)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--workers", type=int, default=min(8, max(1, (os.cpu_count() or 2) // 4)),
                    help="loader processes (default: train.loader_workers auto on CUDA)")  # fmt: skip
    ap.add_argument("--part", choices=["all", "stores", "npy"], default="all",
                    help="stores: extract, pack and train this code's way; npy: OLD's on the same stores (a "
                    "second call on the same machine)")  # fmt: skip
    args = ap.parse_args()
    if args.wheels:
        install(args.wheels)
    import numpy as np

    from bench.gpu_gate import build
    from eaglenest.data import chat
    from eaglenest.runtime.errors import setup_logging

    setup_logging()
    target = build(32)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    res = json.loads(OUT.read_text()) if OUT.is_file() else {}
    if args.part in ("all", "stores"):
        rng = np.random.default_rng(0)
        seqs = [rng.integers(3, 128000, size=T).astype(np.int32) for _ in range(args.samples)]
        (WS / "tokenized").mkdir(parents=True, exist_ok=True)
        names = [f"s{i}" for i in range(len(seqs))]
        chat.write_tokenized(chat.token_table(seqs, names), WS / "tokenized" / "p.parquet")
        res.update(samples=args.samples, tokens=args.samples * T, cpus=os.cpu_count())
        for states in ("bf16", "fp8"):
            res[f"extract_{states}"] = extract(target, states, seqs)
        for states in ("bf16", "fp8"):
            res[f"stores_{states}"] = train_new(target, states, args.steps, args.workers)
            OUT.write_text(json.dumps(res, indent=1))
            print(json.dumps(res), flush=True)
    if args.part == "stores":
        return
    tj = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(target).items()}
    old = subprocess.run([sys.executable, "-c", TRAIN, str(args.old.resolve()), str(WS), str(T), str(args.steps),
                          json.dumps(tj)], cwd=args.old, capture_output=True, text=True)  # fmt: skip
    res["npy"] = (
        json.loads(old.stdout.strip().splitlines()[-1]) if old.returncode == 0 else {"error": old.stderr[-2000:]}
    )
    print(json.dumps({"npy": res["npy"]}), flush=True)
    for states in ("bf16", "fp8"):
        if "tok_s" in res["npy"] and f"stores_{states}" in res:
            res[f"ratio_{states}_to_npy"] = round(res[f"stores_{states}"]["tok_s"] / res["npy"]["tok_s"], 3)
    OUT.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
