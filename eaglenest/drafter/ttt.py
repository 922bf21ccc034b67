"""Training-time test (docs/design.md: Drafter and training): unroll the drafter K steps over every position at once.

Cell t at step k: hidden input = the drafter's own h from step k-1 (fc(aux_t) at step 0), token input
= x_{t+1+k} (teacher forcing), RoPE position t+k; it attends to the step-0 keys of cells <= t and to
its own keys of steps 1..k. Teacher = softmax over the draft vocabulary of lm_head_T(final_{t+1+k}),
the target's distribution of x_{t+2+k}; the mask is that of the predicted token x_{t+2+k}, and only
positions whose teacher argmax lies in the draft vocabulary count. Loss = sum_k 0.8^k CE_k."""

import torch

from eaglenest.drafter.fused_loss import steps_linear_soft_ce, teacher_targets
from eaglenest.drafter.model import shift_left as shift
from eaglenest.drafter.model import soft_ce


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
):
    """Weighted loss whose per-step sums are divided by `denominators` (the step's masked-token count
    over the whole global batch, so micro-batches and ranks add up to one global mean).
    Returns (loss, stats) with per-step sums of CE, correct top-1 and mask. fused=True computes the
    same loss through `fused_loss` (no full-vocabulary logits kept); False is the plain reference.
    compile_kernel: fused_loss's compiled chunk kernel on CUDA (benches switch it off)."""
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
        )
    with torch.no_grad():
        teacher_logits = (batch["final"] @ head_sel.T.to(batch["final"].dtype)).float()
        teacher_p = torch.softmax(teacher_logits, -1)
        teacher_top = teacher_logits.argmax(-1)
    loss, stats = 0.0, []
    for k, logits in enumerate(drafter(batch["aux"], batch["input_ids"], embed, K)):
        target = shift(teacher_p, 1 + k)
        m = masks[k]
        ce = soft_ce(logits, target)
        loss = loss + (decay**k) * (ce * m).sum() / max(denominators[k], 1.0)
        correct = ((logits.argmax(-1) == shift(teacher_top, 1 + k)).float() * m).sum()
        stats.append(torch.stack([(ce.detach() * m).sum(), correct.detach(), m.sum()]))
    return loss, torch.stack(stats)
