"""The client's per-request checks of an SGLang capture (DESIGN §6). Any failure means the capture
does not hold every prompt position computed in one plain prefill, so it is never stored."""
import os
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from sglang_patch.protocol import CAPTURE_VERSION, RECEIPT_KEY


class CaptureRejected(Exception):
    """One capture failed a check; the request may be retried."""


def check_receipt(meta: dict, n_sent: int, taps: list[int]) -> dict:
    """Checks on the response alone; returns the receipt."""
    cached = meta.get("cached_tokens", 0) or 0
    if cached != 0:
        raise CaptureRejected(f"cached_tokens={cached}: part of the prompt came from the prefix cache "
                              f"(server started without --disable-radix-cache?)")
    receipts = meta.get(RECEIPT_KEY)
    if not receipts:
        raise CaptureRejected("no hs_capture receipt in meta_info: the server does not run the eaglenest capture "
                              "plugin (start it with `python -m sglang_patch.launch`)")
    if len(receipts) != 1 or receipts[0] is None:
        raise CaptureRejected(f"{len(receipts)} capture receipts for one request (chunked prefill?)")
    rc = receipts[0]
    prompt = meta.get("prompt_tokens")
    if not rc["n_positions"] == prompt == n_sent:
        raise CaptureRejected(f"captured {rc['n_positions']} positions, prompt_tokens={prompt}, sent {n_sent} "
                              f"(chunked prefill or truncation?)")
    if rc["prefix_len"] != 0:
        raise CaptureRejected(f"prefix_len={rc['prefix_len']}: the prompt was not computed in one forward")
    if rc.get("capture_version") != CAPTURE_VERSION:
        raise CaptureRejected(f"server capture version {rc.get('capture_version')} != client {CAPTURE_VERSION}: "
                              f"the server runs another sglang_patch; reinstall it (`make sglang-env`)")
    if list(rc.get("taps", [])) != list(taps):
        raise CaptureRejected(f"server captures taps {rc.get('taps')}, this extraction needs {taps} "
                              f"(start the server with --capture-taps {','.join(map(str, taps))})")
    return rc


def load_capture(path: Path, ids: np.ndarray, n_aux: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Read and check one capture file; returns (aux [n, K, H], final [n, H]) in bfloat16."""
    n = len(ids)
    try:
        with safe_open(str(path), framework="pt") as f:
            got_ids, aux, final = f.get_tensor("input_ids"), f.get_tensor("aux"), f.get_tensor("final")
    except (OSError, ValueError, KeyError) as e:  # safetensors raises SafetensorError (a ValueError)
        raise CaptureRejected(f"capture file {path} unreadable: {e}")
    if not np.array_equal(got_ids.numpy(), np.asarray(ids, dtype=np.int64)):
        raise CaptureRejected(f"capture file {path}: token ids differ from the ids sent")
    if tuple(aux.shape) != (n, n_aux, hidden) or tuple(final.shape) != (n, hidden):
        raise CaptureRejected(f"capture file {path}: aux {tuple(aux.shape)} / final {tuple(final.shape)}, expected "
                              f"({n}, {n_aux}, {hidden}) / ({n}, {hidden})")
    if not (torch.isfinite(aux).all() and torch.isfinite(final).all()):
        raise CaptureRejected(f"capture file {path}: NaN or Inf values")
    return aux.to(torch.bfloat16), final.to(torch.bfloat16)


def remove(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
