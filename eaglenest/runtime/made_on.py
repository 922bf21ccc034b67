"""What a stage's figures were computed on: the CPU kind torch dispatches to and the library versions
that set the arithmetic. bf16 and float32 kernels differ between CPU kinds (AVX2, AVX-512, with bf16
instructions or AMX tiles), so the same code gives slightly different states, drafters and τ on each:
a metrics file names its kind, and `dvc metrics diff` between kinds shows why figures moved.

It also picks the compute dtype that a `dtype: auto` param means on this machine: a CPU without bf16
units (AVX2, plain AVX-512) emulates bf16 matmuls ~60x slower than float32, so there `auto` is float32."""

import torch
import transformers

NATIVE_BF16 = ("AVX512-BF16", "AVX512-AMX")


def cpu_kind() -> str:
    """torch's CPU capability plus the bf16 units it can use: AVX2, AVX512, AVX512-BF16, AVX512-AMX.
    The capability is the one torch dispatches to (`ATEN_CPU_CAPABILITY` can lower it)."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap == "AVX512":
        if torch.cpu._is_amx_tile_supported():
            return "AVX512-AMX"
        if torch.cpu._is_avx512_bf16_supported():
            return "AVX512-BF16"
    return cap


def compute_dtype(dtype: str, device: str = "cpu") -> str:
    """A dtype param resolved: `auto` is bfloat16 on a GPU or a CPU with native bf16 (AMX or
    AVX512-BF16), float32 elsewhere; any other value is obeyed as given."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if str(device).startswith("cuda") or cpu_kind() in NATIVE_BF16 else "float32"


def made_on(device: str = "cpu", dtype: str | None = None) -> dict:
    """Short keys: they are columns of `dvc metrics show`. `gpu` only where a GPU computed; `dtype`,
    the compute dtype a stage resolved, where it has one."""
    out = {"cpu": cpu_kind(), "torch": torch.__version__, "transformers": transformers.__version__}
    if str(device).startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name(torch.device(device))
    if dtype is not None:
        out["dtype"] = dtype
    return out
