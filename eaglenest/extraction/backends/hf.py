"""`hf` backend: transformers in-process, CPU or CUDA. Right-padded batches under the causal mask
alone: a real token never attends to padding, so a batch equals its samples run one by one (within
dtype)."""

import logging
import os
import threading
import time
from importlib.metadata import version

import numpy as np
import torch

from eaglenest.extraction.backends import llama
from eaglenest.extraction.backends.hf_compile import LayerCompile, compile_layers, compile_length
from eaglenest.extraction.backends.hf_weights import Unsupported, build_decoder, copy_cast, copy_weights, plan_copy
from eaglenest.extraction.backends.host_copy import PinnedCopy
from eaglenest.extraction.routing import Capture, is_moe
from eaglenest.runtime.errors import EaglenestError
from eaglenest.runtime.versions import CAPTURE_VERSIONS
from eaglenest.store import states as state_format
from eaglenest.target.directory import Target, head_dim, model_config
from eaglenest.target.loading import load_model, pick_device, use_device

log = logging.getLogger(__name__)

COMPILE = (True, False, "auto", "layers", "kernels")


class HFBackend:
    """`compile`: fuse what eager runs as separate memory-bound kernels (auto: `kernels` on CUDA, off on
    the CPU); each mode is described in `hf_compile`.

    `states`: the store's format (`store.states`); fp8 is quantized on the device, before the
    copy out, so half the bytes cross PCIe."""

    def __init__(
        self,
        target: Target,
        taps: list[int],
        dtype: str = "bfloat16",
        device: str = "auto",
        attn: str = "sdpa",
        compile: bool | str = "auto",
        states: str = "bf16",
    ):
        self.device = pick_device(device)
        use_device(self.device)  # of the thread that runs the batches
        if compile not in COMPILE:
            raise EaglenestError(f"extract.hf.compile must be auto, kernels, layers, true or false, got {compile!r}")
        requested = compile
        if compile == "auto":
            compile = "kernels" if self.device.startswith("cuda") else False
        if compile == "kernels" and not (self.device.startswith("cuda") or os.environ.get("TRITON_INTERPRET") == "1"):
            raise EaglenestError(f"extract.hf.compile: kernels runs Triton kernels: CUDA only, not {self.device}")
        self.own = None  # llama.Spec where the backend runs the decoder itself
        if compile in ("layers", "kernels"):
            try:
                if attn != "sdpa":
                    raise Unsupported(f"attention {attn!r}")
                self.own = llama.plan(target.model_dir)
            except Unsupported as e:
                # a mixture of experts: transformers' forward uncompiled (its compiled layers ran at half the
                # tok/s at real width: bench/RESULTS.md), its routing then captured for the gate
                moe = requested == "auto" and is_moe(model_config(target))
                log.info("hf backend: %s: not run by the own layers (%s); %s", target.model_dir, e,
                         "transformers' forward" if moe else "each of transformers' layers compiled")  # fmt: skip
                compile = False if moe else True
        self.mode = compile
        self.compile = compile is not False
        self.target, self.taps, self.dtype, self.attn = target, list(taps), dtype, attn
        self.decoder = None  # loaded on first use: a fully resumed part never loads the model
        self.forward = None  # ids -> (aux, final): transformers' forward, or the own decoder's
        self.pad_id = 0
        self.copy = PinnedCopy()
        self.compiling = None  # hf_compile.LayerCompile until the first batch
        self.loading, self.load_error = None, None  # `start_load`'s thread, what it raised
        self.states = state_format.check(states)
        self.watched, self.watch_then, self.capture = None, None, None  # the gate's samples (`watch_routing`)
        self.warm = not self.compile  # eager needs no warming
        self.timings = {}  # load_s, warm_up_s: the fixed cost a part's metrics itemise

    @property
    def loaded(self) -> bool:
        return self.decoder is not None and self.loading is None

    def start_load(self) -> None:
        """`load` in a thread, while the caller gets the part ready; `load` (or the first batch) waits
        for it and raises what it raised."""
        if self.decoder is None and self.loading is None:
            self.loading = threading.Thread(target=self._load_in_thread, name="load-target", daemon=True)
            self.loading.start()

    def _load_in_thread(self) -> None:
        try:
            use_device(self.device)  # as the caller's
            self._load()
        except BaseException as e:  # raised by `load`, in the caller's thread
            self.load_error = e

    def load(self) -> None:
        """Load the target; `extract` does it on first use. `load_s`: what the caller waited."""
        t = time.perf_counter()
        if self.loading is not None:
            self.loading.join()
            self.loading = None
            if self.load_error is not None:
                raise self.load_error
        elif self.decoder is None:
            self._load()
        self.timings["load_s"] = round(time.perf_counter() - t, 2)

    def _load(self) -> None:
        """The decoder built on the device and its weights copied in from the safetensors
        (`hf_weights`; through transformers' loader where the files do not suit it). The own layer
        compiles in a thread meanwhile; transformers' at `warm_up`. `load_run_s`: how long it took."""
        t = time.perf_counter()
        with torch.inference_mode(False):  # plain tensors even when the first batch loads: the weights'
            if self.own is not None:  # copy writes them from threads outside inference mode
                self._load_own()
            else:
                self._load_transformers()
        # the taps in the order the loop keeps them (layer order), and their order as asked (None: the same)
        self._keep = tuple(j in self.taps for j in range(self.target.num_layers))
        order = [sorted(self.taps).index(j) for j in self.taps]
        self._order = None if order == sorted(order) else order
        self.timings["load_run_s"] = round(time.perf_counter() - t, 2)
        log.info("hf backend: %s on %s, taps %s, states stored as %s, %s; loaded in %.1f s", self.dtype, self.device,
                 self.taps, self.states, "the own layers" if self.own else "transformers' forward",
                 self.timings["load_run_s"])  # fmt: skip

    def _load_own(self) -> None:
        t = time.perf_counter()
        weights = llama.allocate(self.own, getattr(torch, self.dtype), self.device)
        ops = llama.EAGER
        if self.mode == "kernels":
            from eaglenest.extraction.backends import llama_kernels  # imports triton: CUDA's, or its interpreter

            ops = llama_kernels.OPS
        self.decoder = llama.Decoder(self.own, weights, ops)
        built = time.perf_counter()
        if self.compile:  # beside the copy; the first batch waits for it (`warm_up`)
            self.compiling = LayerCompile(self.decoder, self.device, dynamo=self.mode == "layers")
        try:
            n = copy_weights(plan_copy(self.target.model_dir, weights), self.device)
        except Unsupported as e:  # e.g. float32 files for a bfloat16 extraction
            log.info("hf backend: weights read and cast through safetensors (%s)", e)
            n = copy_cast(self.target.model_dir, weights)
        self.forward = self._own_forward
        self._weights_copied(built - t, n, time.perf_counter() - built)

    def _weights_copied(self, build_s: float, n: int, copy_s: float) -> None:
        # load_s's two parts: building the decoder and the weights' copy
        self.timings.update(load_build_s=round(build_s, 2), load_copy_s=round(copy_s, 2))
        log.info("hf backend: %.1f GB of weights copied from the safetensors in %.1f s", n / 1e9, copy_s)

    def _load_transformers(self) -> None:
        t = time.perf_counter()
        try:
            decoder = build_decoder(self.target.model_dir, self.dtype, self.device, self.attn)
            copies = plan_copy(self.target.model_dir, decoder.state_dict(keep_vars=True))
        except Unsupported as e:
            log.info("hf backend: loading through transformers (%s)", e)
            decoder, copies = load_model(self.target, self.dtype, self.device, self.attn).get_decoder(), None
        if copies is not None:
            built = time.perf_counter()
            self._weights_copied(built - t, copy_weights(copies, self.device), time.perf_counter() - built)
        # The decoder stack without lm_head: no full-vocab logits are ever computed.
        self.decoder = decoder.requires_grad_(False)  # no autograd state: one set of guards
        self.forward = self._hf_forward
        if self.compile:
            layers = compile_layers(self.decoder)
            log.info("hf backend: %d decoder layers to compile at the warm-up before the first batch", len(layers))

    def warm_len(self, T: int) -> int:
        """T, or the next length a graph may be compiled at (`hf_compile.compile_length`)."""
        return compile_length(T, {self.target.hidden_size, head_dim(model_config(self.target))})

    def _hf_forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [B, T, A, H], final [B, T, H]) in the model's dtype, through transformers' own forward."""
        out = self.decoder(input_ids=ids, output_hidden_states=True, use_cache=False)
        # hidden_states[j] enters layer j; last_hidden_state is after the final norm (lm_head input).
        return torch.stack([out.hidden_states[j] for j in self.taps], dim=2), out.last_hidden_state

    def _own_forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same states from the own decoder (`compile: kernels` or `layers`): the tap layers'
        inputs and the final norm's output."""
        kept, final = self.decoder.run(ids, self._keep)
        aux = torch.stack(kept, dim=2)
        return (aux if self._order is None else aux[:, :, self._order]), final

    def watch_routing(self, samples: list, then=None) -> bool:
        """Keep the experts transformers' uncompiled forward chooses for these samples (a mixture of
        experts), for the gate's reference to replay (`routing`); `then(chosen)` once all are kept.
        False where nothing is kept."""
        if self.own is not None or self.compile or not is_moe(model_config(self.target)):
            return False
        self.watched, self.watch_then = samples, then
        return True

    routing = property(lambda self: self.capture.routing if self.capture is not None else None)

    def describe(self) -> dict:
        return {
            "backend": "hf",
            "version": self._code_version(),
            "capture_version": CAPTURE_VERSIONS["hf"],
            "device": self.device,
        }

    def _code_version(self) -> str:
        """The code that computes the states: the own layers (their kernels, torch), or transformers'."""
        if self.mode == "kernels":
            from eaglenest.extraction.backends.llama_kernels import VERSION

            return f"{VERSION}-triton-{version('triton')}-torch-{torch.__version__}"
        if self.own:
            return f"{llama.VERSION}-torch-{torch.__version__}"
        return f"transformers-{version('transformers')}"

    def close(self) -> None:
        if self.capture is not None:
            self.capture.close()
        if self.loading is not None:  # a run that failed while the target loaded
            self.loading.join()
            self.loading = None
        if self.compiling is not None:  # a run that failed before its first batch
            self.compiling.thread.join()
            self.compiling = None
        self.decoder = None

    def warm_up(self, ids: torch.Tensor) -> None:
        """Before the first batch, so that a part's fixed cost shows the compile and its forward loop
        does not: the own layer's compile awaited (`warm_up_s`: what the load did not hide of its
        `compile_s`), or transformers' compiled layers run once on two of the batch's rows (at
        `warm_len`: one two-row forward, once)."""
        t = time.perf_counter()
        if self.compiling is not None:
            self.compiling.wait()
            self.timings["compile_s"] = round(self.compiling.seconds, 2)
            self.compiling = None
        else:
            two = ids[:2]  # compiled batches have >= 2 rows (extract_async)
            T = self.warm_len(two.shape[1])
            self.forward(torch.nn.functional.pad(two, (0, T - two.shape[1]), value=self.pad_id))
            log.info("hf backend: warm-up forward at batch 2, length %d: %.1f s", T, time.perf_counter() - t)
        self.warm = True
        self.timings["warm_up_s"] = round(time.perf_counter() - t, 2)

    def extract(self, batch: list[np.ndarray]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.extract_async(batch)()

    @torch.inference_mode()
    def extract_async(self, batch: list[np.ndarray]):
        """Launch the forward and the copies to pinned host memory; returns a callable that waits
        for them and gives [(aux [n, A, H], final [n, H]) bf16 CPU] per sample (with `states` fp8:
        per sample the stored arrays, `state_format.encode`). On CUDA the caller
        can launch the next batch first, so the GPU never idles while the host copies."""
        if not self.loaded:
            self.load()
        lengths = [len(x) for x in batch]
        rows, T = len(batch), max(lengths)
        if self.mode in (True, "layers"):  # never a size of 1, which dynamo would compile apart (docstring)
            rows, T = max(rows, 2), max(T, 2)
        ids = torch.full((rows, T), self.pad_id, dtype=torch.long)
        for b, x in enumerate(batch):
            ids[b, : len(x)] = torch.from_numpy(np.asarray(x, dtype=np.int64))
        # No attention mask: right-padded, the causal mask alone keeps every real token off the padding.
        # A padding mask would make SDPA leave its flash kernel (and transformers reads it back: a sync).
        if self.device != "cpu":  # from pageable memory the driver may wait for the running batch
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        if not self.warm:
            self.warm_up(ids)
        if self.watched is not None and self.capture is None:
            self.capture = Capture(self.decoder, self.watched, self.watch_then)
        if self.capture is not None:
            self.capture.before(batch)
        aux, final = self.forward(ids)
        if self.capture is not None:
            self.capture.after(ids.shape[1])
        aux, final = aux.to(torch.bfloat16), final.to(torch.bfloat16)
        names, tensors = ("aux", "final"), [aux, final]
        if self.states != "bf16":  # stored arrays, quantized where they were computed
            stored = state_format.encode(aux, final, self.states)
            names, tensors = tuple(stored), list(stored.values())
        done = None
        if aux.is_cuda:
            *tensors, done = self.copy(*tensors)

        def wait():
            if done is not None:
                done.synchronize()
            if self.states == "bf16":
                return [(tensors[0][b, :n], tensors[1][b, :n]) for b, n in enumerate(lengths)]
            return [{k: t[b, :n] for k, t in zip(names, tensors)} for b, n in enumerate(lengths)]

        return wait
