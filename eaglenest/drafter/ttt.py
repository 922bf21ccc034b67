"""Training-time test (docs/design.md: Drafter and training): unroll the drafter K steps over every position at once.

Cell t at step k: hidden input = the drafter's own h from step k-1 (fc(aux_t) at step 0), token input
= x_{t+1+k} (teacher forcing), RoPE position t+k; it attends to the step-0 keys of cells <= t and to
its own keys of steps 1..k. Teacher = softmax over the draft vocabulary of lm_head_T(final_{t+1+k}),
the target's distribution of x_{t+2+k}; the mask is that of the predicted token x_{t+2+k}, and only
positions whose teacher argmax lies in the draft vocabulary count. Loss = sum_k decay^k CE_k, plus
the recipe's options (`Recipe`, off by default; docs/design.md: Recipe options)."""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from eaglenest.drafter.fused_loss import steps_linear_soft_ce, teacher_targets
from eaglenest.drafter.model import shift_left as shift


class Recipe(NamedTuple):
    """Loss options beyond soft CE. topk / topk_weight: HASS's top-K distillation term, -sum over the
    teacher's top-K tokens of p log q, weighted. align_topk: step k > 0 trains a cell only where the
    target's argmax was within the drafter's top-`align_topk` at every earlier step (GRIFFIN's token
    alignment: a draft already off the target's path is rejected at serving time)."""

    topk: int = 0
    topk_weight: float = 0.0
    align_topk: int = 0


OFF = Recipe()


def step_masks(batch: dict, K: int) -> list[torch.Tensor]:
    """Mask of step k at cell t: loss_mask[t+2+k] * in_vocab[t+1+k] (zero past the end)."""
    return [(shift(batch["loss_mask"], 2 + k) * shift(batch["in_vocab"], 1 + k)).float() for k in range(K)]


def ttt_loss(
    drafter,
    batch: dict,
    embed,
    head_sel: torch.Tensor,
    K: int,
    denominators: list[float],
    decay: float = 0.8,
    fused: bool = True,
    compile_kernel: bool = True,
    recipe: Recipe = OFF,
):
    """Weighted loss whose per-step sums are divided by `denominators` (the step's masked-token count
    over the whole global batch, so micro-batches and ranks add up to one global mean).
    Returns (loss, stats) with per-step sums of CE, correct top-1 and mask. fused=True computes the
    same loss through `fused_loss` (no full-vocabulary logits kept); False is the plain reference.
    compile_kernel: fused_loss's compiled chunk kernel on CUDA (benches switch it off). recipe: `Recipe`;
    the stats are the plain CE and top-1 under any recipe."""
    masks = step_masks(batch, K)
    if fused:
        teacher_p, teacher_top = teacher_targets(batch["final"], head_sel, K)
        hs = drafter(batch["aux"], batch["input_ids"], embed, K, logits=False)
        head = getattr(drafter, "module", drafter).lm_head.weight  # through a DDP wrapper too
        return steps_linear_soft_ce(
            hs,
            head,
            teacher_p,
            teacher_top,
            torch.stack(masks),
            [decay**k / max(denominators[k], 1.0) for k in range(K)],
            compile_kernel=compile_kernel,
            recipe=recipe,
        )
    with torch.no_grad():
        teacher_logits = (batch["final"] @ head_sel.T.to(batch["final"].dtype)).float()
        teacher_p = torch.softmax(teacher_logits, -1)
        teacher_top = teacher_logits.argmax(-1)
    loss, stats, alive = 0.0, [], 1.0
    for k, logits in enumerate(drafter(batch["aux"], batch["input_ids"], embed, K)):
        target, top = shift(teacher_p, 1 + k), shift(teacher_top, 1 + k)
        m = masks[k]
        logp = F.log_softmax(logits.float(), -1)
        ce = -(target * logp).sum(-1)  # soft CE (= forward KL + const), its log-probabilities reused below
        objective = ce
        if recipe.topk:
            on_top = torch.zeros_like(target).scatter_(-1, target.topk(recipe.topk, -1).indices, recipe.topk_weight)
            objective = ce - (on_top * target * logp).sum(-1)
        loss = loss + (decay**k) * (objective * m * alive).sum() / max(denominators[k], 1.0)
        if recipe.align_topk:
            alive = alive * ((logp > logp.gather(-1, top[..., None])).sum(-1) < recipe.align_topk).float()
        correct = ((logits.argmax(-1) == top).float() * m).sum()
        stats.append(torch.stack([(ce.detach() * m).sum(), correct.detach(), m.sum()]))
    return loss, torch.stack(stats)
