"""The TTT loss head without full draft-vocabulary logits in memory (docs/design.md: Drafter and training,
Performance): for every step k, logits = h_k @ W^T chunk by chunk, soft cross-entropy against the
teacher's distribution, and the gradients w.r.t. h_k and W computed right there (d CE / d logits
= softmax - p, since p sums to 1). Backward only scales the stored gradients: no logits are kept
and none recomputed. On CUDA the per-chunk softmax / CE / gradient is one compiled kernel pair
instead of ~10 passes over fp32 [chunk, Vd] temporaries. Numerically the same loss as
`ttt.ttt_loss(fused=False)`."""

import torch
import torch.nn.functional as F

_compiled = None


def _chunk_ce(logits, p, top, w, need_grad: bool, topk: int = 0, topk_weight: float = 0.0, align_topk: int = 0):
    """logits [n, V] (compute dtype), p [n, V] fp32, top [n], w [n] -> CE [n], objective [n] (CE plus
    the top-K term), correct [n], aligned [n] (top within the drafter's top-`align_topk`; None at 0),
    d objective / d logits * w.

    The top-K term (HASS) -sum over the teacher's top-K tokens of p log q is CE against the teacher
    reweighted to p * (1 + topk_weight on its top-K), whose mass s is no longer 1: d / d logits = q s - p'."""
    logp = F.log_softmax(logits.float(), -1)
    ce = -(p * logp).sum(-1)
    correct = (logp.argmax(-1) == top).float()
    aligned = None
    if align_topk:
        aligned = ((logp > logp.gather(-1, top.clamp(min=0)[:, None])).sum(-1) < align_topk).float()
    if not topk:
        g = ((logp.exp() - p) * w[:, None]).to(logits.dtype) if need_grad else None
        return ce, ce, correct, aligned, g
    extra = torch.zeros_like(p).scatter_(-1, p.topk(topk, -1).indices, topk_weight) * p
    objective = ce - (extra * logp).sum(-1)
    g = None
    if need_grad:
        g = ((logp.exp() * (1.0 + extra.sum(-1, keepdim=True)) - p - extra) * w[:, None]).to(logits.dtype)
    return ce, objective, correct, aligned, g


def _chunk_fn(device_type: str, compile_kernel: bool):
    global _compiled
    if device_type != "cuda" or not compile_kernel:
        return _chunk_ce
    if _compiled is None:
        _compiled = torch.compile(_chunk_ce)
    return _compiled


@torch.no_grad()
def teacher_targets(final: torch.Tensor, head: torch.Tensor, K: int, chunk: int = 512):
    """Teacher distribution over the draft vocabulary, softmax(final @ head^T) in fp32, and its
    argmax, for the flattened rows of `final` [B, T, H], followed by K + 1 zero rows (so step k's
    row r reads row r + 1 + k without bounds checks; those rows are masked anyway). Chunked: no
    full fp32 logits next to the probabilities."""
    rows = final.reshape(-1, final.shape[-1])
    N, V = rows.shape[0], head.shape[0]
    p = torch.zeros(N + K + 1, V, dtype=torch.float32, device=final.device)
    top = torch.full((N + K + 1,), -1, dtype=torch.long, device=final.device)
    for c0 in range(0, N, chunk):
        c1 = min(N, c0 + chunk)
        logits = rows[c0:c1] @ head.T.to(rows.dtype)
        p[c0:c1] = torch.softmax(logits, -1, dtype=torch.float32)
        top[c0:c1] = logits.argmax(-1)
    return p, top


