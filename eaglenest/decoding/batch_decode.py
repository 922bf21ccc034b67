"""Batched decoding of many prompts with a transformers causal LM: prompts sorted by length and
grouped under a token budget, left-padded, one KV cache per batch; rows leave the batch as they
finish (end of turn or their own token limit), so long answers do not keep short ones computing.
Greedy (temperature 0) or sampled from softmax(logits / temperature) with a seeded generator."""

import logging
from dataclasses import dataclass

import torch

from eaglenest.decoding import static_decode
from eaglenest.decoding.kv_cache import cache_kwarg, growing_cache

log = logging.getLogger(__name__)
CHECK_EVERY = 8  # steps between looks at which rows finished (each look waits for the GPU)
SHRINK = 4  # a CUDA-graphed batch drops its finished rows once they are 3/4 of it


@dataclass
class Decoded:
    tokens: list[int]  # generated ids, the end-of-turn id excluded
    ended: bool  # stopped at an end-of-turn id (else at its token limit)


def plan_batches(lengths: list[int], max_new: list[int], batch_tokens: int, max_rows: int) -> list[list[int]]:
    """Indices grouped longest first, while rows x (longest prompt + largest limit) fits the budget."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, cur, width = [], [], 0
    for i in order:
        w = max(width, lengths[i] + max_new[i])
        if cur and ((len(cur) + 1) * w > batch_tokens or len(cur) >= max_rows):
            batches.append(cur)
            cur, w = [], lengths[i] + max_new[i]
        cur.append(i)
        width = w
    if cur:
        batches.append(cur)
    return batches


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, L] left-padded with pad_id, and the attention mask (1 on real tokens)."""
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, L - len(p) :] = torch.tensor(p)
        mask[r, L - len(p) :] = 1
    return ids.to(device), mask.to(device)


class HFStepper:
    """Decode steps through the model's own forward and a growing KV cache (any causal LM)."""

    def __init__(self, model, width: int):
        self.model, self.cache, self.kw = model, growing_cache(reserve=width), cache_kwarg(model)

    def _forward(self, x, position):
        out = self.model(
            input_ids=x,
            attention_mask=self.attn,
            position_ids=position,
            use_cache=True,
            logits_to_keep=1,
            **{self.kw: self.cache},
        )
        return out.logits[:, -1].float()

    def prefill(self, ids, attn, pos):
        self.attn = attn
        return self._forward(ids, pos)

    def step(self, tok, pos):
        self.attn = torch.cat([self.attn, torch.ones_like(self.attn[:, :1])], 1)
        return self._forward(tok[:, None], pos[:, None])

    def select(self, keep) -> None:
        self.cache.batch_select_indices(keep)
        self.attn = self.attn[keep]


def uses_static(model) -> bool:
    """Whether batches decode through `static_decode`: on CUDA, where the architecture allows."""
    return next(model.parameters()).device.type == "cuda" and static_decode.supports(model)


def stepper_for(model, rows: int, width: int):
    """CUDA-graphed static steps where the architecture allows (`static_decode`), else the HF forward."""
    if uses_static(model):
        return static_decode.StaticDecoder(model, rows, width)
    return HFStepper(model, width)


@torch.inference_mode()
def decode_batch(
    model,
    prompts: list[list[int]],
    max_new: list[int],
    eos: set[int],
    pad_id: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    on_tokens=None,
    stepper=None,
) -> list[Decoded]:
    dev = next(model.parameters()).device
    ids, attn = left_pad(prompts, pad_id, dev)
    B, L = ids.shape
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    limit = torch.tensor(max_new, device=dev)
    eos_t = torch.tensor(sorted(eos), device=dev)
    W = max(max_new)
    stepper = stepper or stepper_for(model, B, L + W)
    static = isinstance(stepper, static_decode.StaticDecoder)

    def pick(logits):
        if temperature <= 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits / temperature, -1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]

    rows = torch.arange(B, device=dev)  # original row of each live batch row
    out = torch.full((B, W), -1, dtype=torch.long, device=dev)
    n = torch.zeros(B, dtype=torch.long, device=dev)  # tokens generated per original row
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    nxt, last, reported = pick(stepper.prefill(ids, attn, pos)), pos[:, -1], 0
    for step in range(W):
        # rows that finished since the last look still compute, but record nothing (no host sync here)
        live = ~done[rows]
        at = n[rows].clamp(max=W - 1)
        out[rows, at] = torch.where(live, nxt, out[rows, at])
        n[rows] += live.long()
        done[rows] |= torch.isin(nxt, eos_t) | (n[rows] >= limit[rows])
        if (step + 1) % CHECK_EVERY == 0 or step + 1 == W:
            keep = (~done[rows]).nonzero()[:, 0]
            if on_tokens is not None:
                total = int(n.sum())
                on_tokens(total - reported)
                reported = total
            if len(keep) == 0:
                break
            # a static stepper drops rows only when few are left: each drop captures a new graph
            if len(keep) < len(rows) and (not static or len(keep) * SHRINK <= len(rows)):
                stepper.select(keep)
                rows, nxt, last = rows[keep], nxt[keep], last[keep]
        last = last + 1
        nxt = pick(stepper.step(nxt, last))
    out, n = out.cpu(), n.cpu()
    res = []
    for r in range(len(prompts)):
        toks = out[r, : n[r]].tolist()
        ended = bool(toks) and toks[-1] in eos
        res.append(Decoded(toks[:-1] if ended else toks, ended))
    return res


def decode_all(
    model,
    prompts: list[list[int]],
    max_new: list[int],
    eos: set[int],
    pad_id: int,
    temperature: float = 0.0,
    seed: int = 0,
    batch_tokens: int = 65536,
    max_rows: int = 256,
    on_tokens=None,
) -> list[Decoded]:
    """Decode every prompt (prompts[i] for up to max_new[i] tokens); results in input order."""
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed) if temperature > 0 else None
    if uses_static(model):  # its cache is allocated whole: fitted to the GPU before the batches are planned
        per_token, free = static_decode.kv_bytes_per_token(model), static_decode.free_bytes(dev)
        fit = static_decode.fitting_batch_tokens(batch_tokens, per_token, free)
        if fit < batch_tokens:
            log.warning(
                "batch_tokens %d would need %.1f GB of KV cache; %.1f GB of this GPU is free: batches of %d tokens",
                batch_tokens, batch_tokens * per_token / 1e9, free / 1e9, fit,
            )  # fmt: skip
            batch_tokens = fit
    results: list[Decoded | None] = [None] * len(prompts)
    for batch in plan_batches([len(p) for p in prompts], max_new, batch_tokens, max_rows):
        done = decode_batch(
            model, [prompts[i] for i in batch], [max_new[i] for i in batch], eos, pad_id, temperature, gen, on_tokens
        )
        for i, d in zip(batch, done):
            results[i] = d
    return results
