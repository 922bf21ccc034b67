"""How a store keeps the hidden states (`store.states`, docs/design.md: Store).

    bf16  aux [n, A, H] and final [n, H] as uint16 bit patterns: bit-exact.
    fp8   e4m3 bit patterns (uint8) with one float32 scale per token and tap, x ~= q * scale,
          scale = amax / 448: half the bytes, each element within 2^-4 of its value (3 mantissa
          bits), which the validation gate bounds like any other precision loss.

Readers always get bf16 back (`decode`), so pack, the gate and training never see the format.
The digest covers the arrays as stored (scales included)."""

import numpy as np
import torch

from eaglenest.runtime.errors import EaglenestError

FORMATS = ("bf16", "fp8")
E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def check(states: str) -> str:
    if states not in FORMATS:
        raise EaglenestError(f"store.states must be one of {', '.join(FORMATS)}, got {states!r}")
    return states


def arrays(states: str, n_aux: int, hidden: int) -> dict[str, tuple[tuple, np.dtype]]:
    """The stored state arrays of a format: name -> (shape of one token's row, dtype), in digest order."""
    if check(states) == "bf16":
        return {"aux": ((n_aux, hidden), np.dtype(np.uint16)), "final": ((hidden,), np.dtype(np.uint16))}
    return {
        "aux": ((n_aux, hidden), np.dtype(np.uint8)),
        "aux_scale": ((n_aux,), np.dtype(np.float32)),
        "final": ((hidden,), np.dtype(np.uint8)),
        "final_scale": ((), np.dtype(np.float32)),
    }


def describe(states: str) -> str:
    return {
        "bf16": "aux/final: uint16 bit patterns of bfloat16 (view as bfloat16)",
        "fp8": "aux/final: uint8 bit patterns of float8_e4m3fn; state = value x <name>_scale "
        "(float32 per token and tap, amax/448)",
    }[states]


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] -> (e4m3 bits uint8 [..., H], scale float32 [...]); an all-zero row gets scale 0."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / E4M3_MAX
    q = (xf / scale.clamp_min(torch.finfo(torch.float32).tiny)).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale.squeeze(-1)


def encode(aux: torch.Tensor, final: torch.Tensor, states: str) -> dict[str, torch.Tensor]:
    """The stored arrays of one batch or sample, on the tensors' device (the GPU quantizes before
    the copy to the host: half the bytes cross PCIe)."""
    if check(states) == "bf16":
        return {"aux": aux.to(torch.bfloat16).view(torch.int16), "final": final.to(torch.bfloat16).view(torch.int16)}
    a, a_s = _quantize(aux)
    f, f_s = _quantize(final)
    return {"aux": a, "aux_scale": a_s, "final": f, "final_scale": f_s}


def as_numpy(stored: dict[str, torch.Tensor], states: str) -> dict[str, np.ndarray]:
    """CPU tensors from `encode` as the store's numpy dtypes (bit views, no conversion)."""
    spec = arrays(states, 0, 0)
    return {k: t.contiguous().numpy().view(spec[k][1]) for k, t in stored.items()}


def decode_tensor(stored: dict[str, torch.Tensor], name: str, states: str) -> torch.Tensor:
    """`aux` or `final` as a bfloat16 tensor, on the tensors' device (the trainer decodes on its GPU)."""
    if states == "bf16":
        return stored[name].view(torch.bfloat16)
    q = stored[name].view(torch.float8_e4m3fn)
    return (q.float() * stored[name + "_scale"].unsqueeze(-1)).to(torch.bfloat16)


def decode_tensors(stored: dict[str, torch.Tensor], states: str) -> tuple[torch.Tensor, torch.Tensor]:
    return decode_tensor(stored, "aux", states), decode_tensor(stored, "final", states)


def decode(stored: dict[str, np.ndarray], states: str) -> tuple[np.ndarray, np.ndarray]:
    """(aux, final) as uint16 bfloat16 bit patterns, whatever the format."""
    if states == "bf16":
        return stored["aux"], stored["final"]
    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in stored.items()}
    aux, final = decode_tensors(t, states)
    return aux.view(torch.int16).numpy().view(np.uint16), final.view(torch.int16).numpy().view(np.uint16)
