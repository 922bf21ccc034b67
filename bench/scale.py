"""The gate at scale, on this machine's CPU. Not a test: writes
bench/results/scale.json (merged into what GPU runs wrote there) for bench/RESULTS.md.

    python -m bench.scale [--samples 32] [--max-len 192]

Uses data/target (the built-in target: its tokenizer for the random targets, and the dense
reference figures) and data/tokenized/<first part>.parquet, after `dvc repro`.
- moe_gate: random 6-layer targets of each architecture (`eaglenest.target.random_weights`, taps [1, 3, 4]):
  per-token cosine and relative-error quantiles of honest hf-backend bf16 states and of an off-by-one
  tap against the float32 reference; the tokens whose expert set differs between the bf16 forward
  and the float32 one (router hooks); and the gate's verdict on both under the default thresholds
  (token_quantile auto).
- streamed_reference: the built-in target's gate with the whole and the streamed reference: the
  same figures, its memory and time.
- plan_1t_moe_tb: `eaglenest plan` for hidden 7168, 3 taps + final, 21M tokens.
- streamed_reference, long, projection_1t_moe: from bench/results/gpu_gate.json (`python -m
  bench.gpu_gate` on the H200), with the projection's arithmetic.
"""

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from eaglenest.disk_plan import for_config
from eaglenest.extraction.backends.hf import HFBackend
from eaglenest.extraction.gate import MOE_QUANTILE, token_stats
from eaglenest.extraction.loop import GateFailed, extract_part
from eaglenest.extraction.plan import read_tokenized
from eaglenest.extraction.reference import Reference
from eaglenest.extraction.reference_process import LocalReference, choose
from eaglenest.files.atomic import write_json
from eaglenest.target.directory import load_target, materialize
from eaglenest.target.random_weights import build
from eaglenest.target.taps import resolve_taps

OUT = Path("bench/results/scale.json")
GPU = Path("bench/results/gpu_gate.json")  # `python -m bench.gpu_gate` on the H200
# DeepSeek-V3: 671B parameters, 37B active a token; a MoE layer's 256 routed experts (3 x 7168 x 2048)
# and its MLA attention in float32: ~46 GB resident while the samples run through it
PROJECTED = {"params": 671e9, "active_params": 37e9, "layer_gb_fp32": 46.0}
TAPS = [1, 3, 4]
ARCHS = ("llama", "gemma3", "qwen3-moe", "mixtral", "deepseek-v3")
QUANTILES = (0.001, 0.01, 0.02, 0.5)


def quantiles(cos: torch.Tensor, rel: torch.Tensor) -> dict:
    q = lambda x, p: round(float(torch.quantile(x.double(), p)), 4)  # noqa: E731
    return {
        "cosine_mean": round(float(cos.mean()), 5),
        **{f"cosine_p{p * 100:g}": q(cos, p) for p in QUANTILES},
        "cosine_min": round(float(cos.min()), 4),
        "rel_err_mean": round(float(rel.mean()), 4),
        **{f"rel_err_p{(1 - p) * 100:g}": q(rel, 1 - p) for p in QUANTILES},
        "rel_err_max": round(float(rel.max()), 4),
    }


def routes(model) -> list:
    """Each router's chosen experts per call (transformers' routers return logits, weights, indices)."""
    got = []
    for m in model.modules():
        if type(m).__name__.lower().endswith("router"):
            m.register_forward_hook(lambda _m, _a, out: got.append(out[2].reshape(-1, out[2].shape[-1]).sort(-1)[0]))
    return got


def gate_verdict(target, taps_stored, seqs, tmp: Path, name: str, **over) -> tuple[bool, dict]:
    """The stage's gate (8 samples, params.yaml's thresholds) on states of `taps_stored` labelled TAPS."""
    validate = {**yaml.safe_load(Path("params.yaml").read_text())["validate"], "samples": 8, **over}
    from eaglenest.data import chat

    tok = chat.write_tokenized(chat.token_table(seqs, [f"s{i}" for i in range(len(seqs))]), tmp / f"{name}.parquet")
    try:
        m = extract_part(part=name, tokenized=tok, target=target, backend=HFBackend(target, taps_stored, device="cpu"),
                         taps=TAPS, dtype="bfloat16", revision=0, validate_cfg=validate, out_dir=tmp / "hidden" / name,
                         layout_cfg=dict(chunk_mb=0.1, shard_mb=1, codec="zstd", level=1), work_root=tmp / "work",
                         batch_tokens=4096, max_seq_len=max(map(len, seqs)), progress=False)  # fmt: skip
    except GateFailed as e:
        m = e.metrics
    v = m["validation"]
    return v["passed"], {"failures": v["failures"], "token_quantile": v["thresholds"].get("token_quantile", 1.0)}