class _StepsLinearSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, W, teacher_p, teacher_top, masks, scales, chunk, compute_dtype, compile_kernel, recipe, *hs):
        N, K = hs[0].shape[0], len(hs)
        topk, topk_weight, align_topk = recipe
        need_grad = any(ctx.needs_input_grad)  # evaluation: the loss only
        Wc = W.detach().to(compute_dtype)
        gW = torch.zeros(W.shape, dtype=torch.float32, device=W.device)
        loss = torch.zeros((), dtype=torch.float32, device=W.device)
        stats = torch.zeros(K, 3, dtype=torch.float32, device=W.device)
        fn = _chunk_fn(W.device.type, compile_kernel)
        # token alignment: a cell whose earlier steps already left the target's path trains no further step
        alive = torch.ones(N, dtype=torch.float32, device=W.device) if align_topk else None
        grads = []
        for k, h in enumerate(hs):
            gh = torch.empty(h.shape, dtype=compute_dtype, device=h.device)  # g @ Wc is in compute dtype anyway
            for c0 in range(0, N, chunk):
                c1 = min(N, c0 + chunk)
                hc = h[c0:c1].detach().to(compute_dtype)
                m = masks[k, c0:c1]
                w = m * scales[k] if alive is None else m * alive[c0:c1] * scales[k]
                # row r predicts from teacher row r + 1 + k
                ce, objective, correct, aligned, g = fn(
                    hc @ Wc.T,
                    teacher_p[c0 + 1 + k : c1 + 1 + k],
                    teacher_top[c0 + 1 + k : c1 + 1 + k],
                    w,
                    need_grad,
                    topk,
                    topk_weight,
                    align_topk,
                )
                loss += (objective * w).sum()
                stats[k, 0] += (ce * m).sum()
                stats[k, 1] += (correct * m).sum()
                stats[k, 2] += m.sum()
                if alive is not None:
                    alive[c0:c1] *= aligned
                if need_grad:
                    gh[c0:c1] = g @ Wc
                    _accumulate(gW, g.T, hc)
            grads.append(gh)
        ctx.save_for_backward(gW, *grads)
        ctx.w_dtype = W.dtype
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(ctx, gloss, _gstats):
        gW, *grads = ctx.saved_tensors
        gW = gW.mul_(gloss)  # in place: no second [Vd, H] fp32 buffer (backward runs once)
        # autograd casts each h-gradient back to h's dtype
        return (gW.to(ctx.w_dtype), *[None] * 8, *[g * gloss.to(g.dtype) for g in grads])


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b without a rounded temporary where cuBLAS can add bf16 products into fp32."""
    if a.dtype != acc.dtype and acc.is_cuda:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (TypeError, RuntimeError, NotImplementedError):
            pass
    acc += (a @ b).float()


def steps_linear_soft_ce(
    hs: list[torch.Tensor],
    W: torch.Tensor,
    teacher_p: torch.Tensor,
    teacher_top: torch.Tensor,
    masks: torch.Tensor,
    scales: list[float],
    chunk: int = 2048,
    compile_kernel: bool = True,
    recipe: tuple[int, float, int] = (0, 0.0, 0),
):
    """hs: K step outputs [B, T, H] (after the final norm); W [Vd, H]; teacher_p / teacher_top from
    `teacher_targets`; masks [K, B, T]. Loss = sum_k scales[k] * sum_t masks[k, t] * CE(p[t+1+k], h_k[t] W^T).
    Returns (loss, stats [K, 3] = per-step masked CE sum, correct top-1, mask count). compile_kernel:
    the per-chunk arithmetic as one compiled kernel on CUDA (benches turn it off to measure it).
    recipe: (topk, topk_weight, align_topk), `ttt.Recipe`; the stats stay the plain CE and top-1 either way."""
    B, T, H = hs[0].shape
    K = len(hs)
    # flattened rows: a row past its own sequence reads the next one, but its mask is zero there
    dev = W.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hs[0].dtype
    with torch.autocast(dev, enabled=False):
        # scales stay Python floats: a tensor built from them is a pageable host-to-device copy,
        # which stalls the CPU until the GPU has drained the whole forward
        return _StepsLinearSoftCE.apply(
            W,
            teacher_p,
            teacher_top,
            masks.reshape(K, B * T).float(),
            tuple(float(x) for x in scales),
            chunk,
            dtype,
            compile_kernel,
            tuple(recipe),
            *[h.reshape(B * T, H) for h in hs],
        )
