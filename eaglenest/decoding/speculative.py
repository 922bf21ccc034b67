"""Offline speculative decoding with the target (HF, KV cache) and an EAGLE-3 drafter (docs/design.md: Evaluate):
chain drafting of k tokens, greedy verification. Lossless: the output is the target's greedy
decoding. Acceptance length counts the bonus token (no speculation = 1.0, SGLang's convention)."""

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from eaglenest.decoding.kv_cache import cache_kwarg
from eaglenest.drafter.model import Eagle3Drafter, StepCache


@dataclass
class Decoded:
    tokens: list
    seconds: float
    target_forwards: int = 0
    accepted: list = field(default_factory=list)  # accepted drafts per verification (0..k)
    draft_seconds: float = 0.0
    prefill_seconds: float = 0.0  # the prompt's forward, which yields the first token


class TargetRunner:
    def __init__(self, model, taps: list[int]):
        self.model, self.taps = model, list(taps)
        self.device = next(model.parameters()).device
        self.cache_kw = cache_kwarg(model)

    @torch.inference_mode()
    def forward(self, ids: list[int], cache: DynamicCache, start: int, taps: bool = True):
        """Run `ids` at positions start.. with the cache; (greedy next ids, aux [n, 3, H] or None)."""
        x = torch.tensor([ids], device=self.device)
        pos = torch.arange(start, start + len(ids), device=self.device)[None]
        out = self.model(
            input_ids=x, position_ids=pos, use_cache=True, output_hidden_states=taps, **{self.cache_kw: cache}
        )
        aux = torch.stack([out.hidden_states[j][0] for j in self.taps], 1) if taps else None
        return out.logits[0].argmax(-1).tolist(), aux


def greedy_decode(runner: TargetRunner, prompt: list[int], max_new: int, eos: set) -> Decoded:
    t0 = time.perf_counter()
    cache = DynamicCache()
    nxt, _ = runner.forward(prompt, cache, 0, taps=False)
    prefill = time.perf_counter() - t0
    out, n = [nxt[-1]], len(prompt)
    while len(out) < max_new and out[-1] not in eos:
        nxt, _ = runner.forward([out[-1]], cache, n, taps=False)
        n += 1
        out.append(nxt[-1])
    return Decoded(out, time.perf_counter() - t0, target_forwards=len(out), prefill_seconds=prefill)


@torch.inference_mode()
def draft_chain(drafter: Eagle3Drafter, embed, feats: torch.Tensor, tokens: torch.Tensor, k: int) -> list[int]:
    """feats [n, 3, H] of positions 0..n-1, tokens [n+1] (ids 0..n). Cells 0..n-1 run step 0 with
    (feats_t, x_{t+1}); the last cell then drafts k tokens, each step feeding its own h back."""
    n = feats.shape[0]
    dtype = drafter.fc.weight.dtype
    cache = StepCache()
    x = drafter.step(
        drafter.project(feats[None].to(dtype)),
        embed(tokens[None, 1:]).to(dtype),
        torch.arange(n, device=feats.device),
        cache,
    )
    h = x[:, -1:]
    drafts = []
    for j in range(k):
        top = int(drafter.logits(h)[0, -1].argmax())
        d = top + int(drafter.d2t[top])
        drafts.append(d)
        if j == k - 1:
            break
        pos = torch.tensor([n - 1 + j + 1], device=feats.device)
        h = drafter.step(h, embed(torch.tensor([[d]], device=feats.device)).to(dtype), pos, cache, q_offset=n - 1)
    return drafts


class ChainDrafter:
    """`draft_chain` for one decode, round after round, keeping the drafter's step-0 keys and values:
    a round runs step 0 only over the cells verified since the last one (an engine's draft KV cache
    does the same), so a round costs k drafter steps however long the sequence. The same drafts as
    `draft_chain` up to float summation order (tested)."""

    def __init__(self, drafter: Eagle3Drafter, embed):
        self.drafter, self.embed = drafter, embed
        self.cache, self.done = StepCache(), 0  # cells 0..done-1 have step-0 keys in the cache

    def step0(self, feats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """A new round: step 0 over the cells verified since the last one; h [1, 1, H] of the last cell."""
        d, n = self.drafter, feats.shape[0]
        dtype = d.fc.weight.dtype
        self.cache.new_round()
        h = d.step(
            d.project(feats[None, self.done :].to(dtype)),
            self.embed(tokens[None, self.done + 1 :]).to(dtype),
            torch.arange(self.done, n, device=feats.device),
            self.cache,
            q_offset=self.done,
        )[:, -1:]
        self.done = n
        return h

    @torch.inference_mode()
    def __call__(self, feats: torch.Tensor, tokens: torch.Tensor, k: int) -> list[int]:
        d, n, dev = self.drafter, feats.shape[0], feats.device
        dtype = d.fc.weight.dtype
        h = self.step0(feats, tokens)
        drafts = []
        for j in range(k):
            top = int(d.logits(h)[0, -1].argmax())
            drafts.append(top + int(d.d2t[top]))
            if j < k - 1:
                emb = self.embed(torch.tensor([[drafts[-1]]], device=dev)).to(dtype)
                h = d.step(h, emb, torch.tensor([n + j], device=dev), self.cache, q_offset=n - 1)
        return drafts


def speculative_decode(
    runner: TargetRunner,
    drafter: Eagle3Drafter,
    embed,
    prompt: list[int],
    max_new: int,
    eos: set,
    k: int,
    draft_fn=None,
) -> Decoded:
    """draft_fn(drafter, embed, feats, tokens, k) -> k drafts (tests pass oracles); by default a
    `ChainDrafter` of this decode. `Decoded.draft_seconds` is the time spent drafting."""
    if draft_fn is None:
        chain = ChainDrafter(drafter, embed)
        draft_fn = lambda _d, _e, feats, tokens, k: chain(feats, tokens, k)
    t0 = time.perf_counter()
    cache = DynamicCache()
    nxt, feats = runner.forward(prompt, cache, 0)
    prefill = time.perf_counter() - t0
    out = [nxt[-1]]
    seq = list(prompt) + out  # features are known for seq[:-1]
    forwards, accepted, drafting = 1, [], 0.0
    while len(out) < max_new and out[-1] not in eos:
        t_draft = time.perf_counter()
        drafts = draft_fn(drafter, embed, feats, torch.tensor(seq, device=feats.device), k)
        drafting += time.perf_counter() - t_draft
        n = len(seq) - 1  # KV cache holds positions 0..n-1
        greedy, new_feats = runner.forward([seq[-1]] + drafts, cache, n)
        forwards += 1
        a = 0
        while a < k and drafts[a] == greedy[a]:
            a += 1
        accepted.append(a)
        new = drafts[:a] + [greedy[a]]
        if a < k:  # drop the rejected drafts' keys/values (transformers 5: a negative count)
            cache.crop(-(k - a))
        assert cache.get_seq_length() == n + a + 1
        feats = torch.cat([feats, new_feats[: a + 1]])
        seq += new
        out += new
        out = cut_at_eos(out, eos)
    return Decoded(
        out[:max_new],
        time.perf_counter() - t0,
        target_forwards=forwards,
        accepted=accepted,
        draft_seconds=drafting,
        prefill_seconds=prefill,
    )


def cut_at_eos(out: list[int], eos: set) -> list[int]:
    """Up to and including the first end-of-turn id: where greedy decoding would have stopped."""
    for i, t in enumerate(out):
        if t in eos:
            return out[: i + 1]
    return out
