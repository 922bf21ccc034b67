"""Per-request capture files: cut one prefill batch into its requests' rows and write each as
safetensors (never pickle), 0600, under a temporary name then renamed, so a reader never sees a
half-written file. Independent of SGLang's classes, so it is tested without a server."""

import os
import re
from dataclasses import dataclass

import torch
from safetensors.torch import save

from .protocol import CAPTURE_VERSION, capture_file

_SAFE_RID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


@dataclass
class RequestRows:
    index: int  # position of the request in the batch (index into customized_info lists)
    rid: str
    start: int  # first row of this request in the batch's flattened extend rows
    length: int  # rows computed in this forward (== prompt length when nothing was cached or chunked)
    prefix_len: int  # tokens of the prompt NOT computed in this forward (cache hit or earlier chunk)


def requests_in_batch(rids, seq_lens, prefix_lens, rid_prefix: str) -> list[RequestRows]:
    """The batch's requests that belong to the client; others (the server's warm-up) are skipped."""
    out, start = [], 0
    for i, (rid, n, p) in enumerate(zip(rids, seq_lens, prefix_lens)):
        if isinstance(rid, str) and rid.startswith(rid_prefix):
            out.append(RequestRows(i, rid, start, int(n), int(p)))
        start += int(n)
    return out


def aux_rows(aux, hidden: int) -> torch.Tensor:
    """SGLang hands aux as a list of K [T, H] tensors or one packed [T, K*H]; return [T, K, H]."""
    if isinstance(aux, (list, tuple)):
        return torch.stack(list(aux), dim=1)
    return aux.reshape(aux.shape[0], -1, hidden)


class CaptureWriter:
    def __init__(self, directory: str, taps: list[int]):
        self.dir, self.taps = directory, list(taps)
        os.makedirs(directory, mode=0o700, exist_ok=True)

    def path_for(self, rid: str) -> str:
        if not _SAFE_RID.match(rid):  # the rid becomes a file name: nothing that could leave the directory
            raise ValueError(f"request id {rid!r} is not a safe file name")
        return os.path.join(self.dir, capture_file(rid))

    def write(
        self, req: RequestRows, input_ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor, write: bool = True
    ) -> dict:
        """Write rows [start, start+length) of the batch; returns the receipt for meta_info."""
        path = self.path_for(req.rid)
        sl = slice(req.start, req.start + req.length)
        if write:
            tensors = {
                "input_ids": input_ids[sl].to("cpu", torch.int64).contiguous(),
                "aux": aux[sl].to("cpu").contiguous(),
                "final": final[sl].to("cpu").contiguous(),
            }
            meta = {
                "rid": req.rid,
                "prefix_len": str(req.prefix_len),
                "taps": ",".join(map(str, self.taps)),
                "capture_version": str(CAPTURE_VERSION),
            }
            blob = save(tensors, metadata=meta)
            tmp = os.path.join(self.dir, f".{req.rid}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                os.replace(tmp, path)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
        return {
            "path": path,
            "n_positions": req.length,
            "prefix_len": req.prefix_len,
            "taps": self.taps,
            "capture_version": CAPTURE_VERSION,
        }
