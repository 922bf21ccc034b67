"""Extraction backends. Interface: `describe() -> {backend, version, capture_version, device}`,
`extract(list of int32 id arrays) -> list of (aux [n, 3, H], final [n, H])` bf16 CPU tensors, and
`close()`. A sample that fails for good raises `SampleFailed(position_in_batch, reason)`. The hf
backend, built with `states="fp8"`, hands over each sample's stored arrays instead (a dict from
`state_format.encode`, quantized on its device); extract quantizes other backends' bf16 states."""

from eaglenest.runtime.errors import EaglenestError


class SampleFailed(EaglenestError):
    """Sample `position` of the batch failed every attempt; the caller names it."""

    def __init__(self, position: int, reason: str):
        self.position, self.reason = position, reason
        super().__init__(reason)


def make_backend(name: str, **kwargs):
    if name == "hf":
        from .hf import HFBackend

        return HFBackend(**kwargs)
    if name == "sglang":
        from .sglang_client import SGLangBackend

        return SGLangBackend(**kwargs)
    if name == "vllm":
        from .vllm import VLLMBackend

        return VLLMBackend(**kwargs)
    raise EaglenestError(f"extract.backend {name!r} is not supported (supported: hf, sglang, vllm)")
