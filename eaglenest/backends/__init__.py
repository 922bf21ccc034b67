"""Extraction backends. Interface: `describe() -> {backend, version, capture_version}` and
`extract(list of int32 id arrays) -> list of (aux [n, 3, H], final [n, H])` bf16 CPU tensors."""
from ..versions import CAPTURE_VERSIONS  # noqa: F401


def make_backend(name: str, **kwargs):
    from ..errors import EaglenestError
    if name == "hf":
        from .hf import HFBackend
        return HFBackend(**kwargs)
    raise EaglenestError(f"extract.backend {name!r} is not supported (supported: hf)")
