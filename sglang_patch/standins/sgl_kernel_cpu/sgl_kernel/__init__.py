"""CPU-ONLY STAND-IN for SGLang's kernel package (`sgl_kernel`), which is not published on PyPI
for CPU (it is built from source: docs/platforms/cpu_server.md of SGLang).

Plain torch, written from what each op must do (SGLang's own Triton versions for other devices
define it), for the ops two uses of SGLang on a CPU reach:
- every server: `assign_req_to_token_pool_cpu` on every prefill (below);
- EAGLE speculative decoding, chains and trees (`sglang_patch.serve`): the tree, cache-slot and
  KV-move ops (`speculative`), and the `intel_amx` backend's two attention ops (`attention`), the
  only CPU attention backend that verifies a token tree.
Every other name raises ImportError/AttributeError, so SGLang takes its `forward_native` fallbacks
(no AMX-packed weights). `sglang_patch.launch` and `sglang_patch.serve` put this directory on
PYTHONPATH only for `--device cpu` and only when no real `sgl_kernel` is installed."""

import torch

from . import attention
from .speculative import (  # noqa: F401  (SGLang imports them from here)
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    build_draft_decode_metadata_cpu,
    build_tree_kernel_efficient_cpu,
    copy_all_layer_kv_cache_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    rotate_input_ids_cpu,
    verify_tree_greedy_cpu,
)

STANDIN = True
attention.register()


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[req, start:end] = the request's slice of the flat out_cache_loc, request by request."""
    offset = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        if n > 0:
            req_to_token[req, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def __getattr__(name: str):
    raise AttributeError(
        f"sgl_kernel.{name} is not provided by eaglenest's CPU stand-in; install SGLang's CPU kernel package for it"
    )
