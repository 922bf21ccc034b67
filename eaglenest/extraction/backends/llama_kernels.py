"""The own Llama-family layer on CUDA with its memory-bound steps as Triton kernels of our own
(`compile: kernels`, the default there): RMSNorm (with the residual add before it), the rotary
embedding, SiLU x up and the layer's residual sum, each one pass over its rows. torch.compile fused
the same steps, but its cold compile took 7.65 s alone on the H200 (dynamo, AOT autograd and inductor
before a single Triton kernel was built), most of which a part waited for before its first batch;
these build in 1.5-4.7 s, mostly hidden by the weights' copy (bench/RESULTS.md, "ninth run"). The
matmuls (cuBLAS) and attention (SDPA) are torch's: `llama.make_layer(spec, OPS)` runs them.

Each kernel computes in float32 and rounds once, at its output, as inductor's fused kernels did
(eager rounds after every op, transformers' RMSNorm casts before its weight), and the residual
stream is rounded once a layer: bfloat16 states sit closer to the float32 reference than eager's
(tests/gpu_checks.py measures both; on the random 8B target the gate's final rel_err_mean was
0.064 with eager's roundings and 0.060 rounding each add, against its 0.06 limit; 0.058 now, as the
compiled layers), and float32 states equal eager's up to summation order. No integer argument that
varies between batches reaches a kernel unmarked: Triton would build a variant per divisibility of
it, and the bytes of a state would depend on which variant ran. Runs on the CPU only in Triton's
interpreter (the tests)."""

import torch
import triton
import triton.language as tl

from eaglenest.extraction.backends.llama import Ops

VERSION = "eaglenest-llama-kernels-1"  # in the extractor fingerprint: states computed by this code


@triton.jit
def _rms_norm(x_ptr, d_ptr, w_ptr, y_ptr, eps, N: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr):
    """One row: y = w * (x * rsqrt(mean(x^2) + eps)) in float32, rounded once; ADD: of x + d."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        x += tl.load(d_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) * (1.0 / N) + eps)  # torch's mean: the sum times 1/N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * N + cols, (w * (x * r)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add3(a_ptr, b_ptr, c_ptr, y_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    """A block of one row: y = a + b + c, rounded once."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    at = row * N + cols
    x = tl.load(a_ptr + at, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(b_ptr + at, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(c_ptr + at, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + at, x.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["T"])
def _rotary(x_ptr, cos_ptr, sin_ptr, y_ptr, T, HEADS: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
            HALF: tl.constexpr):  # fmt: skip
    """One token's heads: y = x * cos + rotate_half(x) * sin at its position (row % T: right padding
    starts every row at 0)."""
    row = tl.program_id(0).to(tl.int64)
    t = row % T
    h = tl.arange(0, HP)[:, None]
    j = tl.arange(0, HALF)[None, :]
    mask = (h < HEADS) & (j < D // 2)
    lo = row * HEADS * D + h * D + j
    x1 = tl.load(x_ptr + lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + lo + D // 2, mask=mask, other=0.0).to(tl.float32)
    jm = j < D // 2
    c1 = tl.load(cos_ptr + t * D + j, mask=jm, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * D + D // 2 + j, mask=jm, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * D + j, mask=jm, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * D + D // 2 + j, mask=jm, other=0.0).to(tl.float32)
    dt = y_ptr.dtype.element_ty
    tl.store(y_ptr + lo, (x1 * c1 - x2 * s1).to(dt), mask=mask)
    tl.store(y_ptr + lo + D // 2, (x2 * c2 + x1 * s2).to(dt), mask=mask)


@triton.jit
def _silu_mul(g_ptr, u_ptr, y_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    """A block of one row: y = silu(g) * u."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(g_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * N + cols, (g / (1.0 + tl.exp(-g)) * u).to(y_ptr.dtype.element_ty), mask=mask)


def _p2(n: int) -> int:
    return triton.next_power_of_2(n)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, add: torch.Tensor | None = None) -> torch.Tensor:
    """`llama.rms_norm` over the last dimension of a contiguous x (of x + add: their sum unrounded)."""
    n = x.shape[-1]
    y = torch.empty_like(x)
    _rms_norm[(x.numel() // n,)](x, x if add is None else add, w, y, eps, N=n, BLOCK=_p2(n), ADD=add is not None,
                                 num_warps=8 if n >= 2048 else 4)  # fmt: skip
    return y


def add3(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a + b + c (contiguous, one shape), rounded once."""
    n = a.shape[-1]
    y = torch.empty_like(a)
    block = min(1024, _p2(n))
    _add3[(a.numel() // n, triton.cdiv(n, block))](a, b, c, y, N=n, BLOCK=block, num_warps=4)
    return y


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, d] contiguous, cos/sin [T, d]: `llama.rotate` in the same layout."""
    heads, d = x.shape[-2:]
    y = torch.empty_like(x)
    _rotary[(x.numel() // (heads * d),)](x, cos, sin, y, x.shape[1], HEADS=heads, HP=_p2(heads), D=d,
                                         HALF=_p2(d // 2), num_warps=4)  # fmt: skip
    return y


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    n = g.shape[-1]
    y = torch.empty_like(g)
    block = min(1024, _p2(n))
    _silu_mul[(g.numel() // n, triton.cdiv(n, block))](g, u, y, N=n, BLOCK=block, num_warps=4)
    return y


# `llama.make_layer(spec, OPS)`: the own layer with these kernels
OPS = Ops(norm=rms_norm, rotate=rotate, silu_mul=silu_mul, residual=add3)
