"""vLLM's own hidden-state extraction path (the `extract_hidden_states` speculative method, which
caches the states of `eagle_aux_hidden_state_layer_ids` per request) with a connector that also
works on the CPU. vLLM's `ExampleHiddenStatesConnector` copies each finished request's states to
pinned memory on a CUDA stream and writes them in a thread; on the CPU build there is neither, and
it fails (`pin_memory=True requires a CUDA ... backend`). This subclass takes the same rows out of
the cache and writes the same safetensors file ({"hidden_states": [n, ids, H], "token_ids": [n]})
at once, before the request is reported done, under the lock file vLLM's reader waits on.

Loaded by the server through `--kv-transfer-config '{"kv_connector": "CaptureConnector",
"kv_connector_module_path": "vllm_patch.capture", ...}'` (eaglenest/extraction/backends/vllm.py)."""

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Written:
    """What vLLM polls for a request's copy: done, the file is already written."""

    def query(self) -> bool:
        return True


class CaptureConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (block_ids[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        n = pending.token_ids.shape[0]
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), n).cpu().contiguous()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)  # held LOCK_EX since wait_for_save
        try:
            tmp = pending.filename + ".tmp"
            save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, tmp)
            os.replace(tmp, pending.filename)  # never a half-written file under the final name
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the lock: the reader proceeds
        self._req_copy_events[pending.req_id] = _Written()
