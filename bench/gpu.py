"""GPU benchmark on one H200. Every variant runs in the same process,
on the same GPU, against a bf16 matmul peak measured in the same run.

    python -m bench.gpu [--layers 32] [--samples 96] [--skip-extract] [--skip-train]

1. Extraction, hf backend, a Llama-3.1-8B-shaped target with random bf16 weights (built from a
   config, saved and loaded back): forward only (decoder, output_hidden_states, 4 x 2048, no
   padding mask as extract runs it; also with an all-ones mask), eager and with each decoder
   layer compiled (`extract.hf.compile`, the CUDA default); the host path alone (pinned D2H +
   fill + digest + shard encode + write + fsync, fed from GPU tensors with no model); end to end
   through `extract_part`, codec none and zstd, eager and compiled, bf16 states and fp8 (quantized
   on the GPU, `store.states`; run names `..._fp8_<codec>`), each with its `host_path`
   report (where the loop waited, what the writers spent); between the two, `backend_only_*`:
   the backend's own pipeline (forward, quantize, copy out) with no store. MFU = 2 x
   non-embedding params x tokens / time / peak (the decoder only: extraction never computes the
   lm_head), against the short matmul peak; `matmul_sustained` and each run's `gpu_clocks` (SM
   clock, power, NVML's power-cap flag; needs `nvidia-ml-py`) show what the GPU held meanwhile.
2. Drafter training step at 8B shapes (H 4096, 32/8 heads, I 14336, target vocab 128256, draft vocab
   32000, TTT 7, seq 2048, bf16 autocast, fp32 master weights, fused AdamW, grad clip), one lever
   at a time: eager attention + plain loss (the old step), flex attention + fused loss (its chunk
   math eager, then compiled), + the layer compiled around the attention kernel. tokens/s, peak
   memory (after forward + loss, after backward), `--profile`: GPU time by kernel family.
3. Loader: the zstd store packed, its train split read as the trainer reads it, in GB/s.
Writes bench/out/gpu/results.json (BENCH_OUT overrides the directory).
"""

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch

from bench.gpu_clocks import ClockSampler
from stages import _params

OUT = Path(os.environ.get("BENCH_OUT", "bench/out/gpu"))
T = 2048
LOADER_PART = "end_to_end_plain_zstd"


def cuda_time(fn, reps=5, warm=2):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def log(res):
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res), flush=True)


def matmul_peak() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / cuda_time(lambda: a @ a, reps=20, warm=5)


