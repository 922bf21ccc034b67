"""Drafter training on short, varied samples (CUDA): the batches `epoch_batches` makes without
and with length buckets, timed through the trainer's own step (SmolLM2 shapes, TTT 7, flex
attention and blocks compiled, fused loss, AdamW), compilation included as a run pays it.

Why: self-distilled first-turn data has every length from ~60 to 640 tokens. The flex TTT kernel
was compiled for fixed shapes, and its keys grow by T at each of the K steps: K x every batch
length was too many shapes, torch hit its recompile limit and ran the eager kernel (the GPU
profile fell from 142k to 5.6k tok/s). Now the kernel is compiled with dynamic shapes and the
batches come in length buckets (less padding too). Synthetic states, uniform lengths in [60, 640].
`steady_tok_s` times the second half of the steps (compilation is done by then); `tok_s` all.

    python -m bench.gpu_train_shapes [--steps 150] [--out bench/out/gpu_train_shapes.json]
"""

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from eaglenest.data.packed import batch_shape, bucket_width, epoch_batches
from eaglenest.drafter.config import DrafterConfig
from eaglenest.drafter.model import Eagle3Drafter, FrozenEmbedding
from eaglenest.drafter.ttt import ttt_loss

SMOLLM2 = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "num_hidden_layers": 30,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "vocab_size": 49152,
}


class Lengths:  # what epoch_batches reads of a packed split
    def __init__(self, n: int, lo: int, hi: int, seed: int = 0):
        self.n = np.random.default_rng(seed).integers(lo, hi + 1, n).tolist()

    def __len__(self):
        return len(self.n)

    def length(self, i):
        return self.n[i]


def run(bucket: int, lengths: Lengths, steps: int, batch_tokens: int, K: int = 7, vd: int = 16384) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target(SMOLLM2, vd, [2, 15, 27], 6144)
    model = Eagle3Drafter(cfg).cuda()
    model.set_attention("flex")
    model.compile_blocks()
    H, V = SMOLLM2["hidden_size"], SMOLLM2["vocab_size"]
    embed = FrozenEmbedding(torch.randn(V, H, dtype=torch.bfloat16) * 0.02).cuda()
    head = torch.randn(vd, H, device="cuda", dtype=torch.bfloat16) * 0.02
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batches = epoch_batches(lengths, 0, 0, batch_tokens, bucket)[:steps]
    shapes = [batch_shape([lengths.length(i) for i in b], bucket, batch_tokens) for b in batches]
    real = padded = 0
    torch.cuda.synchronize()
    t0 = time.time()
    half = len(batches) // 2
    for s, (b, (B, T)) in enumerate(zip(batches, shapes)):
        if s == half:
            t_half, real_half = time.time(), real
        n = torch.tensor([lengths.length(i) for i in b], device="cuda")
        live = torch.zeros(B, T, device="cuda", dtype=torch.long)
        live[: len(b)] = (torch.arange(T, device="cuda")[None] < n[:, None]).long()
        batch = {
            "aux": torch.randn(B, T, 3, H, device="cuda"),
            "final": torch.randn(B, T, H, device="cuda"),
            "input_ids": torch.randint(3, V, (B, T), device="cuda") * live,
            "loss_mask": live,
            "in_vocab": live,
        }
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = ttt_loss(model, batch, embed, head, K, [float(live.sum())] * K)
        loss.backward()
        opt.step()
        float(loss)  # the trainer reads the loss back every step
        real += int(n.sum())
        padded += B * T
    dt = time.time() - t0
    return {
        "bucket": bucket,
        "steps": len(batches),
        "distinct_shapes": len(set(shapes)),
        "seconds": round(dt, 1),
        "tok_s": round(real / dt, 1),
        "steady_tok_s": round((real - real_half) / (time.time() - t_half), 1),
        "padding": round(1 - real / padded, 3),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--samples", type=int, default=30000)
    ap.add_argument("--out", type=Path, default=Path("bench/out/gpu_train_shapes.json"))
    a = ap.parse_args()
    lengths = Lengths(a.samples, 60, 640)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": []}
    for bucket in (bucket_width(640), 0):  # bucketed first: the unbucketed run may fall back to eager
        res["runs"].append(run(bucket, lengths, a.steps, a.batch_tokens))
        print(json.dumps(res["runs"][-1]), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
