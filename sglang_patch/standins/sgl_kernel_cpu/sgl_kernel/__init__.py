"""CPU-ONLY STAND-IN for SGLang's kernel package (`sgl_kernel`), which is not published on PyPI
for CPU (it is built from source: docs/platforms/cpu_server.md of SGLang).

SGLang's CPU path calls `assign_req_to_token_pool_cpu` on every prefill; this module provides it
in plain torch. A few more names are imported at startup but only called by features capture never
uses (KV moves, speculative decoding): they exist and raise when called. Every other name raises
ImportError/AttributeError, so SGLang takes its `forward_native` fallbacks (no AMX-packed weights).
`sglang_patch.launch` puts this directory on PYTHONPATH only for `--device cpu` and only when no real
`sgl_kernel` is installed."""

import torch

STANDIN = True


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


def _not_provided(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not implemented by eaglenest's CPU stand-in; "
            f"install SGLang's CPU kernel package for this feature"
        )

    op.__name__ = name
    return op


# Imported at module level by SGLang's CPU path but only called by features capture never uses
# (moving KV entries, speculative decoding): they exist, and raise if ever called.
for _name in (
    "copy_all_layer_kv_cache_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "build_draft_decode_metadata_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
):
    globals()[_name] = _not_provided(_name)


def __getattr__(name: str):
    raise AttributeError(
        f"sgl_kernel.{name} is not provided by eaglenest's CPU stand-in "
        f"(only assign_req_to_token_pool_cpu is); install SGLang's CPU kernel package for it"
    )
