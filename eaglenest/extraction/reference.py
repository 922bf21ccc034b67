"""The gate's reference (docs/design.md: Gate): the target in float32, eager attention, one sequence
at a time, no padding, whole or streamed one decoder layer at a time (`layer_stream`); for a mixture
of experts, replaying the experts a bf16 forward chose (`routing`)."""

import threading
from contextlib import contextmanager, nullcontext

import numpy as np
import torch

from eaglenest.extraction.checkpoint_index import CheckpointIndex
from eaglenest.extraction.layer_stream import LayerStream, causal_lm_config
from eaglenest.extraction.routing import Routing, bf16_like_extraction, routers, sample_key
from eaglenest.files.sizes import size
from eaglenest.runtime import host_memory
from eaglenest.runtime.errors import EaglenestError
from eaglenest.target.directory import Target
from eaglenest.target.loading import load_model

HEADROOM = 0.8  # of the budget for the whole model's weights: the rest for the samples' activations


def free_bytes(device: str) -> int:
    """Memory the reference may take now: the GPU's free memory, or the host's MemAvailable."""
    if device.startswith("cuda"):
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    if not host_memory.available():
        raise EaglenestError("validate.reference_memory_gb auto: /proc/meminfo has no MemAvailable; give a number")
    return host_memory.available()


