"""A target in float32 that holds one decoder layer's weights at a time (docs/design.md: Gate): the
gate's reference for targets whose float32 copy fits no device (a 70B's is 280 GB, a 1T MoE's ~4 TB).

transformers builds the model with every parameter on the meta device (buffers real: rotary tables,
router biases), reads the non-layer weights (embedding, final norm, lm_head), and then runs the
model's own forward for all samples together, one sample per thread: the threads meet before each
decoder layer, where that layer's weights are read from the safetensors (through transformers' own
key renaming and expert fusion, as `from_pretrained` loads them) and the previous layer's are
dropped, and they run the layer one at a time. So the weights are read once per gate, not once per
sample, each sample runs alone and unpadded, and every module is transformers'."""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from eaglenest.extraction.checkpoint_index import CheckpointIndex
from eaglenest.runtime.errors import EaglenestError


@contextmanager
def _parameters_on_meta():
    """Every parameter registered in the block lands on the meta device; buffers stay real. A
    parameter's `torch.empty` is a reservation the host never touches, so none is ever paid for."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def causal_lm_config(model_dir: Path):
    """The directory's config, if transformers can build a causal LM from it; else one line naming
    the architecture."""
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type", "?")
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (ValueError, KeyError) as e:
        raise EaglenestError(f"{model_dir}: transformers cannot build architecture {arch!r}: {e}") from None
    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise EaglenestError(f"{model_dir}: transformers has no causal LM for architecture {arch!r}")
    return config


def build_empty(model_dir: Path):
    """transformers' causal LM for the directory's config, float32, eager attention, no weights."""
    from transformers import AutoModelForCausalLM

    config = causal_lm_config(model_dir)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


class LayerStream:
    """The model whose weights are read as they are needed: the small ones outside the decoder layers
    (final norm) for good, the input embedding until the first layer, each decoder layer while the
    samples run through it, the lm_head after the last. `peak_bytes` is the most parameter bytes
    ever resident at once; `peak_layers` the most decoder layers with a weight resident at once (1
    by construction; tests assert it)."""

    def __init__(self, model_dir: Path, device: str = "cpu", index: CheckpointIndex | None = None):
        from transformers.conversion_mapping import get_model_conversion_mapping

        self.index = index or CheckpointIndex(model_dir)
        self.model = build_empty(model_dir)
        self.device = torch.device(device)
        for module in self.model.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = buf.to(self.device)
        self.mapping = get_model_conversion_mapping(self.model)
        self.layers = self.model.get_decoder().layers
        self.embed, self.head = self.model.get_input_embeddings(), self.model.get_output_embeddings()
        self.tied = self.head is not None and self.head.weight is self.embed.weight
        outside = self.index.keys(None)
        self.parts = {"embed": self._keys_of(self.embed, outside)}
        self.parts["head"] = self.parts["embed"] if self.tied else self._keys_of(self.head, outside)
        self.parts["rest"] = [k for k in outside if k not in self.parts["embed"] + self.parts["head"]]
        self.loaded: int | None = None
        self.peak_bytes = self.peak_layers = 0
        self.read_bytes, self.read_s = 0, 0.0  # the checkpoint's bytes read and the time it took
        self._files = {}
        self._read("rest")
        self._read("embed")

    def _keys_of(self, module, keys: list[str]) -> list[str]:
        """The checkpoint's tensors of a module outside the layers (by its name's last component)."""
        if module is None:
            return []
        name = next(n for n, m in self.model.named_modules() if m is module).rsplit(".", 1)[-1]
        return [k for k in keys if f"{name}." in k and (k.startswith(f"{name}.") or f".{name}." in k)]

    def _module(self, what) -> torch.nn.Module:
        if isinstance(what, int):
            return self.layers[what]
        if what in ("embed", "head"):
            return self.embed if what == "embed" else self.head
        rest = torch.nn.Module()  # every parameter outside the layers, the embedding and the head
        skip = {id(p) for m in (self.layers, self.embed, self.head) if m is not None for p in m.parameters()}
        for i, p in enumerate(self.model.parameters()):
            if id(p) not in skip:
                rest.register_parameter(f"p{i}", p)
        return rest

    def _read(self, what) -> None:
        """Read a decoder layer (an int), or `rest`, `embed` or `head`, into the model."""
        from safetensors import safe_open
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        if self.device.type == "cuda":  # the previous layer's queued work is not this read's time
            torch.cuda.synchronize(self.device)
        t = time.perf_counter()
        keys = self.index.keys(what) if isinstance(what, int) else self.parts[what]
        state = {}
        for k in keys:
            name = self.index.file_of[k]
            if name not in self._files:
                self._files[name] = safe_open(self.index.model_dir / name, framework="pt", device="cpu")
            state[k] = self._files[name].get_slice(k)  # read as the converter asks for it
        config = LoadStateDictConfig(
            pretrained_model_name_or_path=str(self.index.model_dir),
            dtype=torch.float32,
            device_map={"": self.device},
            weight_mapping=self.mapping,
        )
        convert_and_load_state_dict_in_model(self.model, state, config)
        if what in ("embed", "head"):
            self.model.tie_weights()  # a tied lm_head is the embedding: not in the checkpoint
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.read_s += time.perf_counter() - t
        self.read_bytes += sum(self.index.stored_bytes[k] for k in keys)
        module = self._module(what)
        empty = [n for n, p in module.named_parameters() if p.is_meta] if module is not None else []
        if empty:
            name = f"decoder layer {what}" if isinstance(what, int) else {"rest": "the weights outside the layers",
                   "embed": "the input embedding", "head": "the lm_head"}[what]  # fmt: skip
            raise EaglenestError(
                f"{self.index.model_dir}: the checkpoint has no weights for {name}: {', '.join(empty[:4])}"
                + (f" and {len(empty) - 4} more" if len(empty) > 4 else "")
            )
        self._account()

    def _account(self) -> None:
        resident = {id(p): p for p in self.model.parameters() if not p.is_meta}.values()
        self.peak_bytes = max(self.peak_bytes, sum(p.numel() * p.element_size() for p in resident))
        self.peak_layers = max(
            self.peak_layers, sum(any(not p.is_meta for p in layer.parameters()) for layer in self.layers)
        )

    def _resident(self, module) -> bool:
        return module is not None and not any(p.is_meta for p in module.parameters())

    def load(self, layer: int) -> None:
        """Layer `layer` resident, and no other (nor the embedding, used before the first)."""
        if self.loaded == layer:
            return
        self.drop()
        if self._resident(self.embed):
            self.embed.to("meta")  # every sample has its embeddings (a tied head goes with it)
        self._read(layer)
        self.loaded = layer

    def drop(self) -> None:
        if self.loaded is not None:
            self.layers[self.loaded].to("meta")
            self.loaded = None

    def with_embedding(self) -> None:
        """Before a run: the embedding back, the head out (never both beside a layer)."""
        if not self.tied and self._resident(self.head):
            self.head.to("meta")
        if not self._resident(self.embed):
            self._read("embed")

    def with_head(self) -> None:
        """After a run: the lm_head for the comparison of the logits."""
        self.drop()
        if self.head is not None and not self._resident(self.head):
            self._read("head")

    def run(self, forward, inputs: list, around=nullcontext) -> list:
        """forward(x) for every x, each in a thread of its own, layer-major (module docstring):
        forward calls the model once; the results in input order. The first error of any thread
        (a layer that fails to load, an out-of-memory) is raised once all have stopped. `around`:
        a context whose hooks run after the stream's (a layer's pre-hook then sees it resident)."""
        if not inputs:
            return []
        barrier = threading.Barrier(len(inputs), action=lambda: self.load(self._next))
        turn = threading.Lock()

        def enter(module, _args):
            self._next = module.eaglenest_layer
            barrier.wait()  # all threads at this layer; one of them loaded it
            while not turn.acquire(timeout=0.2):  # one layer's activations at a time
                if barrier.broken:
                    raise threading.BrokenBarrierError

        def leave(_module, _args, _out):
            turn.release()

        def one(x):
            try:
                with torch.inference_mode():
                    return forward(x)
            except BaseException:
                barrier.abort()  # the others stop at their next layer
                raise

        self.with_embedding()
        hooks = []
        for i, layer in enumerate(self.layers):
            layer.eaglenest_layer = i
            hooks += [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]
        try:
            with around(), ThreadPoolExecutor(len(inputs), thread_name_prefix="reference") as pool:
                futures = [pool.submit(one, x) for x in inputs]
                errors = [f.exception() for f in futures]
            first = next((e for e in errors if e and not isinstance(e, threading.BrokenBarrierError)), None)
            if first or any(errors):
                raise first or errors[0]
            return [f.result() for f in futures]
        finally:
            for h in hooks:
                h.remove()
            self.with_head()
