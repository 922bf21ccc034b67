"""Training-time-test attention as one fused kernel (CUDA): FlexAttention over the step-0 keys
followed by the diagonal keys of steps 1..k, with a block-sparse mask. Same result as the eager
attention in `drafter.Eagle3Attention`, without materialising [heads, T, T] scores per step.

Key index j < T: step-0 key of cell j, visible to cell q when j <= q (causal). Key index
j = s*T + c (s >= 1): step-s key of cell c, visible only to cell q == c (the diagonal)."""

import functools

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

_flex = None


def _compiled():
    global _flex
    if _flex is None:
        # dynamic: the keys grow by T at every TTT step, so K steps x each batch length are that
        # many shapes; compiled per shape, the 9th hit torch's recompile limit and every later
        # call ran the eager kernel (6k instead of 54k tok/s, measured on the H200)
        _flex = torch.compile(flex_attention, dynamic=True)
    return _flex


def ttt_mask_mod(T: int):
    def mask_mod(b, h, q, kv):
        return ((kv < T) & (kv <= q)) | ((kv >= T) & (kv % T == q))

    return mask_mod


@functools.lru_cache(maxsize=64)
def ttt_block_mask(T: int, steps: int, device: str):
    return create_block_mask(ttt_mask_mod(T), None, None, T, T * steps, device=device)


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """q [B, nh, T, d]; keys/values: step 0 then steps 1..k, each [B, kvh, T, d] -> [B, nh, T, d]."""
    T = q.shape[2]
    k, v = torch.cat(keys, 2), torch.cat(values, 2)
    mask = ttt_block_mask(T, len(keys), str(q.device))
    fn = _compiled() if q.is_cuda else flex_attention  # CPU: the unfused reference implementation
    return fn(q, k.to(q.dtype), v.to(q.dtype), block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
