"""STAND-IN for torchvision, put on PYTHONPATH by `sglang_patch.launch` only when no torchvision is
installed. At startup SGLang imports transformers' image-processor registry, which imports names
from torchvision (io, transforms, transforms.v2) when torchvision is importable and refuses to
register processors when it is not; and the PyPI torchvision wheel does not load beside the CPU
torch build ("operator torchvision::nms does not exist"). Text-only targets only need the names
to exist: every name here is a placeholder whose attributes resolve and whose CALL raises.
The version states the API level transformers checks for (v2 transforms), not a real install."""

from ._missing import module_getattr

__version__ = "0.28.0+eaglenest.standin"
STANDIN = True
__getattr__ = module_getattr(__name__)
