"""The Llama-family decoder as plain functions over the target's own tensors: what the hf backend runs
on CUDA (`compile: layers`) instead of transformers' modules. Its layer is one function, compiled once
for every layer and batch shape -- in a thread, while the weights are copied in and the loop gets
ready -- and the stage never imports transformers' modeling code (most of the 8B load's 10 s on the
H200, bench/RESULTS.md). Same math, op for op, as transformers' Llama / Mistral / Qwen2 / Qwen3
decoders with SDPA attention (a test holds them equal); the gate's reference is still transformers'
own float32 model, so a mistake here fails the gate. `plan` says which targets it runs: the config
(family, activation, rotary kind, no sliding window) and the safetensors' tensor names decide."""

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from eaglenest.extraction.backends.hf_weights import Unsupported
from eaglenest.target.files import read_header

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
LAYER = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
OPTIONAL = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.o_proj.bias",
            "self_attn.q_norm.weight", "self_attn.k_norm.weight")  # fmt: skip
VERSION = "eaglenest-llama-1"  # in the extractor fingerprint: states computed by this code


@dataclass(frozen=True)
class Spec:
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    rope: tuple  # (theta, llama3 scaling (factor, low, high, original context) or None)
    optional: tuple  # which of OPTIONAL every layer has


def _rope_config(cfg: dict) -> tuple:
    """(theta, llama3 scaling or None) from transformers' `rope_parameters` or the older
    `rope_theta` + `rope_scaling`; other rotary kinds are Unsupported."""
    rp = cfg.get("rope_parameters") or {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 1e4)}
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind == "default":
        return float(rp["rope_theta"]), None
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return float(rp["rope_theta"]), tuple(float(rp[k]) for k in keys)
    raise Unsupported(f"rotary embedding {kind!r}")


def plan(model_dir: Path) -> Spec:
    """The target's Spec, or Unsupported (with the reason) where these functions cannot run it."""
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise Unsupported(f"model_type {family!r} (own layers: {', '.join(FAMILIES)})")
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias"):
        raise Unsupported(f"MLP {cfg.get('hidden_act')} with bias {cfg.get('mlp_bias', False)}")
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", family == "mistral"):
        raise Unsupported(f"sliding-window attention ({cfg['sliding_window']})")
    heads = cfg["num_attention_heads"]
    spec = dict(layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"], heads=heads,
                intermediate=cfg["intermediate_size"], vocab=cfg["vocab_size"],
                kv_heads=cfg.get("num_key_value_heads") or heads, eps=float(cfg["rms_norm_eps"]),
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, rope=_rope_config(cfg))  # fmt: skip
    names = set()
    for path in sorted(model_dir.glob("*.safetensors")):
        names |= {n.removeprefix("model.") for n in read_header(path)[0] if n != "__metadata__"}
    names = {n for n in names if not n.startswith("lm_head.")}
    if not names:
        raise Unsupported(f"no safetensors in {model_dir}")
    optional = tuple(o for o in OPTIONAL if f"layers.0.{o}" in names)
    if (family == "qwen3") != ("self_attn.q_norm.weight" in optional):  # Qwen3's per-head q/k norm only
        raise Unsupported(f"{family} with q/k norms {'self_attn.q_norm.weight' in optional}")
    want = set(expected_names(Spec(**spec, optional=optional)))
    if names != want:
        odd = sorted(names ^ want)
        raise Unsupported(f"{len(odd)} tensors differ from a {family} decoder's, e.g. {odd[0]}")
    return Spec(**spec, optional=optional)


def expected_names(spec: Spec) -> list[str]:
    layer = [f"{n}.weight" for n in LAYER] + list(spec.optional)
    return ["embed_tokens.weight", "norm.weight"] + [f"layers.{i}.{n}" for i in range(spec.layers) for n in layer]


def shapes(spec: Spec) -> dict[str, tuple]:
    """Each parameter's shape, by name (`expected_names`)."""
    h, d, inter = spec.hidden, spec.head_dim, spec.intermediate
    q, kv = spec.heads * d, spec.kv_heads * d
    layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
             "self_attn.o_proj.weight": (h, q), "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
             "self_attn.v_proj.bias": (kv,), "self_attn.o_proj.bias": (h,), "self_attn.q_norm.weight": (d,),
             "self_attn.k_norm.weight": (d,), "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
             "mlp.down_proj.weight": (h, inter)}  # fmt: skip
    out = {"embed_tokens.weight": (spec.vocab, h), "norm.weight": (h,)}
    for name in expected_names(spec)[2:]:
        out[name] = layer[name.split(".", 2)[2]]
    return out


