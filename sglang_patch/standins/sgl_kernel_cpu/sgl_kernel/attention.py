"""Plain-torch versions of the two attention ops of SGLang's `intel_amx` CPU backend, the CPU backend
that runs speculative verification (a tree mask) and multi-branch draft decoding. `torch_native`, the
backend capture uses, runs neither.

Attention over a paged KV cache: a request's keys are `k_buffer[req_to_token[req, :seq_len]]`.
Float32 arithmetic, a loop over requests. Sliding windows, sinks, cross-attention and logit caps are
refused: no model eaglenest serves through this stand-in uses them."""

import torch


def _refuse(logit_cap, is_cross, window, sinks) -> None:
    if logit_cap and logit_cap > 0 or is_cross or window and window > 0 or sinks is not None:
        raise NotImplementedError(
            "eaglenest's CPU stand-in attention has no logit cap, cross-attention, sliding window or sinks"
        )


def _attend(q, k, v, scale, visible=None):
    """q [n, H, D] over k/v [m, Hkv, D]; visible [n, m] bool or None (all). Returns [n, H, Dv] float32."""
    groups = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(groups, dim=1)
    v = v.float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q.float(), k) * scale
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnm,mhd->nhd", scores.softmax(-1), v)


def decode_attention_cpu(q, k_buffer, v_buffer, k_scale, v_scale, o, k_new, v_new, cache_loc, attn_logits,
                         req_to_token, req_pool_indices, seq_lens, sm_scale, logit_cap, is_cross, window,
                         encoder_lens, sinks) -> None:  # fmt: skip
    """One new token per row: store its key and value at cache_loc (when given), then attend over the
    row's `seq_lens` cached tokens, the new one included."""
    _refuse(logit_cap, is_cross, window, sinks)
    if k_new is not None:
        k_buffer[cache_loc.long()] = k_new.view(-1, *k_buffer.shape[1:]).to(k_buffer.dtype)
        v_buffer[cache_loc.long()] = v_new.view(-1, *v_buffer.shape[1:]).to(v_buffer.dtype)
    for i, (req, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        idx = req_to_token[req, :n].long()
        out = _attend(q[i : i + 1], k_buffer[idx] * k_scale, v_buffer[idx] * v_scale, sm_scale)
        o[i] = out[0].to(o.dtype)


def extend_attention_cpu(q, k, v, o, k_buffer, v_buffer, k_scale, v_scale, req_to_token, req_pool_indices,
                         seq_lens, extend_seq_lens, extend_start_loc, max_len_extend, sm_scale, logit_cap,
                         is_cross, window, encoder_lens, sinks, tree_mask, is_causal) -> None:  # fmt: skip
    """Each request's `extend_seq_lens` new tokens attend to its cached prefix (all of it) and to the new
    tokens: causally, or by `tree_mask` (SGLang's QLEN_ONLY layout: an n x n block per request, row =
    query, True = visible), or all of them when not causal."""
    _refuse(logit_cap, is_cross, window, sinks)
    mask_at = 0
    for req, total, n, start in zip(req_pool_indices.tolist(), seq_lens.tolist(), extend_seq_lens.tolist(),
                                    extend_start_loc.tolist()):  # fmt: skip
        prefix = total - n
        cached = req_to_token[req, :prefix].long()
        new = req_to_token[req, prefix:total].long()
        keys = k[start : start + n] if k is not None else k_buffer[new]
        vals = v[start : start + n] if v is not None else v_buffer[new]
        if prefix:  # no prefix: the new keys alone (an MLA model's MHA prefill passes them in another
            # layout than its latent cache's, and reads no cache)
            if keys.shape[1:] != k_buffer.shape[1:]:
                raise NotImplementedError("eaglenest's CPU stand-in attention: a cached prefix in another "
                                          f"layout ({tuple(k_buffer.shape[1:])}) than the new keys'")  # fmt: skip
            keys, vals = torch.cat([k_buffer[cached], keys]), torch.cat([v_buffer[cached], vals])
        keys, vals = keys * k_scale, vals * v_scale
        visible = torch.ones((n, total), dtype=torch.bool)
        if tree_mask is not None:
            visible[:, prefix:] = tree_mask[mask_at : mask_at + n * n].view(n, n).bool()
            mask_at += n * n
        elif is_causal:
            visible[:, prefix:] = torch.ones((n, n), dtype=torch.bool).tril()
        o[start : start + n] = _attend(q[start : start + n], keys, vals, sm_scale, visible).to(o.dtype)


def register() -> None:
    """Make them reachable as `torch.ops.sgl_kernel.<name>`, where the backend looks them up. Plain
    attributes, not registered operators: a registered `convert_weight_packed`-style op would tell
    SGLang the whole AMX kernel package is present."""
    ns = torch.ops.sgl_kernel
    ns.decode_attention_cpu = decode_attention_cpu
    ns.extend_attention_cpu = extend_attention_cpu
