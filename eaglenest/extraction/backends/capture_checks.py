"""The client's per-request checks of an SGLang capture (docs/design.md: Extraction). Any failure means the capture
does not hold every prompt position computed in one plain prefill, so it is never stored.

A server's response is untrusted input: the receipt's fields are type-checked, and the only file the
client ever reads or deletes for a request is `<capture dir>/<its rid>.safetensors`, a regular file
in the directory the client created or was given; a receipt naming any other path stops the stage."""

import os
import stat
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from eaglenest.runtime.errors import EaglenestError
from sglang_patch.protocol import CAPTURE_VERSION, RECEIPT_KEY, capture_file


class CaptureRejected(Exception):
    """One capture failed a check; the request may be retried."""


RECEIPT_FIELDS = {"path": str, "n_positions": int, "prefix_len": int, "taps": list}


def capture_path(capture_dir: Path, rid: str) -> Path:
    """The one file a request may produce."""
    return Path(capture_dir).resolve() / capture_file(rid)


def check_receipt(meta: dict, n_sent: int, taps: list[int], expected: Path) -> dict:
    """Checks on the response alone; returns the receipt. `expected`: `capture_path` of this request."""
    if not isinstance(meta, dict):
        raise CaptureRejected(f"meta_info is a {type(meta).__name__}, not an object")
    cached = meta.get("cached_tokens", 0) or 0
    if cached != 0:
        raise CaptureRejected(
            f"cached_tokens={cached}: part of the prompt came from the prefix cache "
            f"(server started without --disable-radix-cache?)"
        )
    receipts = meta.get(RECEIPT_KEY)
    if not receipts:
        raise CaptureRejected(
            "no hs_capture receipt in meta_info: the server does not run the eaglenest capture "
            "plugin (start it with `python -m sglang_patch.launch`)"
        )
    if len(receipts) != 1 or receipts[0] is None:
        raise CaptureRejected(f"{len(receipts)} capture receipts for one request (chunked prefill?)")
    if not isinstance(receipts, list):
        raise CaptureRejected(f"{RECEIPT_KEY} is a {type(receipts).__name__}, not a list")
    rc = receipts[0]
    if not isinstance(rc, dict):
        raise CaptureRejected(f"capture receipt is a {type(rc).__name__}, not an object")
    for key, typ in RECEIPT_FIELDS.items():
        if not isinstance(rc.get(key), typ) or isinstance(rc.get(key), bool):
            raise CaptureRejected(f"capture receipt field {key!r} is {rc.get(key)!r}, not a {typ.__name__}")
    if Path(rc["path"]).resolve() != expected:
        # not a flaky capture: a server that names other files is misconfigured or hostile
        raise EaglenestError(
            f"SGLang server's capture receipt names {rc['path']!r}, but this request's capture can "
            f"only be {expected}; refusing to read or delete it (is the server's --capture-dir "
            f"{expected.parent}?)"
        )
    prompt = meta.get("prompt_tokens")
    if not rc["n_positions"] == prompt == n_sent:
        raise CaptureRejected(
            f"captured {rc['n_positions']} positions, prompt_tokens={prompt}, sent {n_sent} "
            f"(chunked prefill or truncation?)"
        )
    if rc["prefix_len"] != 0:
        raise CaptureRejected(f"prefix_len={rc['prefix_len']}: the prompt was not computed in one forward")
    if rc.get("capture_version") != CAPTURE_VERSION:
        raise CaptureRejected(
            f"server capture version {rc.get('capture_version')} != client {CAPTURE_VERSION}: "
            f"the server runs another sglang_patch; reinstall it (`make sglang-env`)"
        )
    if list(rc.get("taps", [])) != list(taps):
        raise CaptureRejected(
            f"server captures taps {rc.get('taps')}, this extraction needs {taps} "
            f"(start the server with --capture-taps {','.join(map(str, taps))})"
        )
    return rc


def load_capture(path: Path, ids: np.ndarray, n_aux: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Read and check one capture file; returns (aux [n, K, H], final [n, H]) in bfloat16."""
    n = len(ids)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise CaptureRejected(f"capture file {path} is not a regular file (a link or device?)")
        with safe_open(str(path), framework="pt") as f:
            got_ids, aux, final = f.get_tensor("input_ids"), f.get_tensor("aux"), f.get_tensor("final")
    except CaptureRejected:
        raise
    except Exception as e:  # OSError, KeyError, safetensors' SafetensorError (an Exception from 0.8)
        raise CaptureRejected(f"capture file {path} unreadable: {type(e).__name__}: {e}") from None
    if not np.array_equal(got_ids.numpy(), np.asarray(ids, dtype=np.int64)):
        raise CaptureRejected(f"capture file {path}: token ids differ from the ids sent")
    if tuple(aux.shape) != (n, n_aux, hidden) or tuple(final.shape) != (n, hidden):
        raise CaptureRejected(
            f"capture file {path}: aux {tuple(aux.shape)} / final {tuple(final.shape)}, expected "
            f"({n}, {n_aux}, {hidden}) / ({n}, {hidden})"
        )
    if not (torch.isfinite(aux).all() and torch.isfinite(final).all()):
        raise CaptureRejected(f"capture file {path}: NaN or Inf values")
    return aux.to(torch.bfloat16), final.to(torch.bfloat16)


def remove(path: Path) -> None:
    """Delete a request's own capture file (a link there is removed, never followed)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
