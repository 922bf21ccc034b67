"""What a stage's figures were computed on: the CPU kind torch dispatches to and the library versions
that set the arithmetic. bf16 and float32 kernels differ between CPU kinds (AVX2, AVX-512, with bf16
instructions or AMX tiles), so the same code gives slightly different states, drafters and τ on each:
a metrics file names its kind, and `dvc metrics diff` between kinds shows why figures moved."""

import torch
import transformers


def cpu_kind() -> str:
    """torch's CPU capability plus the bf16 units it can use: AVX2, AVX512, AVX512-BF16, AVX512-AMX."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap == "AVX512":
        if torch.cpu._is_amx_tile_supported():
            return "AVX512-AMX"
        if torch.cpu._is_avx512_bf16_supported():
            return "AVX512-BF16"
    return cap


def made_on(device: str = "cpu") -> dict:
    """Short keys: they are columns of `dvc metrics show`. `gpu` only where a GPU computed."""
    out = {"cpu": cpu_kind(), "torch": torch.__version__, "transformers": transformers.__version__}
    if str(device).startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return out