def moe_gate(seqs: list, tokenizer_dir: Path, tmp: Path) -> dict:
    out = {}
    for arch in ARCHS:
        t0 = time.time()
        target = materialize(str(build(arch, tmp / arch / "model", tokenizer_dir)), tmp / arch / "target")
        ref = Reference(target, TAPS)
        f32 = routes(ref.model)
        refs = [ref.states(s) for s in seqs]
        honest = HFBackend(target, TAPS, device="cpu")
        honest.load()
        b16 = routes(honest.decoder)
        states = {"honest": [honest.extract([s])[0] for s in seqs]}
        states["off_by_one"] = HFBackend(target, [t + 1 for t in TAPS], device="cpu").extract(seqs)
        row = {}
        for name, got in states.items():
            for where, pick in (("aux_3", lambda a, f: a[:, 1]), ("final", lambda a, f: f)):
                cos, rel = zip(*(token_stats(pick(a, f).float(), r["final"] if where == "final" else r["aux"][:, 1])
                                 for (a, f), r in zip(got, refs)))  # fmt: skip
                row[f"{name}_{where}"] = quantiles(torch.cat(cos), torch.cat(rel))
        if f32:  # one call per MoE layer per sample, in the same order in both
            per_sample = len(f32) // len(seqs)
            flipped = sum(
                int(
                    torch.stack(
                        [(f32[s * per_sample + k] != b16[s * per_sample + k]).any(-1) for k in range(per_sample)]
                    )
                    .any(0)
                    .sum()
                )  # fmt: skip
                for s in range(len(seqs))
            )
            tokens = sum(map(len, seqs))
            row["moe_layers"], row["flipped_tokens"] = per_sample, flipped
            row["flipped_fraction"] = round(flipped / tokens, 4)
        row["honest_passed"], row["honest_gate"] = gate_verdict(target, TAPS, seqs, tmp / arch, "honest")
        passed, row["off_by_one_gate"] = gate_verdict(target, [t + 1 for t in TAPS], seqs, tmp / arch, "obo")
        # the gate before the MoE policy: every target judged by its single worst token
        row["honest_passed_worst_token"] = gate_verdict(target, TAPS, seqs, tmp / arch, "worst", token_quantile=1)[0]
        row["off_by_one_failed"] = not passed
        row["seconds"] = round(time.time() - t0, 1)
        out[arch] = row
        print(arch, {k: row[k] for k in row if k.endswith(("passed", "failed", "flipped_fraction"))}, flush=True)
    return out


