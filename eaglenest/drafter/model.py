"""The EAGLE-3 drafter (docs/design.md: Serving format). `save_pretrained` writes the serving format
SGLang and vLLM load as an EAGLE-3 draft: `LlamaForCausalLMEagle3`, one `midlayer`, `fc [H, 3H]`, q/k/v over 2H,
`lm_head [Vd, H]`, `d2t` (int64 offsets: target = i + d2t[i]) and `t2d` (bool), no embedding.

One attention step serves training-time test and inference: the queried cells attend causally to
the step-0 keys, plus to their own keys from steps 1..k (the "diagonal")."""

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from eaglenest.drafter.config import DrafterConfig
from eaglenest.files.atomic import replaced_file
from eaglenest.runtime.errors import EaglenestError


class StepCache:
    """Keys/values of step 0 for every cell, and of steps 1..k for the queried cells. The first step
    after construction or `new_round` adds cells to step 0; every later one adds a diagonal."""

    def __init__(self):
        self.k0 = self.v0 = None
        self.diag_k: list[torch.Tensor] = []
        self.diag_v: list[torch.Tensor] = []
        self._extend = True

    def add(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._extend:
            self.k0 = k if self.k0 is None else torch.cat([self.k0, k], 2)
            self.v0 = v if self.v0 is None else torch.cat([self.v0, v], 2)
            self._extend = False
        else:
            self.diag_k.append(k)
            self.diag_v.append(v)

    def new_round(self) -> None:
        """Drafting: drop the last round's steps 1..k; the next step runs step 0 over the cells
        verified since (their keys join step 0's, as an engine's draft KV cache keeps them)."""
        self.diag_k, self.diag_v, self._extend = [], [], True


class Eagle3Attention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.impl = "eager"  # or "flex": the fused TTT kernel for the all-cells training case
        self.nh, self.kvh, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, self.nh * self.d, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.kvh * self.d, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.kvh * self.d, bias=False)
        self.o_proj = nn.Linear(self.nh * self.d, c.hidden_size, bias=False)

    def project(self, u, cos, sin, w: dict):
        """u [B, Tq, 2H] for cells q_offset..q_offset+Tq-1 -> q [B, nh, Tq, d], k, v [B, kvh, Tq, d] (RoPE'd)."""
        B, Tq, _ = u.shape
        q = F.linear(u, w["self_attn.q_proj.weight"]).view(B, Tq, self.nh, self.d).transpose(1, 2)
        k = F.linear(u, w["self_attn.k_proj.weight"]).view(B, Tq, self.kvh, self.d).transpose(1, 2)
        v = F.linear(u, w["self_attn.v_proj.weight"]).view(B, Tq, self.kvh, self.d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def output(self, a: torch.Tensor, w: dict) -> torch.Tensor:
        """a [B, nh, Tq, d] -> o_proj over the concatenated heads."""
        B, _, Tq, _ = a.shape
        return F.linear(a.transpose(1, 2).reshape(B, Tq, self.nh * self.d), w["self_attn.o_proj.weight"])

    def attend(self, q, k, v, cache: StepCache, q_offset: int) -> torch.Tensor:
        """Appends k, v to the cache; q [B, nh, Tq, d] -> [B, nh, Tq, d]."""
        Tq = q.shape[2]
        rep = self.nh // self.kvh
        cache.add(k, v)
        if self.impl == "flex" and isinstance(q_offset, int) and q_offset == 0 and Tq == cache.k0.shape[2]:
            from eaglenest.drafter.attention import ttt_attention

            return ttt_attention(q, [cache.k0, *cache.diag_k], [cache.v0, *cache.diag_v])
        k0, v0 = cache.k0.repeat_interleave(rep, 1), cache.v0.repeat_interleave(rep, 1)
        scale = self.d**-0.5
        s0 = (q @ k0.transpose(-1, -2)) * scale  # [B, nh, Tq, T0]
        # q_offset: one first cell for the batch, or one per row [B] (rows of different lengths)
        first = q_offset[:, None, None] if torch.is_tensor(q_offset) else q_offset
        cells = first + torch.arange(Tq, device=q.device)[:, None]  # [Tq, 1] or [B, Tq, 1]
        causal = torch.arange(k0.shape[2], device=q.device) > cells
        s0 = s0.masked_fill(causal.unsqueeze(-3), float("-inf"))
        dk = [x.repeat_interleave(rep, 1) for x in cache.diag_k]
        dv = [x.repeat_interleave(rep, 1) for x in cache.diag_v]
        sd = [((q * x).sum(-1) * scale)[..., None] for x in dk]  # [B, nh, Tq, 1] each
        p = torch.softmax(torch.cat([s0, *sd], -1).float(), -1).to(q.dtype)
        out = p[..., : s0.shape[-1]] @ v0
        for j, x in enumerate(dv):
            out = out + p[..., s0.shape[-1] + j, None] * x
        return out


def _autocast_dtype(t: torch.Tensor) -> torch.Tensor:
    """t in the autocast dtype (when autocast is on). Only for WEIGHTS: an activation cast once and
    shared by several projections would sum their input gradients in bf16 (1 % off in tests);
    autocast's per-projection casts sum them in fp32."""
    dev = t.device.type
    return t.to(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else t


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's arithmetic, on an explicit weight."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class Eagle3Layer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.self_attn = Eagle3Attention(c)
        self.mlp = LlamaMLP(c)  # its weights and act_fn; `out` does the arithmetic on `weights()`
        self.hidden_norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def weights(self) -> dict:
        """This layer's weights by name, the Linear ones in the autocast dtype: cast ONCE per TTT
        unroll, so the K steps (and the compiled halves) share one saved copy and add their
        gradients in that dtype, as autocast's weight cache does in eager mode."""
        return {n: (_autocast_dtype(p) if p.dim() == 2 else p) for n, p in self.named_parameters()}

    def forward(self, x, emb, cos, sin, cache, q_offset, w: dict | None = None):
        w = self.weights() if w is None else w
        q, k, v = self.qkv(x, emb, cos, sin, w)
        return self.out(x, self.self_attn.attend(q, k, v, cache, q_offset), w)

    # the attention-free halves around `attend`: what `Eagle3Drafter.compile_blocks` compiles
    def qkv(self, x, emb, cos, sin, w: dict):
        eps = self.hidden_norm.variance_epsilon
        u = torch.cat([rms_norm(emb, w["input_layernorm.weight"], eps), rms_norm(x, w["hidden_norm.weight"], eps)], -1)
        return self.self_attn.project(u, cos, sin, w)

    def out(self, x, a, w: dict):
        h = x + self.self_attn.output(a, w)
        m = rms_norm(h, w["post_attention_layernorm.weight"], self.post_attention_layernorm.variance_epsilon)
        act = self.mlp.act_fn(F.linear(m, w["mlp.gate_proj.weight"])) * F.linear(m, w["mlp.up_proj.weight"])
        return h + F.linear(act, w["mlp.down_proj.weight"])


class Eagle3Drafter(PreTrainedModel):
    """A transformers model: `config` is a `DrafterConfig`; `save_pretrained` writes the serving
    format and `from_pretrained` reads it (both overridden: engines load these exact bytes)."""

    config_class = DrafterConfig
    base_model_prefix = "eagle3"
    _no_split_modules = ["Eagle3Layer"]

    def __init__(self, c: DrafterConfig):
        super().__init__(c)
        self.fc = nn.Linear(len(c.taps) * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c)
        self.norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(c)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))

    def set_attention(self, impl: str) -> None:
        """eager (any device, the reference) | flex (fused TTT attention; compiled on CUDA)."""
        if impl not in ("eager", "flex"):
            raise EaglenestError(f"drafter attention must be eager or flex, got {impl!r}")
        self.midlayer.self_attn.impl = impl

    def compile_blocks(self) -> None:
        """torch.compile everything around the attention kernel: norms + q/k/v + RoPE, and o_proj +
        residual + norm + MLP + residual, and the final norm: fused elementwise kernels and fewer
        saved intermediates. Bound methods, so the state dict is unchanged."""
        layer = self.midlayer
        layer.qkv = torch.compile(layer.qkv)
        layer.out = torch.compile(layer.out)
        self.norm.forward = torch.compile(self.norm.forward)

    def set_vocab(self, selected: torch.Tensor) -> None:
        """selected: sorted target ids of the draft vocabulary."""
        self.d2t.copy_(selected - torch.arange(len(selected), device=selected.device))
        self.t2d.zero_()
        self.t2d[selected] = True

    def step(self, x, emb, positions, cache: StepCache, q_offset: int = 0, w: dict | None = None) -> torch.Tensor:
        """One TTT step: x the hidden input (fc(aux) at step 0, the previous step's h after), emb the
        token embeddings, positions [Tq] (or per row [B, Tq]) RoPE positions, w the layer's
        `weights()` (cast once per unroll). Returns h [B, Tq, H] (pre-norm)."""
        cos, sin = self.rotary(x, positions if positions.dim() == 2 else positions[None])
        return self.midlayer(x, emb, cos, sin, cache, q_offset, w)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    def forward(
        self, aux: torch.Tensor, input_ids: torch.Tensor, embed: nn.Module, n_steps: int, logits: bool = True
    ) -> list:
        """Training-time test over every cell at once: logits [B, T, Vd] of steps 0..n_steps-1 (or,
        with logits=False, the normed hidden states the lm_head would read, for a fused loss).
        Cell t at step k reads token x_{t+1+k} (teacher forcing) at RoPE position t+k."""
        T = input_ids.shape[1]
        cache, x, out = StepCache(), self.project(aux), []
        pos, w = torch.arange(T, device=input_ids.device), self.midlayer.weights()
        for k in range(n_steps):
            x = self.step(x, embed(shift_left(input_ids, 1 + k)), pos + k, cache, w=w)
            out.append(self.logits(x) if logits else self.norm(x))
        return out

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B, T, n_aux, Ht] -> g [B, T, H]."""
        return self.fc(aux.flatten(-2))

    # --- serving format --------------------------------------------------------------------------
    def save_pretrained(self, out_dir: Path, **_) -> None:
        """model.safetensors (bf16 weights, int64 d2t, bool t2d; no rotary buffer) and config.json
        (`DrafterConfig.serving_dict`): the bytes SGLang and vLLM load (tests/data/drafter_export)."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith("rotary.")}
        state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in state.items()}
        # each file by rename: a directory of DVC's may hard-link them to its cache
        with replaced_file(out_dir / "model.safetensors") as tmp:
            save_file(state, str(tmp), metadata={"format": "pt"})
        with replaced_file(out_dir / "config.json") as tmp:
            tmp.write_text(json.dumps(self.config.serving_dict(), indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, path: Path, dtype=torch.float32, **_) -> "Eagle3Drafter":
        path = Path(path)
        if not (path / "config.json").is_file():
            raise EaglenestError(f"{path}: no drafter config.json")
        cfg = DrafterConfig.from_serving_dict(json.loads((path / "config.json").read_text()))
        model = cls(cfg)
        state = load_file(str(path / "model.safetensors"))
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.startswith("rotary.")]
        if missing or unexpected:
            raise EaglenestError(
                f"{path}: weights do not match the config (missing {missing}, unexpected {unexpected})"
            )
        return model.to(dtype)


class FrozenEmbedding(torch.nn.Module):
    """The target's embedding kept in its own dtype (bf16: half the memory of fp32), looked up
    rows upcast to fp32: the same values an fp32 copy would give."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight.detach().clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.weight).float()


def shift_left(x: torch.Tensor, s: int) -> torch.Tensor:
    """x[:, s:] padded with zeros at the end to the same length."""
    return torch.cat([x[:, s:], torch.zeros_like(x[:, :s])], 1) if s else x
