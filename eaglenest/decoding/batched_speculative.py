"""Speculative decoding of many prompts at once (docs/design.md: Evaluate), for evaluation on a GPU: one target
forward verifies every row's chain of k drafts; each row accepts its own number. The same
decisions as `speculative.speculative_decode`, run side by side:

- The target's KV cache has one slot per verified token for every row; a row's rejected drafts
  stay in their slots but are masked out of attention (a 2-D attention mask with holes), and RoPE
  positions come per row, so each row sees exactly its own sequence.
- The drafter re-reads each row's accepted features (right-padded; causal attention keeps a row's
  cells off its padding) and drafts k tokens for all rows together, each row from its own last cell.
- `k = 0` is plain greedy decoding with the same machinery (the reference for the lossless check).

Rows leave the batch when they finish. Batched fp32 arithmetic is not bit-identical to batch 1 (the
reductions differ), so a greedy near-tie can in principle resolve differently than at batch 1.
`batched_tree` runs draft trees on the same `BatchTarget` and `Row`s."""

from dataclasses import dataclass, field

import torch
from torch.nn.utils.rnn import pad_sequence

from eaglenest.decoding.batch_decode import left_pad
from eaglenest.decoding.kv_cache import cache_kwarg, growing_cache
from eaglenest.decoding.speculative import cut_at_eos
from eaglenest.drafter.model import Eagle3Drafter, StepCache


@dataclass
class Row:
    seq: list  # prompt + output; features are known for seq[:-1]
    out: list
    feats: list = field(default_factory=list)  # aux [n, A, H] pieces, one per verification
    accepted: list = field(default_factory=list)


@torch.inference_mode()
def step0_rows(drafter: Eagle3Drafter, embed, rows: list[Row]) -> tuple[torch.Tensor, StepCache, torch.Tensor]:
    """Step 0 over every row's cells at once: (h [B, 1, H] of each row's last cell, the step cache
    holding every cell's keys, n [B] the rows' cell counts)."""
    feats = pad_sequence([torch.cat(r.feats) for r in rows], batch_first=True)  # [B, N, A, H]
    n = torch.tensor([len(r.seq) - 1 for r in rows], device=feats.device)
    tokens = pad_sequence([torch.tensor(r.seq[1:], device=feats.device) for r in rows], batch_first=True)
    dtype = drafter.fc.weight.dtype
    cache = StepCache()
    x = drafter.step(
        drafter.project(feats.to(dtype)),
        embed(tokens).to(dtype),
        torch.arange(feats.shape[1], device=feats.device),
        cache,
    )
    return x[torch.arange(len(rows), device=x.device), n - 1][:, None], cache, n


@torch.inference_mode()
def draft_chains(drafter: Eagle3Drafter, embed, rows: list[Row], k: int) -> torch.Tensor:
    """drafts [B, k] (target ids): each row's chain from its own last cell."""
    h, cache, n = step0_rows(drafter, embed, rows)
    last, dtype = n - 1, drafter.fc.weight.dtype
    drafts = []
    for j in range(k):
        top = drafter.logits(h)[:, -1].argmax(-1)
        d = top + drafter.d2t[top]
        drafts.append(d)
        if j < k - 1:
            h = drafter.step(h, embed(d[:, None]).to(dtype), (last + 1 + j)[:, None], cache, q_offset=last)
    return torch.stack(drafts, 1)


