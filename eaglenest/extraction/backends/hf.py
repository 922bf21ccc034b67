"""`hf` backend: transformers in-process, CPU or CUDA. Right-padded batches under the causal mask
alone: a real token never attends to padding, so a batch equals its samples run one by one (within
dtype)."""

import functools
import logging
import threading
import time

import numpy as np
import torch

from eaglenest.errors import EaglenestError
from eaglenest.store import states as state_format
from eaglenest.target import Target, load_model, pick_device
from eaglenest.versions import CAPTURE_VERSIONS

log = logging.getLogger(__name__)


# decoders whose forward is exactly: embed, rotary, each layer, norm (no embedding scale, no
# sliding-window masks), so running the layers in the backend's own loop gives the same states
OWN_LOOP = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")
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
      decoders (`OWN_LOOP`) with SDPA's causal kernel; others run as `true`.
    The loop compiled whole (one graph a batch) was measured and dropped: on the H200 its cold
    compile took 67 s and its batches kept recompiling (forward loop at MFU 0.13; RESULTS.md).
    Dynamo specialises a size of 1, so compiled batches are never one row or one token long: a
    part's occasional one-sample batch (a piece's remainder) gets a padding row, dropped after, and
    runs the graphs every batch runs. One family of graphs, compiled once before the first batch;
    no second family for batch 1 (on the H200 that one took 14 s of a cold part's fixed cost).
    The compile overlaps the model load (`_start_prewarm`): a one-layer decoder of the same config, built
    first, is compiled in a thread while the weights load; dynamo keys its graphs by code and
    guards, not by module, so the real layers reuse them (tested: no new graph) and `warm_up` is
    left a plain forward. A graph compiled with its length equal to the head or hidden size would be
    specialised to that length (dynamo gives equal sizes one symbol): `warm_len` avoids those.

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

    def load(self, longest: int | None = None) -> None:
        """Load the target (and compile its layers, beside the load, at length `longest`: the part's
        longest sample); `extract` does it on first use."""
        t = time.perf_counter()
        prewarm = self._start_prewarm(longest or 256) if self.compile else None
        model = load_model(self.target, dtype=self.dtype, device=self.device, attn=self.attn)
        # The decoder stack without lm_head: no full-vocab logits are ever computed.
        self.decoder = model.get_decoder().requires_grad_(False)  # no autograd state: one set of guards
        self.forward = self._hf_forward
        # the own loop's tap layout: which layers' inputs it keeps, and the taps' order from the layer
        # order it keeps them in (None: already in that order)
        self._keep = tuple(j in self.taps for j in range(len(self.decoder.layers)))
        order = [sorted(self.taps).index(j) for j in self.taps]
        self._order = None if order == sorted(order) else order
        own = self._own_loop(self.decoder)
        if own:
            self.forward = self._own_forward
        if self.compile:
            layers = compile_layers(self.decoder)
            if prewarm is not None:
                prewarm.join()
            log.info(
                "hf backend: %d decoder layers compiled, run by %s (%s)",
                len(layers),
                "the backend's own loop" if own else "transformers' forward",
                f"graphs compiled beside the load in {self.timings['prewarm_s']:.1f} s"
                if "prewarm_s" in self.timings
                else "the graphs compile before the first batch",
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

    def _own_loop(self, decoder) -> bool:
        return self.mode == "layers" and type(decoder).__name__ in OWN_LOOP and self.attn == "sdpa"

    def warm_len(self, T: int) -> int:
        """T, or the next length that equals no other size the layers' inputs have (2 rows, the
        hidden size, the head size): dynamo would give both one symbol and specialise the graph to
        that length, so every other length would compile again."""
        while T in self._taken_lengths:
            T += 1
        return T

    @functools.cached_property
    def _taken_lengths(self) -> frozenset[int]:
        return frozenset({2, *_sizes(self._config())})  # read once: `warm_len` runs per prewarm and part

    def _config(self):
        """The target's transformers config (a fresh copy: `_start_prewarm` edits it)."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.target.model_dir, local_files_only=True)

    def _start_prewarm(self, length: int) -> threading.Thread | None:
        """Compile the layers' graphs on a one-layer decoder of the target's config (random weights,
        built here: model construction changes torch's global default dtype, so never beside the
        load), in a thread that runs while the weights load. A failure only logs: the real layers
        then compile at `warm_up`."""
        from transformers import AutoModel

        cfg = self._config()
        cfg.num_hidden_layers = 1
        try:  # ordinary tensors, as the loaded model's, also when `extract` loads in inference mode
            with torch.inference_mode(False), torch.device(self.device):  # initialised where it runs
                dummy = AutoModel.from_config(cfg, dtype=getattr(torch, self.dtype), attn_implementation=self.attn)
        except Exception as e:  # e.g. a remote-code model: compile at warm_up as before
            log.warning("hf backend: no one-layer decoder to compile beside the load (%s)", e)
            return None
        dummy = dummy.eval().requires_grad_(False)  # as the loaded model's (load)
        compile_layers(dummy)
        T = self.warm_len(length)

        def run():
            t = time.perf_counter()
            try:
                ids = torch.full((2, T), self.pad_id, dtype=torch.long, device=self.device)
                with torch.inference_mode():
                    if self._own_loop(dummy):
                        self._layers(dummy, ids, (False,))
                    else:
                        dummy(input_ids=ids, output_hidden_states=True, use_cache=False)
                self.timings["prewarm_s"] = round(time.perf_counter() - t, 2)
            except Exception as e:
                log.warning("hf backend: compiling beside the load failed (%s); compiling at the first batch", e)

        th = threading.Thread(target=run, name="compile-beside-load", daemon=True)
        th.start()
        return th

    def _hf_forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [B, T, A, H], final [B, T, H]) in the model's dtype, through transformers' own forward."""
        out = self.decoder(input_ids=ids, output_hidden_states=True, use_cache=False)
        # hidden_states[j] enters layer j; last_hidden_state is after the final norm (lm_head input).
        return torch.stack([out.hidden_states[j] for j in self.taps], dim=2), out.last_hidden_state

    def _own_forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same states from the backend's own loop over the layers (`compile: layers`): the tap
        layers' inputs and the final norm's output. No attention mask, as in `_hf_forward`: SDPA's
        causal kernel; right padding keeps positions 0.."""
        kept, final = self._layers(self.decoder, ids, self._keep)
        aux = torch.stack(kept, dim=2)
        return (aux if self._order is None else aux[:, :, self._order]), final

    @staticmethod
    def _layers(dec, ids: torch.Tensor, keep: tuple) -> tuple[list, torch.Tensor]:
        """Embeddings, each layer (keeping the input of layer j where keep[j]), the final norm."""
        h = dec.embed_tokens(ids)
        pos = torch.arange(ids.shape[1], device=ids.device)[None]
        rope = dec.rotary_emb(h, pos)
        kept = []
        for layer, k in zip(dec.layers, keep):
            if k:
                kept.append(h)
            out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=rope, use_cache=False)
            h = out[0] if isinstance(out, tuple) else out  # a tuple in older transformers
        return kept, dec.norm(h)

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
        a part's fixed cost shows whatever compile is left (none after `_start_prewarm`: the graphs are
        already there) and its forward loop does not. Costs one two-row forward, once."""
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


def compile_layers(decoder) -> list:
    """Compile each decoder layer (dynamic shapes: one graph for every length and batch size)."""
    layers = [m for m in decoder.modules() if type(m).__name__.endswith("DecoderLayer")]
    for m in layers:
        m.compile(dynamic=True)
    return layers


def _sizes(cfg) -> set[int]:
    """The hidden and head sizes of a transformers config."""
    hidden = int(cfg.hidden_size)
    head = getattr(cfg, "head_dim", None) or hidden // int(cfg.num_attention_heads)
    return {hidden, int(head)}
