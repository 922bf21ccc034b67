"""Where a batched self-distillation decode step spends its time (the GPU profile's generate stage
ran at 5.2k tok/s: 120-200 ms per step at ~1,000 rows, 10x what its KV-cache bytes explain).

    python -m bench.gpu_generate --target data/target [--rows 1024] [--context 512] [--steps 16]

Times a decode step of `eaglenest.batch_decode`'s forward (left padding mask, growing KV cache)
against the same step without the padding mask and with transformers' DynamicCache, and prints
the profiler's top CUDA kernels and CPU ops for the masked step."""
import argparse
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from eaglenest.kv_cache import cache_kwarg, growing_cache
from eaglenest.target import load_model, load_target


def steps(model, B, L, n, mask: bool, cache_fn, profile: bool = False) -> float:
    dev = next(model.parameters()).device
    ids = torch.randint(10, 40000, (B, L), device=dev)
    attn = torch.ones(B, L, dtype=torch.long, device=dev)
    attn[::2, : L // 5] = 0  # half the rows left-padded
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    cache, kw = cache_fn(L + n), cache_kwarg(model)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=attn if mask else None, position_ids=pos, logits_to_keep=1, **{kw: cache})
        last, x = pos[:, -1], ids[:, -1:]
        torch.cuda.synchronize()
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA]) if profile else None
        t0 = time.perf_counter()
        if prof:
            prof.__enter__()
        for _ in range(n):
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
            last = last + 1
            model(input_ids=x, attention_mask=attn if mask else None, position_ids=last[:, None], logits_to_keep=1,
                  **{kw: cache})
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / n
        if prof:
            prof.__exit__(None, None, None)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12))
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path("data/target"))
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    a = ap.parse_args()
    model = load_model(load_target(a.target), dtype="bfloat16", device="cuda")
    for name, mask, fn in (("growing cache, padding mask", True, lambda r: growing_cache(r)),
                           ("growing cache, no mask", False, lambda r: growing_cache(r)),
                           ("DynamicCache, padding mask", True, lambda r: DynamicCache())):
        dt = steps(model, a.rows, a.context, a.steps, mask, fn)
        print(f"{name:30s} {dt * 1e3:7.1f} ms/step = {a.rows / dt:9.0f} tok/s")
    steps(model, a.rows, a.context, 4, True, lambda r: growing_cache(r), profile=True)


if __name__ == "__main__":
    main()