class BatchTarget:
    """The target over left-padded rows: one KV slot per token it has run for every row, and `valid`,
    the 2-D mask of the slots each row attends to (padding and rejected drafts are holes)."""

    def __init__(self, model, taps: list[int], prompts: list[list[int]], aux: bool):
        self.model, self.taps, self.aux = model, taps, aux
        self.dev = next(model.parameters()).device
        self.kw, self.cache = cache_kwarg(model), growing_cache()
        self.ids, self.valid = left_pad(prompts, 0, self.dev)

    def forward(self, x, positions, keep=0, mask=None):
        """(greedy ids [B, q], aux [B, q, A, H] or None); mask: a prepared 4-D mask for this call
        (draft trees), else `valid`."""
        out = self.model(
            input_ids=x,
            attention_mask=self.valid if mask is None else mask,
            position_ids=positions,
            use_cache=True,
            output_hidden_states=self.aux,
            logits_to_keep=keep,
            **{self.kw: self.cache},
        )
        aux = torch.stack([out.hidden_states[j] for j in self.taps], 2) if self.aux else None
        return out.logits.argmax(-1), aux

    def start(self, prompts: list[list[int]]) -> list[Row]:
        """The prompts' forward: rows holding their first token (and the prompts' features)."""
        greedy, aux = self.forward(self.ids, (self.valid.cumsum(-1) - 1).clamp(min=0), keep=1)
        rows, L = [Row(seq=list(p), out=[]) for p in prompts], self.ids.shape[1]
        for r, (row, p) in enumerate(zip(rows, prompts)):
            row.seq.append(int(greedy[r, -1]))
            row.out.append(row.seq[-1])
            if self.aux:
                row.feats.append(aux[r, L - len(p) :])
        return rows

    def keep(self, live: list[int], rows: list[Row], max_new: int, eos: set) -> list[int]:
        """Drop the rows that finished; the live rows' indices."""
        keep = [b for b, r in enumerate(live) if not _finished(rows[r], max_new, eos)]
        if len(keep) < len(live):
            idx = torch.tensor(keep, device=self.dev, dtype=torch.long)
            self.cache.batch_select_indices(idx)
            self.valid = self.valid[idx]
        return [live[b] for b in keep]


def advance(row: Row, new: list[int], feats: torch.Tensor | None, accepted: int) -> None:
    """A verification's outcome for one row: its new tokens, and (speculating) their features."""
    if feats is not None:
        row.feats.append(feats)
        row.accepted.append(accepted)
    row.seq += new
    row.out += new


def finish(rows: list[Row], max_new: int, eos: set) -> list[Row]:
    for row in rows:
        row.out = cut_at_eos(row.out, eos)[:max_new]
    return rows


@torch.inference_mode()
def decode(
    model,
    taps: list[int],
    prompts: list[list[int]],
    max_new: int,
    eos: set,
    k: int = 0,
    drafter: Eagle3Drafter | None = None,
    embed=None,
    draft_fn=draft_chains,
) -> list[Row]:
    """Greedy (k = 0) or speculative decoding of every prompt; rows in prompt order. `draft_fn`
    (drafter, embed, live rows, k) -> drafts [b, k]: tests pass an oracle."""
    target = BatchTarget(model, taps, prompts, aux=k > 0)
    dev = target.dev
    rows = target.start(prompts)
    live = target.keep(list(range(len(rows))), rows, max_new, eos)
    while live:
        lr = [rows[r] for r in live]
        last = torch.tensor([r.seq[-1] for r in lr], device=dev)[:, None]
        drafts = draft_fn(drafter, embed, lr, k) if k > 0 else last[:, :0]
        x = torch.cat([last, drafts], 1)  # [b, k+1]
        pos = torch.tensor([len(r.seq) - 1 for r in lr], device=dev)[:, None] + torch.arange(k + 1, device=dev)
        target.valid = torch.cat([target.valid, torch.ones_like(x)], 1)
        greedy, aux = target.forward(x, pos)
        match = (drafts == greedy[:, :k]).long().cumprod(1).sum(1)  # leading accepted drafts
        a_all, g_all, d_all = match.tolist(), greedy.tolist(), drafts.tolist()
        target.valid[:, -(k + 1) :] = (torch.arange(k + 1, device=dev) <= match[:, None]).long()  # rejected: masked
        for b, row in enumerate(lr):
            a = a_all[b]
            advance(row, d_all[b][:a] + [g_all[b][a]], aux[b, : a + 1] if k > 0 else None, a)
        live = target.keep(live, rows, max_new, eos)
    return finish(rows, max_new, eos)


def _finished(row: Row, max_new: int, eos: set) -> bool:
    return len(row.out) >= max_new or any(t in eos for t in row.out)
