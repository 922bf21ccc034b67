"""Multi-GPU benchmark (issue: multi-GPU run). Not a test: figures go to bench/RESULTS.md.

    python -m bench.multi_gpu all [--hidden 2048 --layers 16 --samples 192 --gpus 2]

On a random-weight Llama built from a config (no download) it measures
  - extraction: two parts one after the other on one GPU vs the two parts in parallel, one worker
    per GPU (each worker owns whole shards: its own part); stores compared sample by sample;
  - training: `Trainer` under torchrun with 1 vs N processes (DDP, NCCL), same global batch:
    loss curves compared, tokens/s and scaling efficiency.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

OUT = Path(os.environ.get("BENCH_OUT", "bench/out/multi_gpu"))


def build(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from eaglenest.data.chat import token_table, write_tokenized
    from eaglenest.target.directory import materialize

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.75),
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128,
        num_key_value_heads=max(1, args.hidden // 512),
        max_position_embeddings=4096,
    )
    model_dir = OUT / "target" / "model"
    with torch.device("cuda"):
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(model_dir)
    materialize(str(model_dir.resolve()), OUT / "target")
    rng = np.random.default_rng(0)
    for part in ("p0", "p1"):
        seqs = [
            rng.integers(3, 32000, size=int(rng.integers(args.seq // 2, args.seq + 1))) for _ in range(args.samples)
        ]
        masks = [(rng.random(len(s)) < 0.8).astype(np.uint8).tolist() for s in seqs]
        ids = [f"{part}-{i}" for i in range(len(seqs))]
        write_tokenized(token_table(seqs, ids, masks), OUT / "tokenized" / f"{part}.parquet")


def extract_one(part: str, out_root: str, device: str, seq: int) -> dict:
    from eaglenest.extraction.backends.hf import HFBackend
    from eaglenest.extraction.loop import extract_part
    from eaglenest.target.directory import load_target
    from eaglenest.target.taps import resolve_taps
    from stages import _params

    t = load_target(OUT / "target")
    taps = resolve_taps("auto", t.num_layers)
    return extract_part(
        part=part,
        tokenized=OUT / "tokenized" / f"{part}.parquet",
        target=t,
        backend=HFBackend(t, taps, device=device),
        taps=taps,
        dtype="bfloat16",
        revision=0,
        layout_cfg=dict(chunk_mb=1, shard_mb=256, codec="none", level=1),
        validate_cfg={**_params.load("validate"), "samples": 4},
        out_dir=Path(out_root) / part,
        work_root=Path(out_root) / "work",
        batch_tokens=16384,
        max_seq_len=seq,
        progress=False,
    )


def train_main(args):
    import torch.distributed as dist

    from eaglenest.drafter.train import Trainer
    from eaglenest.drafter.train_config import TrainConfig
    from eaglenest.target.directory import load_target
    from stages import _params

    cfg = TrainConfig.from_params(
        {
            **_params.load("train"),
            "epochs": 1,
            "lr": 1e-3,
            "ttt_steps": 7,
            "batch_tokens": args.seq * 4,
            "micro_batches": 4,
            "autocast": "bf16",
            "ckpt_every": 10**9,
            "device": "cuda",
        }
    )
    tr = Trainer(
        OUT / "packed", OUT / "one", load_target(OUT / "target"), cfg, OUT / f"ckpt-{os.environ.get('WORLD_SIZE')}"
    )
    if tr.ckpt_path.exists():
        tr.ckpt_path.unlink()
    r = tr.fit(progress=False)
    if tr.rank == 0:
        (OUT / f"train-{tr.world}.json").write_text(
            json.dumps({"history": [h["loss"] for h in r["history"]], "tokens_per_s": r["tokens_per_s"]})
        )
    if dist.is_initialized():
        dist.destroy_process_group()


def run_all(args):
    import torch

    from eaglenest.data.pack import pack
    from eaglenest.data.teacher import teach_parts
    from eaglenest.store.hidden_store import HiddenStore
    from eaglenest.target.directory import load_target
    from eaglenest.target.loading import load_heads

    res = {
        "gpus": torch.cuda.device_count(),
        "gpu": torch.cuda.get_device_name(0),
        "hidden": args.hidden,
        "layers": args.layers,
    }
    build(args)
    me = [sys.executable, "-m", "bench.multi_gpu"]
    common = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--seq", str(args.seq)]
    t = time.time()
    for part in ("p0", "p1"):
        subprocess.run(me + ["extract-one", part, str(OUT / "one"), "cuda:0"] + common, check=True)
    res["extract_one_gpu_s"] = round(time.time() - t, 2)
    t = time.time()
    procs = [
        subprocess.Popen(
            me + ["extract-one", part, str(OUT / "two"), "cuda:0"] + common,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": str(i)},
        )
        for i, part in enumerate(("p0", "p1"))
    ]
    assert all(p.wait() == 0 for p in procs)
    res["extract_two_gpus_s"] = round(time.time() - t, 2)
    tokens = 0
    same = True
    for part in ("p0", "p1"):
        a, b = HiddenStore(OUT / "one" / part), HiddenStore(OUT / "two" / part)
        tokens += a.n_tokens
        same &= [(r["key"], r["digest"]) for r in a.index] == [(r["key"], r["digest"]) for r in b.index]
        res[f"gate_{part}"] = json.loads(json.dumps(a.attrs.get("layout")))
    res["tokens"] = tokens
    res["stores_identical"] = bool(same)
    res["extract_tok_s_one_gpu"] = round(tokens / res["extract_one_gpu_s"], 1)
    res["extract_tok_s_two_gpus"] = round(tokens / res["extract_two_gpus_s"], 1)
    t = time.time()
    head = load_heads(load_target(OUT / "target"))["lm_head"]
    teach_parts(["p0", "p1"], OUT / "one", OUT / "tokenized", OUT / "teacher", head, device="cuda", progress=False)
    pack(["p0", "p1"], OUT / "one", OUT / "tokenized", OUT / "teacher", OUT / "packed", 8192, 0.05)
    res["pack_s"] = round(time.time() - t, 2)
    for n in (1, args.gpus):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(n),
                "-m",
                "bench.multi_gpu",
                "train",
            ]
            + common,
            check=True,
        )
    one = json.loads((OUT / "train-1.json").read_text())
    many = json.loads((OUT / f"train-{args.gpus}.json").read_text())
    h1, hn = np.array(one["history"]), np.array(many["history"])
    res.update(
        train_steps=len(h1),
        train_tok_s_1=one["tokens_per_s"],
        train_tok_s_n=many["tokens_per_s"],
        scaling_efficiency=round(many["tokens_per_s"] / (args.gpus * one["tokens_per_s"]), 3),
        loss_first_last_1=[float(h1[0]), float(h1[-1])],
        loss_first_last_n=[float(hn[0]), float(hn[-1])],
        loss_max_rel_diff=float(np.max(np.abs(h1 - hn) / np.abs(h1))),
    )
    print(json.dumps(res, indent=2))
    (OUT / "results.json").write_text(json.dumps(res, indent=2))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["all", "extract-one", "train"])
    ap.add_argument("rest", nargs="*")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--samples", type=int, default=192)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--gpus", type=int, default=2)
    args = ap.parse_args()
    from eaglenest.runtime.errors import setup_logging

    setup_logging()
    if args.cmd == "all":
        run_all(args)
    elif args.cmd == "extract-one":
        print(json.dumps({k: v for k, v in extract_one(*args.rest, seq=args.seq).items() if k != "validation"}))
    else:
        train_main(args)


if __name__ == "__main__":
    main()
