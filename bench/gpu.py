"""GPU benchmark (issue: GPU performance), baseline figures of the current code on one H200.

    python -m bench.gpu [--layers 32] [--samples 48]

1. bf16 matmul peak (8192^3), measured in the same run.
2. Extraction, hf backend, a Llama-3.1-8B-shaped target with random bf16 weights: forward only
   (decoder, output_hidden_states, 4 x 2048) vs end to end through `extract_part` (bf16 bits,
   digest, zarr write, fsync; gate on 2 samples). tokens/s and MFU = 2 x non-embedding params x
   tokens / time / peak.
3. Drafter training step at 8B shapes (H 4096, 32/8 heads, I 14336, target vocab 128256, draft
   vocab 32000, TTT 7, seq 2048, bf16 autocast): tokens/s and peak memory.
"""
import argparse
import json
import os
import time
from pathlib import Path

import torch

OUT = Path(os.environ.get("BENCH_OUT", "bench/out/gpu"))


def cuda_time(fn, reps=5, warm=2):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--samples", type=int, default=48)
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    from eaglenest.backends.hf import HFBackend
    from eaglenest.drafter import DrafterConfig, Eagle3Drafter
    from eaglenest.errors import setup_logging
    from eaglenest.extract import extract_part
    from eaglenest.target import materialize
    from eaglenest.ttt import ttt_loss
    setup_logging()
    res = {"gpu": torch.cuda.get_device_name(0)}
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    peak = 2 * 8192**3 / cuda_time(lambda: a @ a, reps=10, warm=3)
    res["matmul_peak_tflops"] = round(peak / 1e12, 1)
    del a

    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    torch.manual_seed(0)
    # Build, save, and load back through from_pretrained like any target. (Using the freshly built
    # module directly is NOT equivalent: `.to(bfloat16)` also rounds RoPE's inv_freq buffer, and the
    # validation gate rejects those states: cosine 0.87 at tap 2, 0.48 at the final state.)
    mdir = OUT / "target" / "model"
    t = time.time()
    with torch.device("cuda"):
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(mdir)
    torch.cuda.empty_cache()
    target = materialize(str(mdir.resolve()), OUT / "target")
    res["save_and_fingerprint_s"] = round(time.time() - t, 1)
    taps = [2, args.layers // 2, args.layers - 3]
    be = HFBackend(target, taps, device="cuda")
    be._load()
    dec = be.decoder
    n_params = sum(p.numel() for n, p in dec.named_parameters() if "embed" not in n)
    ids = torch.randint(3, 128000, (4, 2048), device="cuda")
    with torch.inference_mode():
        fwd = cuda_time(lambda: dec(input_ids=ids, output_hidden_states=True, use_cache=False), reps=3)
    res["forward_only_tok_s"] = round(ids.numel() / fwd, 1)
    res["forward_only_mfu"] = round(2 * n_params * ids.numel() / fwd / peak, 3)
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eaglenest.chat import SCHEMA
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 128000, size=2048).tolist() for _ in range(args.samples)]
    pq.write_table(pa.table({"id": [f"s{i}" for i in range(len(seqs))], "input_ids": seqs,
                             "loss_mask": [[1] * 2048] * len(seqs), "n_tokens": [2048] * len(seqs)}, schema=SCHEMA),
                   OUT / "tok.parquet")
    for codec in ("none", "zstd"):
        m = extract_part(part=f"bench-{codec}", tokenized=OUT / "tok.parquet", target=target, backend=be, taps=taps,
                         dtype="bfloat16", revision=0,
                         layout_cfg=dict(chunk_mb=1, shard_mb=256, codec=codec, level=1),
                         # random 32-layer weights in bf16 drift more than trained SmolLM2 (rel err 0.063-0.067
                         # at taps 29 + final): thresholds are per target, so relax the relative error here
                         validate_cfg={"samples": 1, "max_rel_err_mean": 0.1, "max_rel_err_token": 0.3}, out_dir=OUT / f"store-{codec}", work_root=OUT / "work",
                         batch_tokens=8192, max_seq_len=2048, progress=False)
        res[f"end_to_end_{codec}"] = {"tok_s": m["tokens_per_s"], "mfu": round(2 * n_params * m["tokens_per_s"] / peak, 3),
                                      "bytes_per_token": m["bytes_per_token"], "gate_passed": m["validation"]["passed"],
                                      "GB_written": round(m["stored_bytes"] / 1e9, 2)}
        print(json.dumps(res), flush=True)
    del dec, be
    torch.cuda.empty_cache()

    # drafter training step at 8B shapes
    dcfg = DrafterConfig.from_target({**cfg.to_dict(), "num_hidden_layers": 32}, 32000, [2, 16, 29])
    drafter = Eagle3Drafter(dcfg).cuda()
    drafter.set_vocab(torch.arange(32000, device="cuda"))
    embed = torch.nn.Embedding(128256, 4096).cuda().to(torch.bfloat16).requires_grad_(False)
    head = torch.randn(32000, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4, fused=True)
    T = 2048
    batch = {"aux": torch.randn(1, T, 3, 4096, device="cuda"), "final": torch.randn(1, T, 4096, device="cuda"),
             "input_ids": torch.randint(0, 128000, (1, T), device="cuda"),
             "loss_mask": torch.ones(1, T, dtype=torch.long, device="cuda"),
             "in_vocab": torch.ones(1, T, dtype=torch.long, device="cuda")}

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = ttt_loss(drafter, batch, embed, head, 7, [float(T)] * 7)
        loss.backward()
        opt.step()
    torch.cuda.reset_peak_memory_stats()
    dt = cuda_time(step, reps=5, warm=2)
    res["train_step_ms"] = round(dt * 1000, 1)
    res["train_tok_s"] = round(T / dt, 1)
    res["train_peak_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    print(json.dumps(res, indent=2))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
