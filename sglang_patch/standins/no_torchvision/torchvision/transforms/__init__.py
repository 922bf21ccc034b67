"""Placeholder module of the torchvision stand-in (see torchvision/__init__.py)."""

from torchvision._missing import module_getattr

__getattr__ = module_getattr(__name__)
