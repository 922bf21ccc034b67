"""The TTT loss head without full draft-vocabulary logits in memory (DESIGN §9, issue: GPU
performance): for every step k, logits = h_k @ W^T chunk by chunk, soft cross-entropy against the
teacher's distribution, and the gradients w.r.t. h_k and W computed right there (d CE / d logits
= softmax - p, since p sums to 1). Backward only scales the stored gradients: no logits are kept
and none recomputed. Numerically the same loss as `ttt.ttt_loss(fused=False)`."""
import torch
import torch.nn.functional as F


class _StepsLinearSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, W, teacher, masks, scales, chunk, compute_dtype, *hs):
        N, K = hs[0].shape[0], len(hs)
        need_grad = any(ctx.needs_input_grad)  # evaluation: the loss only
        Wc = W.detach().to(compute_dtype)
        gW = torch.zeros(W.shape, dtype=torch.float32, device=W.device)
        teacher_p, teacher_top = torch.softmax(teacher, -1), teacher.argmax(-1)  # once for all steps
        loss = torch.zeros((), dtype=torch.float32, device=W.device)
        stats = torch.zeros(K, 3, dtype=torch.float32, device=W.device)
        grads = []
        for k, h in enumerate(hs):
            gh = torch.empty_like(h)
            for c0 in range(0, N, chunk):
                c1 = min(N, c0 + chunk)
                hc = h[c0:c1].detach().to(compute_dtype)
                logp = F.log_softmax((hc @ Wc.T).float(), -1)
                p = teacher_p[c0 + 1 + k:c1 + 1 + k]        # row r predicts from row r + 1 + k
                m = masks[k, c0:c1]
                ce = -(p * logp).sum(-1)
                w = m * scales[k]
                loss += (ce * w).sum()
                stats[k, 0] += (ce * m).sum()
                stats[k, 1] += ((logp.argmax(-1) == teacher_top[c0 + 1 + k:c1 + 1 + k]).float() * m).sum()
                stats[k, 2] += m.sum()
                if need_grad:
                    g = ((logp.exp_() - p) * w[:, None]).to(compute_dtype)
                    gh[c0:c1] = (g @ Wc).to(h.dtype)
                    _accumulate(gW, g.T, hc)
            grads.append(gh)
        ctx.save_for_backward(gW, *grads)
        ctx.w_dtype = W.dtype
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(ctx, gloss, _gstats):
        gW, *grads = ctx.saved_tensors
        return ((gW * gloss).to(ctx.w_dtype), None, None, None, None, None, *[g * gloss.to(g.dtype) for g in grads])


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b without a rounded temporary where cuBLAS can add bf16 products into fp32."""
    if a.dtype != acc.dtype and acc.is_cuda:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (TypeError, RuntimeError, NotImplementedError):
            pass
    acc += (a @ b).float()


def steps_linear_soft_ce(hs: list[torch.Tensor], W: torch.Tensor, teacher: torch.Tensor, masks: torch.Tensor,
                         scales: list[float], chunk: int = 2048):
    """hs: K step outputs [B, T, H] (after the final norm); W [Vd, H]; teacher logits [B, T, Vd];
    masks [K, B, T]. Loss = sum_k scales[k] * sum_t masks[k, t] * CE(softmax(teacher[t+1+k]), h_k[t] W^T).
    Returns (loss, stats [K, 3] = per-step masked CE sum, correct top-1, mask count)."""
    B, T, H = hs[0].shape
    K = len(hs)
    # flattened rows: a row past its own sequence reads the next one, but its mask is zero there
    flat_t = torch.cat([teacher.reshape(B * T, -1).float(),
                        torch.zeros(K + 1, teacher.shape[-1], device=teacher.device)], 0)
    dev = W.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hs[0].dtype
    with torch.autocast(dev, enabled=False):
        return _StepsLinearSoftCE.apply(W, flat_t, masks.reshape(K, B * T).float(),
                                        torch.tensor(scales, dtype=torch.float32, device=W.device), chunk, dtype,
                                        *[h.reshape(B * T, H) for h in hs])
