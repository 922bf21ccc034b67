"""bfloat16 <-> uint16 bit patterns. zarr has no bfloat16 type, so stores keep the raw bits as
uint16 and declare the meaning in attributes; the round trip is bit-exact by construction."""

import numpy as np
import torch


def to_bits(t: torch.Tensor) -> np.ndarray:
    if t.dtype != torch.bfloat16:
        t = t.to(torch.bfloat16)
    return t.contiguous().cpu().view(torch.int16).numpy().view(np.uint16)


def from_bits(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
