"""A DeepSeek-V3-architecture target at real width on one GPU, random weights (no model hub): the
hf backend's forward for MoE targets (transformers' own, with each experts implementation it
offers) against a dense Llama of equal active parameters, and how often bf16 routes a token to
other experts than float32 does, with the float32 router's margin on those tokens.

    python -m bench.moe_real_width [--layers 27] [--batch 4] [--seq 2048] [--steps 5] [--small]
                                   [--pipeline --tokenizer DIR --work DIR --tokens 300000 [--stage-only]]

Shape: `random_weights.WIDTHS` v2-lite, the width `target.path: random:deepseek-v3:v2-lite` builds
(DeepSeek-V2-Lite's size with V3's router): hidden 2048, MLA with a q LoRA (1536) and kv LoRA (512),
64 routed experts (moe_intermediate 1408), 6 active, 2 shared, sigmoid routing limited to 4 of 8
groups, the first layer dense (intermediate 10944), vocabulary 102,400. MFU = 2 x active
non-embedding parameters x tokens / time / the bf16 matmul peak measured in the same run (the
decoder only, as extraction runs it: no lm_head). --small: the same code on a tiny shape (CPU).

--pipeline: then the target saved as sharded safetensors (`eaglenest.target.random_weights`, drawn on
the GPU), `eaglenest plan`'s bytes for it, one part of random token ids extracted by the hf backend
as the stage does (`extract_part`: fp8 states, compile auto, the gate live, replaying the experts
the extraction's forward chose), its wall clock (the part's own: load, loop, gate, publish) and
MFU; the gate again on the same store with the same experts, its reference whole and then streamed
(forced): the figures side by side, the expert-flip figures, the streamed peak; three defects
through the live gate (taps shifted by one layer, the final norm skipped, another seed's weights);
a dense Llama target of equal active parameters extracted from the same part, its gate live too
(the MFU comparison); last, the MoE with each of transformers' layers compiled (the path the hf
backend no longer takes for a mixture of experts). Writes $BENCH_OUT/moe_real_width.json (default
bench/out). --stage-only: the part's wall clock alone, MoE and dense, into
moe_real_width_stage.json (a short run)."""

import argparse
import gc
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig

OUT = Path(os.environ.get("BENCH_OUT", "bench/out"))
NAME = "moe_real_width.json"


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def matmul_peak(dev: str) -> float:
    n = 8192 if dev == "cuda" else 1024
    a, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    sync()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    sync()
    return 2 * n**3 * 10 / (time.perf_counter() - t)


def moe_config(layers: int, small: bool) -> DeepseekV3Config:
    """The v2-lite width the `target` stage builds (`random:deepseek-v3:v2-lite`), or --small's."""
    from eaglenest.target.random_weights import WIDTHS

    w = dict(WIDTHS[("deepseek-v3", "v2-lite")], num_hidden_layers=layers)
    if small:
        w |= dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=64, vocab_size=49152, qk_nope_head_dim=32,
                  qk_rope_head_dim=16, v_head_dim=32)  # fmt: skip
    return DeepseekV3Config(max_position_embeddings=8192, **w)


def active_params(model, cfg) -> dict:
    """Parameters a token passes through: everything outside the embedding and lm_head, with only
    k of the routed experts of each MoE layer."""
    total = sum(p.numel() for p in model.parameters())
    outside = model.get_input_embeddings().weight.numel() + model.get_output_embeddings().weight.numel()
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    n_exp = getattr(cfg, "n_routed_experts", 1)
    k = getattr(cfg, "num_experts_per_tok", 1)
    active = total - outside - routed + routed * k // n_exp
    return {"total": total, "routed_experts": routed, "active_non_embedding": active}


def build(cfg, dev: str):
    torch.manual_seed(0)
    t = time.perf_counter()
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval(), round(time.perf_counter() - t, 1)


@torch.inference_mode()
def forward_rate(model, ids_batches, active: int, peak: float) -> dict:
    decoder = model.get_decoder()
    decoder(input_ids=ids_batches[0], output_hidden_states=True, use_cache=False)  # warm-up
    sync()
    t = time.perf_counter()
    for ids in ids_batches:
        out = decoder(input_ids=ids, output_hidden_states=True, use_cache=False)
        torch.stack([out.hidden_states[j] for j in (2, 4)], dim=2)  # the taps, as the backend stacks them
    sync()
    dt = time.perf_counter() - t
    tokens = sum(x.numel() for x in ids_batches)
    return {"tok_s": round(tokens / dt), "mfu": round(2 * active * tokens / dt / peak, 4), "seconds": round(dt, 2)}


