"""Where a batched self-distillation decode step spends its time (the GPU profile's generate stage
ran at 5.2k tok/s: 120-200 ms per step at ~1,000 rows, 10x what its KV-cache bytes explain).

    python -m bench.gpu_generate [--target data/target | --random] [--rows 1024] [--context 512]

Times one decode step through transformers' forward (growing KV cache, padding mask) and through
`static_decode` (one CUDA graph per step) over batch sizes, then `decode_batch` end to end both ways
(and how many rows decode to the same tokens), and prints the profiler's top CUDA kernels for the
graphed step. `--random` builds a
SmolLM2-135M-shaped model with random weights (speed does not depend on the weights), so it needs
no converted target on the GPU machine. Writes $OUT/gpu_generate.json when OUT is set."""

import argparse
import json
import os
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from eaglenest.decoding.batch_decode import HFStepper, decode_batch, left_pad
from eaglenest.decoding.static_decode import StaticDecoder
from eaglenest.target import load_model, load_target

SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


def random_model(attn: str):
    cfg = LlamaConfig(**SMOLLM2_135M)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation=attn).cuda().eval()


def prompts_for(B, L, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(10, 40000, (int(torch.randint(L // 2, L + 1, (1,), generator=g)),), generator=g).tolist()
        for _ in range(B)
    ]


def step_ms(model, B, L, n, static: bool, profile: bool = False) -> float:
    """ms per decode step over n steps after the prefill (the graph's capture not counted)."""
    ids, attn = left_pad(prompts_for(B, L), 0, "cuda")
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    st = StaticDecoder(model, B, ids.shape[1] + n + 2) if static else HFStepper(model, ids.shape[1] + n + 2)
    with torch.inference_mode():
        last = pos[:, -1]
        nxt = st.prefill(ids, attn, pos).argmax(-1)
        nxt = st.step(nxt, last + 1).argmax(-1)  # captures the graph
        torch.cuda.synchronize()
        prof = (
            torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            )
            if profile
            else None
        )
        if prof:
            prof.__enter__()
        t0 = time.perf_counter()
        for i in range(n):
            nxt = st.step(nxt, last + 2 + i).argmax(-1)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / n
        if prof:
            prof.__exit__(None, None, None)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10))
    return dt * 1e3


def end_to_end(model, B, L, new, static: bool) -> tuple[dict, list]:
    prompts = prompts_for(B, L, seed=1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    st = None if static else HFStepper(model, max(map(len, prompts)) + new)
    out = decode_batch(model, prompts, [new] * B, eos={-5}, pad_id=0, stepper=st)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    toks = sum(len(d.tokens) for d in out)
    return (
        {
            "rows": B,
            "context": L,
            "new": new,
            "static": static,
            "seconds": round(dt, 3),
            "tokens_per_s": round(toks / dt),
        },
        [d.tokens for d in out],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path("data/target"))
    ap.add_argument("--random", action="store_true", help="SmolLM2-135M shape, random weights")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 256, 1024, 4096])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    a = ap.parse_args()
    m = random_model("sdpa") if a.random else load_model(load_target(a.target), dtype="bfloat16", device="cuda")
    res: dict = {"steps_ms": {}, "decode_batch": []}
    for rows in a.rows:
        for static in (False, True):
            if not static and rows > 1024:
                continue  # the HF path's prefill of 4k x 512 does not fit beside the cache
            k = f"{'static graph' if static else 'transformers'} rows={rows} ctx={a.context}"
            res["steps_ms"][k] = round(step_ms(m, rows, a.context, a.steps, static), 2)
            print(
                f"{k:45s} {res['steps_ms'][k]:8.2f} ms/step = {rows / res['steps_ms'][k] * 1e3:9.0f} tok/s", flush=True
            )
    for rows in (256, 1024):
        (r1, t1), (r2, t2) = (end_to_end(m, rows, a.context, 128, s) for s in (False, True))
        same = sum(x == y for x, y in zip(t1, t2)) / rows
        res["decode_batch"] += [r1, r2]
        res[f"same_tokens_rows={rows}"] = same
        print(r1, r2, f"rows with identical tokens: {same:.3f}", flush=True)
    step_ms(m, 1024, a.context, 4, True, profile=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_generate.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
