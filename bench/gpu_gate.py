"""The gate and long samples at the 8B shape on one H200. Not a
test: writes $OUT/gpu_gate.json (BENCH_OUT, default bench/out), merged by hand into
bench/results/scale.json and bench/RESULTS.md. Needs only the GPU image's torch and transformers.

    python -m bench.gpu_gate [--layers 32] [--samples 8] [--long 4096 8192]

1. A Llama-3.1-8B-shaped target with random bf16 weights, saved as sharded safetensors with an
   index (as large checkpoints are) on the local disk.
2. The gate's reference for `--samples` samples of 512-2,048 tokens, whole (the float32 model on the
   GPU) and streamed (one decoder layer at a time from the safetensors): load and states time, peak
   GPU memory (torch's allocator), one layer's float32 bytes, the weights' read rate, and whether
   the two give the same states.
3. Long samples: extraction (the hf backend as the stage runs it on CUDA: the own layers and their
   Triton kernels) of one sample of each `--long` length, and the drafter's training step (flex
   attention, fused loss, TTT 7) on one such sample: tokens/s and peak GPU memory.
"""

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from bench.gpu import llama8b, train_variant
from eaglenest.extraction.reference import Reference
from eaglenest.target.directory import Target

OUT = Path(os.environ.get("BENCH_OUT", "bench/out")) / "gpu_gate.json"
MODEL = Path("/tmp/gate8b")
TAPS = [2, 16, 29]


def peak_gb() -> float:
    """torch's allocator's peak since the last reset, in GB (1e9)."""
    return round(torch.cuda.max_memory_allocated() / 1e9, 2)


def build(layers: int) -> Target:
    from transformers import LlamaForCausalLM

    cfg = llama8b(layers)
    if not (MODEL / "model.safetensors.index.json").is_file():
        shutil.rmtree(MODEL, ignore_errors=True)
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        model.save_pretrained(MODEL, max_shard_size="5GB")
        del model
        torch.cuda.empty_cache()
    return Target("bench", MODEL, "bench", layers, cfg.hidden_size, cfg.vocab_size)


def drop_page_cache() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def reference(target: Target, samples: list, streamed: bool) -> tuple[dict, dict]:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t = time.time()
    ref = Reference(target, TAPS, "cuda:0", streamed=streamed)
    loaded = time.time()
    ref.precompute(samples)
    torch.cuda.synchronize()
    done = time.time()
    memory = ref.memory()
    states = {i: ref.states(s) for i, s in enumerate(samples)}
    states = {i: {k: v.cpu() for k, v in st.items()} for i, st in states.items()}
    out = {"load_s": round(loaded - t, 2), "states_s": round(done - loaded, 2), "peak_gb": peak_gb(), **memory}
    ref.keep_head_only()
    del ref
    torch.cuda.empty_cache()
    return out, states


def gate(target: Target, n: int) -> dict:
    rng = np.random.default_rng(0)
    samples = [rng.integers(3, 128000, size=int(rng.integers(512, 2049))) for _ in range(n)]
    tokens = sum(map(len, samples))
    whole, a = reference(target, samples, streamed=False)
    cold = drop_page_cache()  # the checkpoint was just written: read it from the disk, not from memory
    streamed, b = reference(target, samples, streamed=True)
    diff = max(float((a[i][k] - b[i][k]).abs().max()) for i in a for k in a[i])
    layer = streamed["layer_bytes"]
    return {
        "samples": n,
        "tokens": tokens,
        "whole": whole,
        "streamed": streamed,
        "page_cache_dropped": cold,
        "same_as_whole": diff == 0.0,
        "max_abs_diff": diff,
        "layer_gb": round(layer / 1e9, 3),
        "model_gb_fp32": round(streamed["model_bytes_fp32"] / 1e9, 2),
        "read_gb_s": round(streamed["read_bytes"] / 1e9 / max(streamed["read_s"], 1e-9), 2),
        "streamed_s_per_sample": round((streamed["load_s"] + streamed["states_s"]) / n, 2),
        "whole_s_per_sample": round((whole["load_s"] + whole["states_s"]) / n, 2),
    }


def long_samples(target: Target, lengths: list[int]) -> dict:
    import bench.gpu as gpu
    from eaglenest.drafter.config import DrafterConfig
    from eaglenest.extraction.backends.hf import HFBackend

    out = {}
    backend = HFBackend(target, TAPS, device="cuda:0")
    for n in lengths:
        ids = np.random.default_rng(n).integers(3, 128000, size=n).astype(np.int32)
        try:
            backend.extract([ids])  # warm (kernels built, this length seen)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t = time.time()
            for _ in range(3):
                backend.extract([ids])
            torch.cuda.synchronize()
            ex = {"tok_s": round(3 * n / (time.time() - t), 1), "peak_gb": peak_gb()}
        except torch.OutOfMemoryError as e:
            ex = {"error": f"OOM: {str(e)[:200]}"}
        out[str(n)] = {"extract": ex}
    backend.close()
    del backend
    torch.cuda.empty_cache()
    dcfg = DrafterConfig.from_target(llama8b(32).to_dict(), 32000, TAPS)
    for n in lengths:
        gpu.T = n  # train_variant's sequence length
        try:
            tr = train_variant(dcfg, "flex", True, True, True, reps=3)
            out[str(n)]["train"] = {"tok_s": tr["tok_s"], "peak_gb": round(tr["peak_GiB"] * 2**30 / 1e9, 2)}
        except torch.OutOfMemoryError as e:
            out[str(n)]["train"] = {"error": f"OOM: {str(e)[:200]}"}
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--long", type=int, nargs="*", default=[4096, 8192])
    ap.add_argument("--skip-gate", action="store_true")
    args = ap.parse_args()
    from eaglenest.runtime.errors import setup_logging

    setup_logging()
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "transformers": __import__("transformers").__version__}  # fmt: skip
    t = time.time()
    target = build(args.layers)
    res["build_s"] = round(time.time() - t, 1)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    if not args.skip_gate:
        res["streamed_reference"] = gate(target, args.samples)
        OUT.write_text(json.dumps(res, indent=1))
        print(json.dumps(res, indent=1), flush=True)
    if args.long:
        res["long"] = long_samples(target, args.long)
    OUT.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
