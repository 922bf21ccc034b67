"""The hf backend's compiled layers: transformers' decoder layers compiled in place (`compile: true`),
or the own layer function compiled in a thread while the weights are copied in (`llama.make_layer`
through torch.compile, `compile: layers`; with `llama_kernels.OPS`, whose Triton kernels build on
their first run, `compile: kernels`); and the lengths a graph may be compiled at.

`extract.hf.compile` fuses what eager runs as separate memory-bound kernels: RMSNorm's fp32
casts/pow/mean/rsqrt, SiLU x up, RoPE's rotate-half (29 % of an 8B forward's GPU time eager;
compiled, the H200 forward went 0.61 -> 0.75 MFU). auto: `kernels` on CUDA, off on the CPU.
- kernels: the backend runs the decoder itself, as plain functions (`llama`: Llama, Mistral,
  Qwen2, Qwen3 with SDPA; the same ops as transformers', bit for bit eager), its norms, rotary,
  SiLU x up and residual sum as Triton kernels of its own (`llama_kernels`), built in a thread
  while the weights are copied in (`LayerCompile`). No torch.compile (whose cold
  compile the first batch waited for) and no transformers modeling import in the stage (most
  of an 8B load's 10 s of `load_s` on the H200). CUDA only (the CPU runs them in Triton's
  interpreter, TRITON_INTERPRET=1: the tests). Other decoders run as `true`.
- layers: the same own decoder, its layer (`llama.make_layer`) one torch.compile graph for every
  layer and shape, compiled in that thread.
- true: each of transformers' decoder layers compiled inside its forward, whose hidden-state
  capture hooks read a ContextVar that dynamo cannot trace: three graphs a layer (input norm |
  attention | the rest), compiled at the warm-up before the first batch, after the load (a
  compile beside transformers' load is unsafe: both set torch's process-wide default dtype, and
  fx's tracing patches `nn.Module.__call__` for every thread).
The loop compiled whole (one graph a batch) was measured and dropped: on the H200 its cold
compile took 67 s and its batches kept recompiling (forward loop at MFU 0.13; RESULTS.md).
Dynamo specialises a size of 1, so compiled batches are never one row or one token long: a
part's occasional one-sample batch (a piece's remainder) gets a padding row, dropped after, and
runs the graphs every batch runs. One family of graphs, compiled once before the first batch.
A graph compiled with its length equal to the head or hidden size would be specialised to that
length (dynamo gives equal sizes one symbol): `warm_len` avoids those.
"""

import logging
import threading
import time

import torch

from eaglenest.extraction.backends.llama import Decoder, rotary
from eaglenest.target.loading import use_device

log = logging.getLogger(__name__)


def compile_layers(decoder) -> list:
    """Compile each of transformers' decoder layers (dynamic shapes: one graph for every length and
    batch size)."""
    layers = [m for m in decoder.modules() if type(m).__name__.endswith("DecoderLayer")]
    for m in layers:
        m.compile(dynamic=True)
    return layers


def compile_length(T: int, avoid: set[int]) -> int:
    """T, or the next length that is not 2 (the rows) nor one of `avoid` (the hidden, head, ... sizes):
    dynamo gives equal sizes one symbol and would specialise the graph to that length, so every other
    length would compile again."""
    while T in avoid | {2}:
        T += 1
    return T


class LayerCompile:
    """The own layer function compiled by running it once, in a thread, on two rows of zeros through
    layer 0's weights -- whatever they hold yet: the copy may still be filling them. `dynamo`: through
    torch.compile (the rows and the length dynamic: one graph for every layer, length and batch size),
    else the layer as it is (its Triton kernels build on that run). Safe beside the copy and the
    loop's start because that code calls no nn.Module (fx's tracing patches `nn.Module.__call__` for
    every thread) and leaves torch's default dtype alone (dynamo restores it after a compile). `wait`
    installs the compiled function; every batch runs it, so the stored bytes never depend on when the
    compile finished."""

    def __init__(self, decoder: Decoder, device: str, dynamo: bool = True):
        self.decoder, self.compiled, self.dynamo = decoder, None, dynamo
        self.error, self.seconds, self.cpu_s = None, 0.0, 0.0
        self.thread = threading.Thread(target=self._run, args=(device,), name="compile-layer", daemon=True)
        self.thread.start()

    def _run(self, device: str) -> None:
        t, cpu = time.perf_counter(), time.thread_time()
        s = self.decoder.spec
        try:
            use_device(device)  # this thread's own current device: Triton launches on it
            # torch.compile imports dynamo: ~1 s, off the loading thread
            self.compiled = torch.compile(self.decoder.layer) if self.dynamo else self.decoder.layer
            w = self.decoder.per_layer[0]
            sizes = {s.hidden, s.head_dim, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.intermediate}
            T = compile_length(67, sizes)
            with torch.inference_mode():  # as the loop runs: the same guards
                h = torch.zeros(2, T, s.hidden, dtype=w[0].dtype, device=device)
                cos, sin = rotary(self.decoder.inv_freq, T, h.dtype)
                # the rows and the length symbolic, the rest (weights, eps, ...) constants: a float
                # traced as a symbol would make dynamo start over (2.3 s of the H200's compile)
                for x, dims in ((h, (0, 1)), (cos, (0,)), (sin, (0,))) if self.dynamo else ():
                    for dim in dims:
                        torch._dynamo.mark_dynamic(x, dim)
                self.decoder.ops.norm(self.compiled(h, cos, sin, w), self.decoder.weights["norm.weight"], s.eps)
            if device.startswith("cuda"):
                torch.cuda.synchronize(device)
        except BaseException as e:  # raised by `wait`, in the loop's thread
            self.error = e
        self.seconds, self.cpu_s = time.perf_counter() - t, time.thread_time() - cpu

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error
        self.decoder.layer = self.compiled
        # its thread's CPU time against its wall clock: what the rest of the process took from it (GIL)
        what = "the own layer compiled" if self.dynamo else "the own layer's Triton kernels built"
        log.info("hf backend: %s in %.1f s, %.1f s of its thread's CPU time", what, self.seconds, self.cpu_s)