def routers(model):
    return [m for n, m in model.named_modules() if n.endswith("mlp.gate") and hasattr(m, "e_score_correction_bias")]


@torch.inference_mode()
def routing_flips(model, ids) -> dict:
    """bf16 forward, then the same forward in float32 one decoder layer at a time (each layer upcast,
    run, cast back: the bf16 weights are exact in float32), both recording each router's choice."""
    rs, seen = routers(model), {"bf16": [], "fp32": []}
    mode = ["bf16"]

    def record(mod, args, out):
        logits = out[0].float()
        scores = logits.sigmoid() + mod.e_score_correction_bias.float()
        seen[mode[0]].append((out[2].sort(-1).values, scores))

    hooks = [r.register_forward_hook(record) for r in rs]
    decoder = model.get_decoder()
    decoder(input_ids=ids, use_cache=False)
    mode[0] = "fp32"

    def up(mod, args, kwargs):
        mod.float()
        cast = lambda x: x.float() if torch.is_tensor(x) and x.is_floating_point() else x  # noqa: E731
        kw = {k: tuple(map(cast, v)) if isinstance(v, tuple) else cast(v) for k, v in kwargs.items()}
        return tuple(map(cast, args)), kw

    def down(mod, args, kwargs, out):
        mod.to(torch.bfloat16)

    hooks += [layer.register_forward_pre_hook(up, with_kwargs=True) for layer in decoder.layers]
    hooks += [layer.register_forward_hook(down, with_kwargs=True) for layer in decoder.layers]
    hooks.append(decoder.rotary_emb.register_forward_pre_hook(lambda m, a: (a[0].float(), *a[1:])))
    hooks.append(decoder.norm.register_forward_pre_hook(lambda m, a: (a[0].float(),)))
    decoder.norm.float()
    decoder(input_ids=ids, use_cache=False)
    decoder.norm.to(torch.bfloat16)
    for h in hooks:
        h.remove()
    per_layer, margins_flipped, margins_all, any_flip = [], [], [], None
    for (b_idx, _), (f_idx, f_scores) in zip(seen["bf16"], seen["fp32"]):
        flipped = (b_idx != f_idx).any(-1)
        any_flip = flipped if any_flip is None else any_flip | flipped
        per_layer.append(round(flipped.float().mean().item(), 5))
        top = f_scores.sort(-1, descending=True).values
        k = b_idx.shape[-1]
        gap = top[:, k - 1] - top[:, k]  # the float32 margin between the last chosen and the first unchosen
        margins_all.append(gap)
        margins_flipped.append(gap[flipped])
    allm, flm = torch.cat(margins_all), torch.cat(margins_flipped)
    q = lambda x, p: round(x.quantile(p).item(), 6) if len(x) else None  # noqa: E731
    return {
        "tokens": int(ids.numel()),
        "moe_layers": len(per_layer),
        "flip_fraction_per_layer": per_layer,
        "flip_fraction": round(sum(per_layer) / len(per_layer), 5),
        "tokens_flipped_in_any_layer": round(any_flip.float().mean().item(), 5) if any_flip is not None else None,
        "fp32_margin_all_tokens_median": q(allm, 0.5),
        "fp32_margin_flipped_tokens": {
            "median": q(flm, 0.5),
            "p90": q(flm, 0.9),
            "p99": q(flm, 0.99),
            "max": round(flm.max().item(), 6) if len(flm) else None,
        },  # fmt: skip
        "fraction_of_all_tokens_with_margin_below_flipped_p99": round((allm < q(flm, 0.99)).float().mean().item(), 5)
        if len(flm)
        else None,  # fmt: skip
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--impls", default="grouped_mm,eager")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--pipeline", action="store_true")
    ap.add_argument("--tokenizer", type=Path, help="a tokenizer directory (the built-in target's)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/moe_work"))
    ap.add_argument("--tokens", type=int, default=300_000)
    ap.add_argument("--stage-only", action="store_true",
                    help="with --pipeline: only the part's wall clock, MoE and dense (no routing figures, second "
                    "gate, defects or compiled layers); writes moe_real_width_stage.json")  # fmt: skip
    a = ap.parse_args()
    global NAME
    NAME = "moe_real_width_stage.json" if a.stage_only else NAME
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("eaglenest").setLevel(logging.INFO)  # the parts' host path and gate lines
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    import transformers

    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
           "transformers": transformers.__version__, "batch": a.batch, "seq": a.seq, "steps": a.steps}  # fmt: skip
    peak = res["bf16_matmul_peak_tflops"] = matmul_peak(dev) / 1e12
    peak *= 1e12
    cfg = moe_config(a.layers, a.small)
    model, res["moe_build_s"] = build(cfg, dev)
    res["moe_shape"] = {k: getattr(cfg, k) for k in ("hidden_size", "num_hidden_layers", "n_routed_experts",
                        "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group", "q_lora_rank",
                        "kv_lora_rank", "moe_intermediate_size", "first_k_dense_replace", "vocab_size")}  # fmt: skip
    res["moe_params"] = active_params(model, cfg)
    print(json.dumps(res, indent=1), flush=True)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(3, cfg.vocab_size, (a.batch, a.seq), generator=g).to(dev) for _ in range(a.steps)]
    res["moe"] = {}
    for impl in a.impls.split(","):
        model.set_experts_implementation(impl)
        res["moe"][impl] = forward_rate(model, batches, res["moe_params"]["active_non_embedding"], peak)
        if dev == "cuda":
            res["moe"][impl]["peak_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 1)
        print(impl, res["moe"][impl], flush=True)
    model.set_experts_implementation("grouped_mm")
    if not a.stage_only:
        res["routing"] = routing_flips(model, batches[0][:, : min(a.seq, 1024)])
        print(json.dumps(res["routing"], indent=1), flush=True)
    active = res["moe_params"]["active_non_embedding"]
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()
    # dense Llama of the same hidden size and depth, its MLP widened to the MoE's active parameters
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    inter = round((active / L - 4 * h * h) / (3 * h) / 128) * 128
    dcfg = LlamaConfig(hidden_size=h, num_hidden_layers=L, num_attention_heads=cfg.num_attention_heads,
                       num_key_value_heads=cfg.num_attention_heads, intermediate_size=inter,
                       vocab_size=cfg.vocab_size, max_position_embeddings=8192)  # fmt: skip
    dense, res["dense_build_s"] = build(dcfg, dev)
    res["dense_params"] = active_params(dense, dcfg)
    res["dense_intermediate_size"] = inter
    res["dense"] = forward_rate(dense, batches, res["dense_params"]["active_non_embedding"], peak)
    res["moe_mfu_over_dense"] = round(res["moe"][a.impls.split(",")[0]]["mfu"] / res["dense"]["mfu"], 3)
    del dense
    save(res)
    print(json.dumps({k: res[k] for k in ("moe", "dense", "moe_mfu_over_dense")}, indent=1), flush=True)
    if a.pipeline:
        pipeline(res, a, cfg, peak, dev)


def save(res: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / NAME).write_text(json.dumps(res, indent=1) + "\n")


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def pipeline(res: dict, a, cfg, peak: float, dev: str) -> None:
    import numpy as np

    from eaglenest.data.chat import token_table, write_tokenized
    from eaglenest.disk_plan import for_config
    from eaglenest.target.directory import materialize
    from eaglenest.target.random_weights import build

    torch.cuda.empty_cache() if dev == "cuda" else None
    w, taps = a.work, [2, cfg.num_hidden_layers // 2, cfg.num_hidden_layers - 3]
    over = {k: getattr(cfg, k) for k in res["moe_shape"]} | {
        k: getattr(cfg, k) for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads",
                                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}  # fmt: skip
    t = time.perf_counter()
    build("deepseek-v3", w / "model", a.tokenizer, seed=0, max_shard_size="5GB", overrides=over, device=dev)
    gc.collect()  # the drawn model's GPU memory back before the stage measures what is free
    torch.cuda.empty_cache() if dev == "cuda" else None
    res["target_save_s"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    target = materialize(str(w / "model"), w / "target")
    res["target_fingerprint_s"] = round(time.perf_counter() - t, 1)
    res["target_bytes"] = du(w / "model")
    print("target", res["target_save_s"], res["target_fingerprint_s"], res["target_bytes"], flush=True)
    rng = np.random.default_rng(0)
    seqs, n = [], 0
    while n < a.tokens:
        seqs.append(rng.integers(3, 49152, size=int(rng.integers(256, 2049))).astype(np.int32))
        n += len(seqs[-1])
    tok = write_tokenized(token_table(seqs), w / "part.parquet")
    res["disk"] = {"plan_store_bytes": for_config(w / "model" / "config.json", n, len(taps))["fp8"]["store_bytes"]}
    layout = dict(chunk_mb=1, shard_mb=128, codec="none", level=1, states="fp8")
    run = Runs(res, w, taps, tok, layout, n, peak, dev)
    res["extract_samples"] = len(seqs)
    # as the stage runs it: compile auto (transformers' forward for a mixture of experts), the gate live
    captured = run.extract("moe", target, "auto", res["moe_params"]["active_non_embedding"], gate=True)
    measured, plan = du(w / "hidden" / "moe"), res["disk"]["plan_store_bytes"]
    res["disk"] |= {"measured_store_bytes": measured, "measured_over_plan": round(measured / plan, 4)}
    print(json.dumps(res["disk"]), flush=True)
    save(res)
    if not a.stage_only:
        gate_both_ways(res, w / "hidden" / "moe", target, taps, tok, seqs, dev, captured)
        defects(res, run, target, seqs)
    shutil.rmtree(w / "hidden", ignore_errors=True)
    # the dense comparison: a Llama of equal active parameters, extracted from the same part
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    dense_over = {"hidden_size": h, "num_hidden_layers": L, "num_attention_heads": cfg.num_attention_heads,
                  "num_key_value_heads": cfg.num_attention_heads, "head_dim": h // cfg.num_attention_heads,
                  "intermediate_size": res["dense_intermediate_size"], "vocab_size": cfg.vocab_size}  # fmt: skip
    build("llama", w / "dense", a.tokenizer, seed=0, max_shard_size="5GB", overrides=dense_over, device=dev)
    dense = materialize(str(w / "dense"), w / "dense-target")
    run.extract("dense", dense, "auto", res["dense_params"]["active_non_embedding"], gate=True)  # as the stage
    res["extract_mfu_moe_over_dense"] = round(
        res["extract"]["moe"]["mfu_wall"] / res["extract"]["dense"]["mfu_wall"], 3
    )
    print("extract MFU MoE / dense", res["extract_mfu_moe_over_dense"], flush=True)
    save(res)
    shutil.rmtree(w / "hidden", ignore_errors=True)
    if a.stage_only:
        return
    # last, as it may take long: each of transformers' layers compiled (the hf backend's path before)
    run.extract("moe_layers_compiled", target, "layers", res["moe_params"]["active_non_embedding"], gate=False)
    save(res)


GATE = {"samples": 8, "seed": 0, "min_cosine_mean": 0.995, "min_cosine_token": 0.98, "max_rel_err_mean": 0.06,
        "max_rel_err_token": 0.2}  # fmt: skip  # params.yaml's validate


class Runs:
    """Parts extracted as the stage does, each figure into res["extract"][name]."""

    def __init__(self, res, w, taps, tok, layout, n, peak, dev):
        self.res, self.w, self.taps, self.tok, self.layout, self.n, self.peak, self.dev = (
            res, w, taps, tok, layout, n, peak, dev)  # fmt: skip
        res.setdefault("extract", {})

    def part(self, name, target, backend, tok, gate: bool, layout=None):
        from eaglenest.extraction.loop import extract_part

        return extract_part(part=name, tokenized=tok, target=target, backend=backend, taps=self.taps,
                            dtype="bfloat16", revision=0, layout_cfg=layout or self.layout,
                            validate_cfg=GATE if gate else {"samples": 0}, out_dir=self.w / "hidden" / name,
                            work_root=self.w / "work", batch_tokens=16384, max_seq_len=2048,
                            progress=False)  # fmt: skip

    def extract(self, name, target, compile_mode, active: int, gate: bool):
        """Returns the experts the extraction's forward chose for the gate's samples (or None)."""
        from eaglenest.extraction.backends.hf import HFBackend

        be, captured = HFBackend(target, self.taps, device=self.dev, states="fp8", compile=compile_mode), None
        try:
            m = self.part(name, target, be, self.tok, gate)
            captured = be.routing.chosen if be.routing is not None else None
            fwd = backend_forward_rate(be, target, active, self.peak, self.dev)
        except Exception as e:  # noqa: BLE001 -- a figure of its own
            self.res["extract"][name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            save(self.res)
            return None
        finally:
            be.close()
            del be
            torch.cuda.empty_cache() if self.dev == "cuda" else None
        wall, n = m["total_seconds"], self.n  # the part's own: load, loop, gate, publish
        self.res["extract"][name] = {
            "compile": compile_mode, "tokens": n, "wall_s": round(wall, 1), "tok_s_wall": round(n / wall),
            "mfu_wall": round(2 * active * n / wall / self.peak, 4),
            "extract_seconds": m["extract_seconds"], "tok_s_extract": m["tokens_per_s"],
            "mfu_extract": round(2 * active * n / m["extract_seconds"] / self.peak, 4),
            "backend_forward_alone": fwd, "fixed_cost": m["fixed_cost"], "forward_path": m["forward_path"],
            "host_path": m["host_path"], "validation": summary(m["validation"]),
        }  # fmt: skip
        print(name, json.dumps(self.res["extract"][name]), flush=True)
        save(self.res)
        return captured


@torch.inference_mode()
def backend_forward_rate(be, target, active: int, peak: float, dev: str) -> dict:
    """The backend's own forward on full rows ([8, 2048], no padding, no store): what the loop could reach."""
    g = torch.Generator().manual_seed(2)
    batches = [torch.randint(3, 49152, (8, 2048), generator=g).to(dev) for _ in range(4)]
    be.forward(batches[0])
    sync()
    t = time.perf_counter()
    for ids in batches:
        be.forward(ids)
    sync()
    dt, tokens = time.perf_counter() - t, sum(x.numel() for x in batches)
    return {"tok_s": round(tokens / dt), "mfu": round(2 * active * tokens / dt / peak, 4)}


def summary(v: dict) -> dict:
    return {k: v.get(k) for k in ("passed", "failures", "taps", "margin", "reference", "seconds", "disabled") if k in v}


def gate_both_ways(res, store, target, taps, tok, seqs, dev, captured) -> None:
    """The gate on the extracted store again, with the experts the extraction chose: the reference whole,
    then streamed (forced), on the GPU; figures side by side."""
    from eaglenest.extraction.reference_process import LocalReference, choose

    chosen = choose(len(seqs), GATE["samples"], GATE["seed"])
    res["gate"] = {}
    for mode in ("whole", "streamed"):
        torch.cuda.reset_peak_memory_stats() if dev == "cuda" else None
        t = time.perf_counter()
        ref = LocalReference(target, taps, dev, tok, chosen, streamed=mode == "streamed", replay=True)
        met, ok = ref.compare(store, GATE, captured)
        res["gate"][mode] = {"passed": ok, "seconds": round(time.perf_counter() - t, 1), **summary(met),
                             "cuda_peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1) if dev == "cuda"
                             else None}  # fmt: skip
        print(mode, ok, res["gate"][mode]["seconds"], json.dumps(met["taps"]), flush=True)
        save(res)
        del ref
        gc.collect()  # the whole float32 copy (~63 GB) gone before the next reference or part measures free memory
        torch.cuda.empty_cache() if dev == "cuda" else None
    g = res["gate"]
    res["gate_whole_equals_streamed"] = all(g["whole"][k] == g["streamed"][k] for k in ("taps", "margin")) and (
        g["whole"]["reference"].get("routing") == g["streamed"]["reference"].get("routing")
    )


def defects(res, run, target, seqs) -> None:
    """Each defect's states through the live gate, as the stage would (the gate's samples only)."""
    from eaglenest.data.chat import token_table, write_tokenized
    from eaglenest.extraction.loop import GateFailed
    from eaglenest.extraction.reference_process import choose
    from tests.defects import OffByOneTap, OtherSeed, PreNormFinal

    small = [seqs[i] for i in choose(len(seqs), GATE["samples"], GATE["seed"])]
    tok = write_tokenized(token_table(small), run.w / "small.parquet")
    res["defects"] = {}
    for name, cls in (("taps_shifted_by_one", OffByOneTap), ("final_norm_skipped", PreNormFinal),
                      ("another_seeds_weights", OtherSeed)):  # fmt: skip
        be = cls(target, run.taps, device=run.dev, states="bf16", compile=False)  # the defects store bf16
        try:
            run.part(name, target, be, tok, gate=True, layout={**run.layout, "states": "bf16"})
            res["defects"][name] = {"passed": True}
        except GateFailed as e:
            v = e.metrics["validation"]
            res["defects"][name] = {"passed": False, "failures": v["failures"][:4],
                                    "chosen_by": v["reference"].get("routing", {}).get("chosen_by")}  # fmt: skip
        finally:
            be.close()
            del be
            torch.cuda.empty_cache() if run.dev == "cuda" else None
        print(name, json.dumps(res["defects"][name]), flush=True)
        save(res)


if __name__ == "__main__":
    main()
