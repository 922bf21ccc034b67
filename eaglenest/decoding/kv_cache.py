"""A transformers KV cache for long batched decoding: keys/values live in a buffer with spare room,
so appending a token writes in place instead of `torch.cat`-copying the whole cache every step
(at 768 rows x 1k tokens that copy is ~12 GB per step on a GPU). Rows can be dropped
(`batch_select_indices`) as they finish. Same arithmetic as `DynamicCache`: the attention reads a
view of exactly the cached length."""

import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    reserve = 0  # first allocation holds at least this many tokens (a known final length: no regrowth)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, m = self.get_seq_length(), key_states.shape[-2]
        buf = getattr(self, "_kbuf", None)
        # a buffer that no longer backs `keys` (rows selected, cropped below a copy) is rebuilt
        if (
            buf is None
            or n + m > buf.shape[-2]
            or buf.shape[0] != key_states.shape[0]
            or (n and self.keys.data_ptr() != buf.data_ptr())
        ):
            cap = max(64, 2 * (n + m), self.reserve if n == 0 else 0)
            # keys and values may differ in width (MLA: a value head narrower than its key head)
            kb = key_states.new_empty((*key_states.shape[:-2], cap, key_states.shape[-1]))
            vb = value_states.new_empty((*value_states.shape[:-2], cap, value_states.shape[-1]))
            if n:
                kb[..., :n, :] = self.keys
                vb[..., :n, :] = self.values
            self._kbuf, self._vbuf = kb, vb
        self._kbuf[..., n : n + m, :] = key_states
        self._vbuf[..., n : n + m, :] = value_states
        self.keys, self.values = self._kbuf[..., : n + m, :], self._vbuf[..., : n + m, :]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices`, spare room included (one copy, no regrowth on the next update)."""
        n = self.get_seq_length()
        if getattr(self, "_kbuf", None) is None or n == 0:
            return super().batch_select_indices(indices)
        self._kbuf, self._vbuf = self._kbuf[indices], self._vbuf[indices]
        self.keys, self.values = self._kbuf[..., :n, :], self._vbuf[..., :n, :]


def growing_cache(reserve: int = 0) -> DynamicCache:
    """`reserve`: tokens per row to allocate at once when the final length is known."""
    cache = DynamicCache()
    # each layer's cache is created on its first update
    cache.layer_class_to_replicate = type("ReservedLayer", (GrowingLayer,), {"reserve": reserve})
    return cache


def cache_kwarg(model) -> str:
    """transformers renamed the forward's cache argument (past_key_values -> cache, 5.2x)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