def allocate(spec: Spec, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    """Every parameter, uninitialised, on `device` (filled by `hf_weights.copy_weights`)."""
    return {name: torch.empty(shape, dtype=dtype, device=device) for name, shape in shapes(spec).items()}


def inv_freq(spec: Spec) -> torch.Tensor:
    """The rotary frequencies (float32, on the CPU as transformers computes them); Llama 3's scaling
    stretches the low ones by `factor`, leaves the high ones, and blends those between."""
    theta, scaling = spec.rope
    d = spec.head_dim
    freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if scaling is None:
        return freq
    factor, low, high, context = scaling
    wavelen = 2 * math.pi / freq
    stretched = torch.where(wavelen > context / low, freq / factor, freq)
    blend = (context / wavelen - low) / (high - low)
    blended = (1 - blend) * stretched / factor + blend * stretched
    between = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(between, blended, stretched)


def rotary(freq: torch.Tensor, T: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] for positions 0..T-1 (right padding keeps every row's positions 0..);
    `freq`: `inv_freq` on the device (a copy from pageable host memory per batch would wait for the
    batch running: the loop could launch nothing ahead)."""
    freqs = torch.arange(T, device=freq.device).float()[:, None] * freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, add: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x (of x + add, rounded to the model dtype first, as transformers adds)."""
    if add is not None:
        x = x + add
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return w * y.to(x.dtype)


def rotate(x, cos, sin):
    """x [B, T, heads, d] at positions 0..T-1: x * cos + rotate_half(x) * sin, in x's layout."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def silu_mul(g, u):
    return F.silu(g) * u


def residual(h, o, m):
    """The layer's output h + o + m, added as transformers adds: (h + o) first."""
    return h + o + m


@dataclass(frozen=True)
class Ops:
    """The layer's memory-bound steps, each an eager torch function here (transformers' math, op for
    op) or a Triton kernel (`llama_kernels.OPS`); the matmuls and attention are the layer's own."""

    norm: Callable  # (x, w, eps, add=None)
    rotate: Callable  # (x [B, T, heads, d], cos, sin)
    silu_mul: Callable  # (gate, up)
    residual: Callable  # (h, attention out, MLP out)


EAGER = Ops(rms_norm, rotate, silu_mul, residual)


def make_layer(spec: Spec, ops: Ops = EAGER):
    """layer(h [B, T, H], cos, sin, w) -> h after one decoder layer; `w` is `layer_weights(i)`. Causal
    SDPA without a mask: with right padding no real token sees padding."""
    # plain Python constants: under dynamic shapes dynamo would trace ints read off `spec` as symbols
    qk_norm, gqa = "self_attn.q_norm.weight" in spec.optional, spec.kv_heads != spec.heads
    d, eps, scale = spec.head_dim, spec.eps, spec.head_dim**-0.5

    def layer(h, cos, sin, w):
        n1, wq, wk, wv, wo, n2, wg, wu, wd, bq, bk, bv, bo, qn, kn = w
        B, T, _ = h.shape
        x = ops.norm(h, n1, eps)
        q = F.linear(x, wq, bq).view(B, T, -1, d)
        k = F.linear(x, wk, bk).view(B, T, -1, d)
        v = F.linear(x, wv, bv).view(B, T, -1, d).transpose(1, 2)
        if qk_norm:
            q, k = ops.norm(q, qn, eps), ops.norm(k, kn, eps)
        q, k = ops.rotate(q, cos, sin).transpose(1, 2), ops.rotate(k, cos, sin).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        o = F.linear(a.transpose(1, 2).reshape(B, T, -1), wo, bo)
        x = ops.norm(h, n2, eps, add=o)
        return ops.residual(h, o, F.linear(ops.silu_mul(F.linear(x, wg), F.linear(x, wu)), wd))

    return layer


class Decoder:
    """The weights (`allocate`) and the loop: embeddings, each layer, the final norm."""

    def __init__(self, spec: Spec, weights: dict[str, torch.Tensor], ops: Ops = EAGER):
        self.spec, self.weights, self.ops = spec, weights, ops
        self.layer = make_layer(spec, ops)  # replaced by its compiled form (hf backend)
        self.per_layer = [self.layer_weights(i) for i in range(spec.layers)]
        self.inv_freq = inv_freq(spec).to(weights["norm.weight"].device)

    def layer_weights(self, i: int) -> tuple:
        w = self.weights
        get = [f"layers.{i}.{n}.weight" for n in LAYER] + [f"layers.{i}.{o}" for o in OPTIONAL]
        return tuple(w.get(k) for k in get)

    def run(self, ids: torch.Tensor, keep: tuple) -> tuple[list, torch.Tensor]:
        """The residual stream entering layer j where keep[j] (transformers' hidden_states[j]), and the
        final norm's output."""
        h = F.embedding(ids, self.weights["embed_tokens.weight"])
        cos, sin = rotary(self.inv_freq, ids.shape[1], h.dtype)
        kept = []
        for w, k in zip(self.per_layer, keep):
            if k:
                kept.append(h)
            h = self.layer(h, cos, sin, w)
        return kept, self.ops.norm(h, self.weights["norm.weight"], self.spec.eps)