def streamed_reference(target, seqs: list, tmp: Path) -> dict:
    """The built-in target's part through the gate with each reference: figures, memory, time."""
    from eaglenest.data import chat

    taps = resolve_taps("auto", target.num_layers)
    tok = chat.write_tokenized(chat.token_table(seqs, [f"s{i}" for i in range(len(seqs))]), tmp / "dense.parquet")
    extract_part(part="dense", tokenized=tok, target=target, backend=HFBackend(target, taps, device="cpu"), taps=taps,
                 dtype="bfloat16", revision=0, validate_cfg={"samples": 0}, out_dir=tmp / "hidden" / "dense",
                 layout_cfg=dict(chunk_mb=0.1, shard_mb=4, codec="zstd", level=1), work_root=tmp / "work",
                 batch_tokens=4096, max_seq_len=max(map(len, seqs)), progress=False)  # fmt: skip
    validate = yaml.safe_load(Path("params.yaml").read_text())["validate"]  # `compare` takes the limits from it
    chosen, runs = choose(len(seqs), 8, 0), {}
    for streamed in (False, True):
        t = time.time()
        ref = LocalReference(target, taps, "cpu", tok, chosen, streamed)
        figures, passed = ref.compare(tmp / "hidden" / "dense", validate)
        runs[streamed] = (figures, passed, time.time() - t)
    (whole, _, whole_s), (stream, passed, stream_s) = runs[False], runs[True]
    memory = stream["reference"]
    return {
        "target": "smollm2-135m (cpu)",
        "samples": 8,
        "tokens": stream["tokens"],
        "same_as_whole": all(whole[k] == stream[k] for k in ("taps", "margin", "lm_head_logits_cosine")),
        "passed": passed,
        "model_gb_fp32": round(memory["model_bytes_fp32"] / 1e9, 3),
        "layer_gb": round(memory["layer_bytes"] / 1e9, 4),
        "peak_gb": round(memory["peak_bytes"] / 1e9, 3),
        "peak_layers": memory["peak_layers"],
        "fixed_s": round(stream_s, 2),
        "whole_fixed_s": round(whole_s, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=192)
    args = ap.parse_args()
    params = yaml.safe_load(Path("params.yaml").read_text())
    _, seqs = read_tokenized(Path(f"data/tokenized/{params['data']['parts'][0]}.parquet"))
    rng = np.random.default_rng(0)
    seqs = [seqs[i][: args.max_len] for i in sorted(rng.choice(len(seqs), args.samples, replace=False))]
    target = load_target(Path("data/target"))
    tmp = Path(tempfile.mkdtemp(prefix="scale-"))
    try:
        result = {
            "moe_gate": {
                "samples": len(seqs),
                "tokens": sum(map(len, seqs)),
                "token_quantile_moe": MOE_QUANTILE,
                **moe_gate(seqs, target.model_dir, tmp),
            },
            "streamed_reference_cpu": streamed_reference(target, seqs, tmp),
            "plan_1t_moe_tb": {
                states: round(v["store_bytes"] / 1e12, 3)
                for states, v in for_config(_kimi_config(tmp), 21_000_000, 3).items()
            },
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result.update(from_gpu(GPU))
    write_json(OUT, result)
    print(json.dumps(result, indent=1))


def from_gpu(path: Path) -> dict:
    """The H200 figures `bench.gpu_gate` recorded, in the shape RESULTS gives, and the projection of the
    streamed gate to a DeepSeek-V3-sized checkpoint from them."""
    if not path.is_file():
        return {}
    g = json.loads(path.read_text())
    ref = g["streamed_reference"]
    s, w = ref["streamed"], ref["whole"]
    read_gb_s = ref["read_gb_s"]
    compute_s = s["states_s"] - s["read_s"]  # the 8B shape's float32 compute for the samples, reads aside
    weights_tb = PROJECTED["params"] * 2 / 1e12  # bf16 on disk
    active = PROJECTED["active_params"] / 8.0e9
    return {
        "streamed_reference": {
            "target": "Llama-3.1-8B shape, random bf16 weights (H200)",
            "samples": ref["samples"],
            "tokens": ref["tokens"],
            "peak_gb": s["peak_gb"],
            "resident_weights_peak_gb": round(s["peak_bytes"] / 1e9, 2),
            "layer_gb": ref["layer_gb"],
            "model_gb_fp32": ref["model_gb_fp32"],
            "whole_peak_gb": w["peak_gb"],
            "same_as_whole": ref["same_as_whole"],
            "fixed_s": round(s["load_s"] + s["states_s"], 2),
            "whole_fixed_s": round(w["load_s"] + w["states_s"], 2),
            "read_gb_s": read_gb_s,
            "read_s": s["read_s"],
            "compute_s": round(compute_s, 2),
            "s_per_sample": ref["streamed_s_per_sample"],
            "page_cache_dropped": ref["page_cache_dropped"],
        },
        "long": g["long"],
        "projection_1t_moe": {
            **PROJECTED,
            "weights_tb_bf16": round(weights_tb, 2),
            "read_s": round(weights_tb * 1e12 / (read_gb_s * 1e9)),
            "compute_s": round(compute_s * active),
            "gate_min": round((weights_tb * 1e12 / (read_gb_s * 1e9) + compute_s * active) / 60, 1),
            "layer_gb_fp32": PROJECTED["layer_gb_fp32"],
            "arithmetic": "read = bf16 weights / the measured read rate; compute = the 8B shape's measured float32 "
            "compute for the same 8 samples x active params / 8B; one gate per part",
        },
    }


def _kimi_config(tmp: Path) -> Path:
    """The 1T MoE user's shape (DeepSeek-V3 architecture, 384 routed experts, hidden 7168, 61 layers)."""
    path = tmp / "1t-moe-config.json"
    cfg = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "n_routed_experts": 384}
    path.write_text(json.dumps(cfg))
    return path


if __name__ == "__main__":
    main()