def choose_streamed(target: Target, device: str, cfg: dict, beside: bool = False) -> tuple[bool, str]:
    """Whether the gate's reference streams its weights a layer at a time, and why (logged).
    `validate.reference`: whole, streamed, or auto (streamed when the whole float32 model does not fit
    HEADROOM of `validate.reference_memory_gb`, auto: the device's free memory when the part starts,
    less, with `beside` on a GPU, what this process does not yet hold of the extraction's bf16 copy of
    the weights)."""
    mode, budget = cfg.get("reference", "auto"), cfg.get("reference_memory_gb", "auto")
    causal_lm_config(target.model_dir)  # an architecture transformers cannot build fails here, not after the work
    if mode == "whole":
        return False, "validate.reference: whole"
    try:
        index = CheckpointIndex(target.model_dir)
    except EaglenestError as e:
        if mode == "streamed" or "missing shard" in str(e):
            raise
        return False, f"whole model ({e})"
    whole, layer, rest = index.model_float32_bytes(), index.largest_layer_bytes(), index.float32_bytes(None)
    free = free_bytes(device) if budget == "auto" else int(float(budget) * 1e9)
    less = budget == "auto" and beside and device.startswith("cuda")
    if less:  # the part of the bf16 copy this process does not hold yet (a backend loaded before counts once)
        free = max(0, free - max(0, whole // 2 - torch.cuda.memory_allocated(torch.device(device))))
    said = f"float32 model {size(whole)}, budget {size(free)} ({budget}{', less the extraction' * less})"
    if mode == "auto" and whole <= HEADROOM * free:
        return False, f"whole model: {said}"
    if layer + rest > free:
        raise EaglenestError(
            f"validate.reference_memory_gb {budget}: {size(free)} hold less than one decoder layer's "
            f"float32 weights ({size(layer)}) and the weights outside the layers ({size(rest)})"
        )
    return True, f"streamed, one layer at a time (largest {size(layer)}): {said}"


class Reference:
    """The float32 reference model; a context manager that frees it on exit (an 8B target's copy is
    32 GB: a process that extracts several parts must not keep one per gate). `precompute` takes the
    gate's samples' states ahead of the comparison, after which `keep_head_only` frees all of the model
    but its lm_head (`reference_process`: the states are taken while the extraction compiles).
    `streamed`: the weights are read one decoder layer at a time (`layer_stream`), all samples
    running through each layer before the next is read; otherwise the whole model is loaded. Both run
    the same transformers modules and take the states by the same hooks: the same figures."""

    def __init__(
        self, target: Target, taps: list[int], device: str = "cpu", streamed: bool = False, replay: bool = False
    ):
        self.routing = Routing() if replay else None  # a mixture of experts: routing replayed (module docstring)
        self.stream = LayerStream(target.model_dir, device) if streamed else None
        self.model = self.stream.model if streamed else load_model(target, dtype="float32", device=device, attn="eager")
        self.decoder = self.model.get_decoder()
        self.head = self.model.get_output_embeddings()
        self.taps, self.device, self.L = list(taps), device, target.num_layers
        self._done = {}  # the samples' token bytes -> their states, on the host (`precompute`)
        self._local = threading.local()  # this thread's sample's captured states (the hooks write them)
        self._hooks = self._capture()

    def _capture(self) -> list:
        """Hooks that keep hidden_states[j] (the residual stream entering layer j; j = L is the final
        norm's output, as transformers reports it) for the taps and the layers after them, and the
        final norm's input (the pre-norm state)."""
        layers, keep, hooks = self.decoder.layers, {j for t in self.taps for j in (t, t + 1)}, []

        def put(name, x):
            self._local.states[name] = (x[0] if isinstance(x, tuple) else x)[0].float()

        if 0 in keep:
            hooks.append(layers[0].register_forward_pre_hook(
                lambda _m, args, kw: put(0, args[0] if args else kw["hidden_states"]), with_kwargs=True))  # fmt: skip
        for j in sorted(keep - {0, self.L}):
            hooks.append(layers[j - 1].register_forward_hook(lambda _m, _a, out, j=j: put(j, out)))
        norm = getattr(self.decoder, "norm", None)
        if norm is not None:
            hooks.append(norm.register_forward_pre_hook(lambda _m, args: put("prenorm", args)))
        return hooks

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.keep_head_only()
        self.head = self._done = None

    def keep_head_only(self) -> None:
        for h in self._hooks:  # a hook holds self: a cycle only the cyclic GC would free
            h.remove()
        self._hooks = []
        self.model = self.decoder = self.stream = None

    def memory(self) -> dict:
        """What the reference held, in bytes: the whole model in float32, or the streamed peak; and,
        replaying a mixture of experts' routing, how often its own float32 choice differed."""
        routing = {"routing": self.routing.figures()} if self.routing is not None else {}
        if self.stream is None:
            return {"mode": "whole", "model_bytes_fp32": sum(p.numel() * 4 for p in self.model.parameters()), **routing}
        index = self.stream.index
        return {"mode": "streamed", "model_bytes_fp32": index.model_float32_bytes(),
                "layer_bytes": index.largest_layer_bytes(), "peak_bytes": self.stream.peak_bytes,
                "peak_layers": self.stream.peak_layers, "read_bytes": self.stream.read_bytes,
                "read_s": round(self.stream.read_s, 2), **routing}  # fmt: skip

    def take_routing(self, chosen: dict) -> None:
        """The experts the extraction's own forward chose for the gate's samples (`routing.Capture`):
        replayed as they are; a sample without them has its experts from the reference's bf16 pass. So
        does a sample whose captured experts do not fit this target's routers (another model's
        forward): its states are then judged against the target's own choice, and fail."""
        shape = [getattr(r, "top_k", None) for r in routers(self.model)]
        for key, calls in chosen.items():
            tokens = len(key) // 8  # int64 ids
            if [c.shape[-1] for c in calls] == shape and all(c.shape[0] == tokens for c in calls):
                self.routing.chosen[key] = [torch.as_tensor(c) for c in calls]
            else:
                self.routing.sources["unfit"] += 1

    def precompute(self, samples: list[np.ndarray]) -> None:
        todo = [np.asarray(ids, dtype=np.int64) for ids in samples]
        todo = [ids for ids in todo if ids.tobytes() not in self._done]
        run = (lambda f, xs, around=nullcontext: self.stream.run(f, xs, around)) if self.stream else self._each
        if self.routing is not None:  # the bf16 forward's experts first, then the float32 one replays them
            own = [ids for ids in todo if sample_key(ids) not in self.routing.chosen]
            self.routing.sources["extraction"] += len(todo) - len(own)
            self.routing.sources["reference_bf16"] += len(own)
            if own:
                run(self._record, own, lambda: self._recording())
            with self.routing.replaying(self.model):
                done = run(self._forward, todo)
        else:
            done = run(self._forward, todo)
        for ids, states in zip(todo, done):
            self._done[ids.tobytes()] = {k: v.cpu() for k, v in states.items()}

    @staticmethod
    def _each(forward, inputs: list, around=nullcontext) -> list:
        with around():
            return [forward(x) for x in inputs]

    @contextmanager
    def _recording(self):
        with self.routing.recording(self.model), bf16_like_extraction(self.model):
            yield

    @torch.inference_mode()
    def _record(self, ids) -> None:
        self._local.states = {}  # the capture hooks fire here too: nothing of this pass is kept
        with self.routing.as_sample(ids):
            self.decoder(
                input_ids=torch.from_numpy(np.asarray(ids, dtype=np.int64))[None].to(self.device), use_cache=False
            )

    @torch.inference_mode()
    def states(self, ids: np.ndarray) -> dict:
        """The reference's states for one sample, float32, on its device (compared there)."""
        done = self._done.get(np.asarray(ids, dtype=np.int64).tobytes())
        if done is not None:
            return {k: v.to(self.device) for k, v in done.items()}
        if self.decoder is None:
            raise EaglenestError(f"validation gate: no reference states for a sample of {len(ids)} tokens whose "
                                 "ids differ from every sample of the tokenized part it was chosen from")  # fmt: skip
        if self.stream is not None or self.routing is not None:  # streamed: read every layer once for all
            self.precompute([ids])
            return self.states(ids)
        return self._forward(ids)

    @torch.inference_mode()
    def _forward(self, ids) -> dict:
        self._local.states = got = {}
        x = torch.from_numpy(np.asarray(ids, dtype=np.int64))[None].to(self.device)
        with self.routing.as_sample(ids) if self.routing is not None else nullcontext():
            got[self.L] = self.decoder(input_ids=x, use_cache=False).last_hidden_state[0].float()
        ref = {
            "aux": torch.stack([got[j] for j in self.taps], 1),
            "aux_adjacent": torch.stack([got[j + 1] for j in self.taps], 1),
            "final": got[self.L],
        }
        if "prenorm" in got:
            ref["final_adjacent"] = got["prenorm"]
        return ref

    @torch.inference_mode()
    def lm_head_cosine(self, final: torch.Tensor, ref_final: torch.Tensor) -> torch.Tensor:
        """Per-token cosine between lm_head(stored final) and lm_head(reference final): the logits the
        model computes from its last hidden state, without a second forward (informational)."""
        mine = self.head(final.to(self.device)).float()
        theirs = self.head(ref_final.to(self.device)).float()
        return torch.nn.functional.cosine_similarity(mine, theirs, dim=-1)