def matmul_sustained(res, clocks, seconds: float = 4.0) -> None:
    """The same matmul back to back for seconds, as a long forward runs its GEMMs: with the clocks
    it shows what the GPU holds at its power limit (MFU stays against the short `matmul_peak`)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    reps = max(1, int(seconds * res["matmul_peak_tflops"] * 1e12 / (2 * 8192**3)))
    out = res.setdefault("matmul_sustained", {})
    with clocks.window(out):
        out["tflops"] = round(2 * 8192**3 / cuda_time(lambda: a @ a, reps=reps, warm=5) / 1e12, 1)


def llama8b(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )


class GpuTensorBackend:
    """No model: hands out slices of one GPU tensor, so only the host path is timed."""

    def __init__(self, hf_backend, taps, hidden):
        self.inner = hf_backend
        self.aux = torch.randn(8192, len(taps), hidden, device="cuda", dtype=torch.bfloat16)
        self.final = torch.randn(8192, hidden, device="cuda", dtype=torch.bfloat16)

    def describe(self):
        return self.inner.describe()

    def extract(self, batch):
        out = []
        for x in batch:
            n = len(x)
            a = torch.empty((n, *self.aux.shape[1:]), dtype=torch.bfloat16, pin_memory=True)
            f = torch.empty((n, self.final.shape[1]), dtype=torch.bfloat16, pin_memory=True)
            a.copy_(self.aux[:n], non_blocking=True)
            f.copy_(self.final[:n], non_blocking=True)
            out.append((a, f))
        torch.cuda.synchronize()
        return out

    def close(self):
        pass


def backend_only(be, seqs, batch: int, n_batches: int) -> float:
    """Seconds for n_batches through the backend's own pipeline as extract runs it (the next batch
    launched before this one's states are awaited; forward, fp8 quantize, copy to pinned host
    memory) with no store behind it: end to end with an infinitely fast host path."""
    import numpy as np

    batches = [[np.asarray(x) for x in seqs[i * batch : (i + 1) * batch]] for i in range(n_batches)]
    for b in batches[:2]:  # warm: pinned blocks of these sizes, the quantize kernels
        be.extract(b)
    torch.cuda.synchronize()
    t, prev = time.perf_counter(), None
    for b in batches:
        wait = be.extract_async(b)
        if prev is not None:
            prev()
        prev = wait
    prev()
    return time.perf_counter() - t


def bench_extraction(res, args, peak, clocks):
    import numpy as np
    from transformers import LlamaForCausalLM

    from eaglenest.data.chat import token_table, write_tokenized
    from eaglenest.extraction.backends.hf import HFBackend
    from eaglenest.extraction.loop import extract_part
    from eaglenest.target.directory import materialize

    cfg = llama8b(args.layers)
    torch.manual_seed(0)
    # Saved and loaded back through from_pretrained like any target: `.to(bfloat16)` on the fresh
    # module would also round RoPE's inv_freq buffer (the gate rejects those states).
    mdir = OUT / "target" / "model"
    t = time.time()
    if not (mdir / "config.json").exists():
        with torch.device("cuda"):
            LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(mdir)
        torch.cuda.empty_cache()
    target = materialize(str(mdir.resolve()), OUT / "target")
    res["extract_setup_s"] = round(time.time() - t, 1)
    taps = [2, args.layers // 2, args.layers - 3]
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 128000, size=T).tolist() for _ in range(args.samples)]
    write_tokenized(token_table(seqs), OUT / "tok.parquet")
    ids = torch.randint(3, 128000, (args.batch_tokens // T, T), device="cuda")  # no mask, as extract runs it
    for compiled in (False, True) if args.compile else (False,):
        be = HFBackend(target, taps, device="cuda", compile=compiled)
        be.load()
        n_params = sum(p.numel() for n, p in be.decoder.named_parameters() if "embed" not in n)
        tag = "compiled" if compiled else "plain"
        t = time.time()
        with torch.inference_mode():
            if not be.warm:
                be.warm_up(ids)  # the compile, as before a part's first batch
            be.decoder(input_ids=ids, output_hidden_states=True, use_cache=False)  # compiles
        res[f"forward_{tag}_first_call_s"] = round(time.time() - t, 1)
        fwd_clocks = {}
        with torch.inference_mode():

            def forward(be=be):
                return be.decoder(input_ids=ids, output_hidden_states=True, use_cache=False)

            with clocks.window(fwd_clocks):
                fwd = cuda_time(forward, reps=10)
            masked = cuda_time(
                lambda be=be: be.decoder(
                    input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True, use_cache=False
                ),
                reps=3,
            )
            prof = kernel_profile(forward) if args.profile else None
        res[f"forward_only_{tag}"] = {
            "tok_s": round(ids.numel() / fwd, 1),
            "mfu": round(2 * n_params * ids.numel() / fwd / peak, 3),
            "with_padding_mask_tok_s": round(ids.numel() / masked, 1),
            **fwd_clocks,
            **({"profile": prof} if prof else {}),
        }
        log(res)
        if compiled:
            for states in ("bf16", "fp8"):
                be.states, out = states, {}
                n = min(args.backend_batches, len(seqs) // (args.batch_tokens // T))
                with clocks.window(out):
                    dt = backend_only(be, seqs, args.batch_tokens // T, n)
                toks = n * args.batch_tokens
                res[f"backend_only_{tag}_{states}"] = {
                    "tok_s": round(toks / dt, 1),
                    "mfu": round(2 * n_params * toks / dt / peak, 3),
                    **out,
                }
                log(res)
        runs = [(codec, be, states) for states in ("bf16", "fp8") for codec in ("none", "zstd")]
        if not compiled:
            host = GpuTensorBackend(be, taps, 4096)
            runs = [("none", host, "bf16"), ("zstd", host, "bf16")] + runs
            del host  # it holds the eager model: freed with `runs` below
        for (codec, backend, states), shard_mb, rep in [
            (r, mb, k) for r in runs for mb in args.shard_mb for k in range(args.repeat)
        ]:
            name = (
                ("host_path_only" if backend is not be else f"end_to_end_{tag}")
                + ("_fp8" if states == "fp8" else "")
                + f"_{codec}"
            )
            if args.only and name not in args.only:
                continue
            name += f"_shard{shard_mb}" if len(args.shard_mb) > 1 else ""
            name += f"_r{rep + 1}" if args.repeat > 1 else ""
            be.states = states  # fp8: quantized on the GPU before the copy out, as extract runs it
            layout = dict(chunk_mb=1, shard_mb=shard_mb, codec=codec, level=1, states=states)
            # random 32-layer bf16 weights drift more than a trained model (rel err ~0.065 at the deep
            # taps): thresholds are per target. The host-only run stores random states, so its gate is
            # skipped (samples 0).
            gate = {
                **_params.load("validate"),
                "samples": 0 if backend is not be else 1,
                "max_rel_err_mean": 0.1,
                "max_rel_err_token": 0.3,
            }
            run_clocks = {}
            with clocks.window(run_clocks):
                m = extract_part(
                    part=name,
                    tokenized=OUT / "tok.parquet",
                    target=target,
                    backend=backend,
                    taps=taps,
                    dtype="bfloat16",
                    revision=0,
                    layout_cfg=layout,
                    validate_cfg=gate,
                    out_dir=OUT / f"store-{name}",
                    work_root=OUT / "work",
                    max_seq_len=T,
                    progress=False,
                    writers=args.writers,
                    batch_tokens=args.batch_tokens,
                )
            hp = m["host_path"]  # while the forwards ran: without the last pieces' write after the last one
            steady = m["tokens_extracted_now"] / (hp["launch_s"] + hp["wait_backend_s"] + hp["wait_writers_s"])
            res[name] = {
                "tok_s": m["tokens_per_s"],
                "mfu": round(2 * n_params * m["tokens_per_s"] / peak, 3),
                "steady_tok_s": round(steady, 1),
                "steady_mfu": round(2 * n_params * steady / peak, 3),
                "bytes_per_token": m["bytes_per_token"],
                "GB_written": round(m["stored_bytes"] / 1e9, 2),
                "gate_passed": m["validation"].get("passed"),
                "host_path": m["host_path"],
                "gate": {
                    k: {f: round(v[f], 5) for f in ("cosine_mean", "cosine_min", "rel_err_mean", "rel_err_max")}
                    for k, v in m["validation"].get("taps", {}).items()
                },
                **run_clocks,
                # the target alone should remain: the gate's fp32 reference is freed with it
                "gpu_allocated_after_GiB": round(torch.cuda.memory_allocated() / 2**30, 1),
            }
            log(res)
            if name == LOADER_PART:  # kept for the loader bench
                (OUT / "hidden").mkdir(exist_ok=True)
                (OUT / "tokenized").mkdir(exist_ok=True)
                shutil.rmtree(OUT / "hidden" / name, ignore_errors=True)
                shutil.move(str(OUT / f"store-{name}"), str(OUT / "hidden" / name))
                shutil.copy(OUT / "tok.parquet", OUT / "tokenized" / f"{name}.parquet")
            shutil.rmtree(OUT / f"store-{name}", ignore_errors=True)
        if compiled:
            from torch._dynamo.utils import counters

            res["compile_stats"] = dict(counters["stats"])  # unique graphs: a recompile storm shows here
            log(res)
        be = backend = runs = None  # the next variant's model gets the memory
        torch.cuda.empty_cache()
    return target


def train_variant(
    dcfg,
    attention: str,
    fused: bool,
    compile_layer: bool,
    loss_kernel: bool = True,
    reps: int = 6,
    profile: bool = False,
) -> dict:
    from eaglenest.drafter.model import Eagle3Drafter, FrozenEmbedding
    from eaglenest.drafter.ttt import ttt_loss

    torch.manual_seed(0)
    drafter = Eagle3Drafter(dcfg).cuda()
    drafter.set_vocab(torch.arange(32000, device="cuda"))
    drafter.set_attention(attention)
    if compile_layer:
        drafter.compile_blocks()
    embed = FrozenEmbedding(torch.randn(128256, 4096, dtype=torch.bfloat16) * 0.02).cuda()
    head = torch.randn(32000, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    batch = {
        "aux": torch.randn(1, T, 3, 4096, device="cuda", generator=g),  # fp32, as the trainer feeds it
        "final": torch.randn(1, T, 4096, device="cuda", generator=g),
        "input_ids": torch.randint(0, 128000, (1, T), device="cuda", generator=g),
        "loss_mask": torch.ones(1, T, dtype=torch.long, device="cuda"),
        "in_vocab": torch.ones(1, T, dtype=torch.long, device="cuda"),
    }
    losses, phases = [], {}

    def step(record=False):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = ttt_loss(drafter, batch, embed, head, 7, [float(T)] * 7, fused=fused, compile_kernel=loss_kernel)
        if record:
            phases["after_forward_and_loss_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        loss.backward()
        if record:
            phases["after_backward_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 0.5)
        opt.step()
        losses.append(loss.detach())

    torch.cuda.synchronize()
    t = time.time()
    step()
    torch.cuda.synchronize()
    first = time.time() - t
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step(record=True)
    dt = cuda_time(step, reps=reps, warm=1)
    out = {
        "step_ms": round(dt * 1000, 1),
        "tok_s": round(T / dt, 1),
        "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        **phases,
        "first_step_s": round(first, 1),
        "first_loss": round(losses[0].item(), 5),
    }
    if profile:
        out["profile"] = kernel_profile(step)
    drafter = opt = embed = head = batch = None  # memory back before the next variant (`step` holds them)
    torch.cuda.empty_cache()
    return out


def kernel_profile(fn) -> dict:
    """GPU time of one step by kernel family, and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    fam = {}
    rows = []
    for e in prof.key_averages():
        us = e.self_device_time_total
        if us <= 0:
            continue
        n = e.key.lower()
        f = (
            "gemm"
            if any(x in n for x in ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas"))
            else "flex_attention"
            if "flex" in n or "triton_tem" in n
            else "sdpa attention"
            if any(x in n for x in ("flash", "fmha", "efficient_attention"))
            else "triton (compiled)"
            if "triton" in n
            else "elementwise/other"
        )
        fam[f] = fam.get(f, 0) + us
        rows.append((us, e.count, e.key[:90]))
    rows.sort(reverse=True)
    return {
        "ms_by_family": {k: round(v / 1000, 2) for k, v in sorted(fam.items(), key=lambda x: -x[1])},
        "gpu_ms_total": round(sum(fam.values()) / 1000, 2),
        "top": [{"ms": round(us / 1000, 2), "calls": c, "kernel": k} for us, c, k in rows[:15]],
    }


def bench_training(res, args):
    from eaglenest.drafter.config import DrafterConfig

    dcfg = DrafterConfig.from_target(llama8b(32).to_dict(), 32000, [2, 16, 29])
    # (attention, fused loss, compiled layer, compiled loss kernel)
    variants = [
        ("eager", False, False, False),
        ("flex", True, False, False),
        ("flex", True, False, True),
        ("flex", True, True, True),
    ]
    for attention, fused, comp, kernel in variants:
        name = (
            f"train_{attention}_{'fusedloss' if fused else 'plainloss'}{'_kernel' if kernel else ''}"
            f"{'_compiled' if comp else ''}"
        )
        if args.only and name not in args.only:
            continue
        try:
            res[name] = train_variant(
                dcfg,
                attention,
                fused,
                comp,
                kernel,
                profile=args.profile and (attention, fused, kernel) == ("flex", True, True),
            )
        except torch.OutOfMemoryError as e:
            res[name] = {"error": f"OOM: {str(e)[:200]}"}
            torch.cuda.empty_cache()
        log(res)


def bench_loader(res, target):
    """Pack the last end-to-end store, then read the train split as the trainer does (random
    order, one 2048-token sample per batch, collate to torch tensors): GB/s, vs what the fastest
    training step consumes (aux + final bf16 per token)."""
    import random

    from eaglenest.data.pack import pack
    from eaglenest.data.packed import PackedSplit, collate
    from eaglenest.data.teacher import teach_parts
    from eaglenest.target.loading import load_heads

    t = time.time()
    head = load_heads(target)["lm_head"]
    teach_parts([LOADER_PART], OUT / "hidden", OUT / "tokenized", OUT / "teacher", head, device="cuda", progress=False)
    pack([LOADER_PART], OUT / "hidden", OUT / "tokenized", OUT / "teacher", OUT / "packed", 32000, 0.05)
    res["pack_s"] = round(time.time() - t, 1)
    split = PackedSplit(OUT / "packed", "train", OUT / "hidden")
    idx = list(range(len(split)))
    random.Random(0).shuffle(idx)
    os.system("sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null")  # cold read where permitted
    t, nbytes = time.time(), 0
    for i in idx:
        b = collate(split, [i])
        nbytes += sum(v.numel() * v.element_size() for v in b.values())
    dt = time.time() - t
    # None when this run skipped training (the figure then comes from a --skip-extract run)
    best = max(
        (v.get("tok_s", 0) for k, v in res.items() if k.startswith("train_") and isinstance(v, dict)), default=None
    )
    res["loader"] = {
        "GB_s": round(nbytes / dt / 1e9, 2),
        "tok_s": round(len(idx) * T / dt, 1),
        "training_needs_GB_s": round(best * 4 * 4096 * 2 / 1e9, 2) if best else None,
    }
    log(res)
    bench_trainer(res, target)


def bench_trainer(res, target, steps: int = 40):
    """The real `Trainer` on the packed shards (TTT 7, one 2048-token sample per step): the loop
    `fit` runs — the next step's batches collated and pinned in a thread, `train_step`, the loss
    read back — after 3 warm-up steps (compilation)."""
    from concurrent.futures import ThreadPoolExecutor

    from eaglenest.drafter.train import Trainer
    from eaglenest.drafter.train_config import TrainConfig

    torch.cuda.empty_cache()
    from stages import _params

    cfg = TrainConfig.from_params(
        {**_params.load("train"), "ttt_steps": 7, "batch_tokens": T, "micro_batches": 1, "device": "cuda"}
    )
    tr = Trainer(OUT / "packed", OUT / "hidden", target, cfg, OUT / "ckpt")
    plan = [[[i]] for i in range(len(tr.train_split))][: steps + 3]
    with ThreadPoolExecutor(1) as loader:
        for s, (micro, loaded) in enumerate(tr.prefetched(plan, loader)):
            if s == 3:
                torch.cuda.synchronize()
                t = time.time()
            float(tr.train_step(micro, loaded)[0, 0])  # fit reads the loss back every step
    dt = time.time() - t
    # tokens/s only: this process still holds earlier benches' allocations, so no clean peak here
    res["trainer_on_packed_shards"] = {"steps": len(plan) - 3, "tok_s": round((len(plan) - 3) * T / dt, 1)}
    log(res)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--writers", type=int, help="writer processes (default: extract's auto, cores/2 up to 8)")
    ap.add_argument("--torch-threads", type=int, help="torch.set_num_threads in this process (host-path contention)")
    ap.add_argument("--batch-tokens", type=int, default=8192, help="extraction batch (multiple of 2048)")
    ap.add_argument(
        "--backend-batches",
        type=int,
        default=40,
        help="batches of the backend-only runs (forward + quantize + copy out, no store)",
    )
    ap.add_argument(
        "--shard-mb",
        type=int,
        nargs="+",
        default=[256],
        help="store.shard_mb of the end-to-end runs (default 256, as every recorded run; several: "
        "each run once per size, named ..._shard<MB>)",
    )
    ap.add_argument("--repeat", type=int, default=1, help="run each end-to-end run N times (named ..._r<k>)")
    ap.add_argument("--skip-extract", action="store_true")
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument(
        "--compile", action="store_true", help="also the compiled target (each decoder layer, extract's CUDA default)"
    )
    ap.add_argument("--skip-loader", action="store_true", help="no pack + loader + Trainer-on-shards figures")
    ap.add_argument(
        "--only", nargs="*", help="training variants / extraction runs to run, by result name (default: all)"
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="GPU kernel-time breakdown of the default training step and of one extraction forward",
    )
    args = ap.parse_args()
    from eaglenest.runtime.errors import setup_logging

    setup_logging()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    res = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    with ClockSampler() as clocks:
        peak = matmul_peak()
        res["matmul_peak_tflops"] = round(peak / 1e12, 1)
        matmul_sustained(res, clocks)
        log(res)
        if not args.skip_train:
            bench_training(res, args)
        if not args.skip_extract:
            target = bench_extraction(res, args, peak, clocks)
            if not args.skip_loader and LOADER_PART in res:  # --only may have left its store out
                bench_loader(res, target)
        res["matmul_peak_tflops_end"] = round(matmul_peak() / 1e12, 1)
        log(res)


if __name__ == "__main__":
    main()
