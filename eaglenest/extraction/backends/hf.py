"""`hf` backend: transformers in-process, CPU or CUDA. Right-padded batches under the causal mask
alone: a real token never attends to padding, so a batch equals its samples run one by one (within
dtype)."""

import logging
import time

import numpy as np
import torch

from eaglenest.errors import EaglenestError
from eaglenest.extraction.backends.hf_compile import compile_layers, compile_length, run_layers, runs_own_loop
from eaglenest.extraction.backends.hf_weights import Unsupported, build_decoder, copy_weights, plan_copy
from eaglenest.store import states as state_format
from eaglenest.target import Target, head_dim, load_model, model_config, pick_device
from eaglenest.versions import CAPTURE_VERSIONS

log = logging.getLogger(__name__)

COMPILE = (True, False, "auto", "layers")


class HFBackend:
    """`compile`: torch.compile over the decoder layers (auto: `layers` on CUDA, off on the CPU).
    Fuses what eager runs as separate memory-bound kernels: RMSNorm's fp32 casts/pow/mean/rsqrt, SiLU
    x up, RoPE's rotate-half and the residual adds (29 % of an 8B forward's GPU time eager; compiled,
    the H200 forward went 0.61 -> 0.75 MFU). Each layer's graph serves every layer and length.
    - true: each layer compiled inside transformers' forward, whose hidden-state capture hooks read a
      ContextVar that dynamo cannot trace: three graphs a layer (input norm | attention | the rest).
    - layers: the backend runs the decoder stack itself -- embeddings, each layer, the final norm,
      keeping the residual stream that enters each tap layer, as `output_hidden_states` does -- so
      each layer is one compiled call (a third less host time a batch than `true` on the CPU; the
      H200 spent ~85 ms of host time a batch in `true`, bench/RESULTS.md). Plain Llama-family
      decoders (`hf_compile.OWN_LOOP`) with SDPA's causal kernel; others run as `true`.
    The loop compiled whole (one graph a batch) was measured and dropped: on the H200 its cold
    compile took 67 s and its batches kept recompiling (forward loop at MFU 0.13; RESULTS.md).
    Dynamo specialises a size of 1, so compiled batches are never one row or one token long: a
    part's occasional one-sample batch (a piece's remainder) gets a padding row, dropped after, and
    runs the graphs every batch runs. One family of graphs, compiled once before the first batch;
    no second family for batch 1 (on the H200 that one took 14 s of a cold part's fixed cost).
    A graph compiled with its length equal to the head or hidden size would be specialised to that
    length (dynamo gives equal sizes one symbol): `warm_len` avoids those. The compile stays after
    the model load, in this process: beside the load it was measured slower in a sibling process
    (bench/RESULTS.md) and is unsafe in a thread (dynamo and transformers' loading both set torch's
    process-wide default dtype; fx's tracing patches `nn.Module.__call__` for every thread) for at
    most the 1.3 s of the weights' copy (H200, 8B) to hide.

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
        if compile not in COMPILE:
            raise EaglenestError(f"extract.hf.compile must be auto, true, false or layers, got {compile!r}")
        if compile == "auto":
            compile = "layers" if self.device.startswith("cuda") else False
        self.mode = compile
        self.compile = compile is not False
        self.target, self.taps, self.dtype, self.attn = target, list(taps), dtype, attn
        self.decoder = None  # loaded on first use: a fully resumed part never loads the model
        self.forward = None  # ids -> (aux, final): transformers' forward, or the own loop compiled
        self.pad_id = 0
        self.copy_stream = None
        self.states = state_format.check(states)
        self.warm = not self.compile  # eager needs no warming
        self.timings = {}  # load_s, warm_up_s: the fixed cost a part's metrics itemise

    @property
    def loaded(self) -> bool:
        return self.decoder is not None

    def load(self) -> None:
        """Load the target; `extract` does it on first use: the decoder built on the device and its
        weights copied in from the safetensors (`hf_weights`; through transformers' loader where the
        files do not suit it). The layers compile at `warm_up`."""
        t = time.perf_counter()
        try:
            decoder = build_decoder(self.target.model_dir, self.dtype, self.device, self.attn)
            copies = plan_copy(self.target.model_dir, decoder)
        except Unsupported as e:
            log.info("hf backend: loading through transformers (%s)", e)
            decoder, copies = load_model(self.target, self.dtype, self.device, self.attn).get_decoder(), None
        if copies is not None:
            built = time.perf_counter()
            n = copy_weights(copies, self.device)
            # load_s's two parts: building the decoder (transformers' modeling imports, most of it on
            # the H200) and the weights' copy
            self.timings["load_build_s"] = round(built - t, 2)
            self.timings["load_copy_s"] = round(time.perf_counter() - built, 2)
            log.info("hf backend: %.1f GB of weights copied from the safetensors in %.1f s", n / 1e9,
                     self.timings["load_copy_s"])  # fmt: skip
        # The decoder stack without lm_head: no full-vocab logits are ever computed.
        self.decoder = decoder.requires_grad_(False)  # no autograd state: one set of guards
        self.forward = self._hf_forward
        # the own loop's tap layout: which layers' inputs it keeps, and the taps' order from the layer
        # order it keeps them in (None: already in that order)
        self._keep = tuple(j in self.taps for j in range(len(self.decoder.layers)))
        order = [sorted(self.taps).index(j) for j in self.taps]
        self._order = None if order == sorted(order) else order
        own = runs_own_loop(self.decoder, self.mode, self.attn)
        if own:
            self.forward = self._own_forward
        if self.compile:
            layers = compile_layers(self.decoder)
            log.info(
                "hf backend: %d decoder layers to compile at the warm-up before the first batch, run by %s",
                len(layers),
                "the backend's own loop" if own else "transformers' forward",
            )
        self.timings["load_s"] = round(time.perf_counter() - t, 2)
        log.info(
            "hf backend: %s on %s, taps %s, states stored as %s; loaded in %.1f s",
            self.dtype,
            self.device,
            self.taps,
            self.states,
            self.timings["load_s"],
        )

    def warm_len(self, T: int) -> int:
        """T, or the next length a graph may be compiled at (`hf_compile.compile_length`)."""
        return compile_length(T, self.target.hidden_size, head_dim(model_config(self.target)))

    def _hf_forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [B, T, A, H], final [B, T, H]) in the model's dtype, through transformers' own forward."""
        out = self.decoder(input_ids=ids, output_hidden_states=True, use_cache=False)
        # hidden_states[j] enters layer j; last_hidden_state is after the final norm (lm_head input).
        return torch.stack([out.hidden_states[j] for j in self.taps], dim=2), out.last_hidden_state

    def _own_forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same states from the backend's own loop over the layers (`compile: layers`): the tap
        layers' inputs and the final norm's output. No attention mask, as in `_hf_forward`: SDPA's
        causal kernel; right padding keeps positions 0.."""
        kept, final = run_layers(self.decoder, ids, self._keep)
        aux = torch.stack(kept, dim=2)
        return (aux if self._order is None else aux[:, :, self._order]), final

    def describe(self) -> dict:
        import transformers

        return {
            "backend": "hf",
            "version": f"transformers-{transformers.__version__}",
            "capture_version": CAPTURE_VERSIONS["hf"],
            "device": self.device,
        }

    def close(self) -> None:
        self.decoder = None

    def _to_host(self, *tensors):
        """Copies to pinned host memory on a side stream (a DMA copy instead of a staged pageable
        one), so the next batch's forward runs while this one's states cross PCIe; returns the host
        tensors and the event that marks them complete."""
        if self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream()
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy_stream):
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors]
            for t in tensors:  # not reused by the compute stream before the copy has read it
                t.record_stream(self.copy_stream)
            done = torch.cuda.Event()
            done.record()
        return *host, done

    def warm_up(self, ids: torch.Tensor) -> None:
        """Run the compiled graphs once before the first batch, on two of its rows (at `warm_len`), so
        a part's fixed cost shows the compile and its forward loop does not. Costs one two-row forward, once."""
        t = time.perf_counter()
        two = ids[:2]  # compiled batches have >= 2 rows (extract_async)
        T = self.warm_len(two.shape[1])
        self.forward(torch.nn.functional.pad(two, (0, T - two.shape[1]), value=self.pad_id))
        self.warm = True
        self.timings["warm_up_s"] = round(time.perf_counter() - t, 2)
        log.info("hf backend: warm-up forward at batch 2, length %d: %.1f s", T, time.perf_counter() - t)

    def extract(self, batch: list[np.ndarray]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.extract_async(batch)()

    @torch.inference_mode()
    def extract_async(self, batch: list[np.ndarray]):
        """Launch the forward and the copies to pinned host memory; returns a callable that waits
        for them and gives [(aux [n, A, H], final [n, H]) bf16 CPU] per sample (with `states` fp8:
        per sample the stored arrays, `state_format.encode`). On CUDA the caller
        can launch the next batch first, so the GPU never idles while the host copies."""
        if self.decoder is None:
            self.load()
        lengths = [len(x) for x in batch]
        rows, T = len(batch), max(lengths)
        if self.compile:  # never a size of 1, which dynamo would compile apart (class docstring)
            rows, T = max(rows, 2), max(T, 2)
        ids = torch.full((rows, T), self.pad_id, dtype=torch.long)
        for b, x in enumerate(batch):
            ids[b, : len(x)] = torch.from_numpy(np.asarray(x, dtype=np.int64))
        # No attention mask: with RIGHT padding the causal mask alone keeps every real token off the
        # padding (all it can see lies before it), and the padded rows are dropped below. A padding
        # mask would make SDPA leave its flash kernel for a materialised [B, 1, T, T] mask, and
        # transformers reads the mask back to decide that (a host sync per batch).
        if self.device != "cpu":  # from pageable memory the driver may wait for the running batch
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        if not self.warm:
            self.warm_up(ids)
        aux, final = self.forward(ids)
        aux, final = aux.to(torch.bfloat16), final.to(torch.bfloat16)
        names, tensors = ("aux", "final"), [aux, final]
        if self.states != "bf16":  # stored arrays, quantized where they were computed
            stored = state_format.encode(aux, final, self.states)
            names, tensors = tuple(stored), list(stored.values())
        done = None
        if aux.is_cuda:
            *tensors, done = self._to_host(*tensors)

        def wait():
            if done is not None:
                done.synchronize()
            if self.states == "bf16":
                return [(tensors[0][b, :n], tensors[1][b, :n]) for b, n in enumerate(lengths)]
            return [{k: t[b, :n] for k, t in zip(names, tensors)} for b, n in enumerate(lengths)]

        return wait
