"""Where a target's safetensors keep each tensor, read from the headers alone: the streamed reference's
map of the checkpoint (which tensors make each decoder layer, and their float32 bytes)."""

import json
import re
from pathlib import Path

import torch

from eaglenest.runtime.errors import EaglenestError
from eaglenest.target.files import SAFETENSORS_DTYPES

LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # a decoder layer's tensor in the checkpoint
FLOAT32 = 4


class CheckpointIndex:
    """The target's safetensors: which file holds each tensor and its shape, from the headers only."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open

        self.model_dir = model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            for name in sorted(set(weight_map.values())):
                if not (model_dir / name).is_file():
                    n = sum(f == name for f in weight_map.values())
                    raise EaglenestError(f"{model_dir / name}: missing shard ({n} tensors of {index.name} are in it)")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in model_dir.glob("*.safetensors"))
            if not files:
                raise EaglenestError(
                    f"{model_dir}: no *.safetensors; the streamed reference reads safetensors only "
                    "(convert the checkpoint, or set validate.reference: whole)"
                )
        self.files = files
        self.file_of, self.numel, self.stored_bytes = {}, {}, {}
        for name in files:
            with safe_open(model_dir / name, framework="pt") as f:
                for key in f.keys():
                    shape = f.get_slice(key).get_shape()
                    self.file_of[key] = name
                    self.numel[key] = int(torch.Size(shape).numel())
                    self.stored_bytes[key] = self.numel[key] * SAFETENSORS_DTYPES.get(f.get_slice(key).get_dtype(), 4)

    def layer_of(self, key: str) -> int | None:
        m = LAYER_KEY.search(key)
        return int(m.group(1)) if m else None

    def keys(self, layer: int | None) -> list[str]:
        """A decoder layer's tensors, or (None) every tensor outside the decoder layers."""
        return [k for k in self.file_of if self.layer_of(k) == layer]

    def float32_bytes(self, layer: int | None = None) -> int:
        return FLOAT32 * sum(self.numel[k] for k in self.keys(layer))

    def model_float32_bytes(self) -> int:
        return FLOAT32 * sum(self.numel.values())

    def largest_layer_bytes(self) -> int:
        layers = {self.layer_of(k) for k in self.file_of} - {None}
        return max((self.float32_bytes(i) for i in layers), default=0)
