"""The own layers' Triton kernels (`llama_kernels`, `extract.hf.compile: kernels`) on the CPU, in
Triton's interpreter: run by `test_extract.test_own_kernels_in_the_triton_interpreter` as a process of
its own with TRITON_INTERPRET=1, because triton decides at its import and the test process has
imported it already (inductor does). Prints one JSON line of figures for the test to judge.

    TRITON_INTERPRET=1 python -m tests.kernels_interpreted <scratch dir>
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from eaglenest.extraction.backends import llama, llama_kernels
from eaglenest.extraction.backends.hf import HFBackend
from eaglenest.extraction.backends.hf_weights import copy_cast
from eaglenest.extraction.gate import token_stats
from eaglenest.runtime.errors import EaglenestError
from eaglenest.target.taps import resolve_taps

from .conftest import make_tiny_target, random_samples
from .test_extract import family_target


def worst(pairs) -> dict:
    cos, rel = zip(*(token_stats(x.flatten(0, -2).float(), y.flatten(0, -2).float()) for x, y in pairs))
    return {"min_cos": min(c.min().item() for c in cos), "max_rel": max(r.max().item() for r in rel)}


def layers(root: Path, family: str) -> dict:
    """The own decoder, eager and with the kernels, float32: every layer's input and the final norm."""
    path = family_target(root, family)
    spec = llama.plan(path)
    weights = llama.allocate(spec, torch.float32, "cpu")
    copy_cast(path, weights)
    eager, kern = llama.Decoder(spec, weights), llama.Decoder(spec, weights, llama_kernels.OPS)
    ids = torch.from_numpy(np.stack(random_samples(3, 512, 23, 23, seed=7))).long()
    with torch.inference_mode():
        (a, f), (a1, f1) = eager.run(ids, (True,) * spec.layers), kern.run(ids, (True,) * spec.layers)
    return worst(zip([*a, f], [*a1, f1]))


def odd_shapes() -> dict:
    """One layer of random float32 weights at sizes the masks must handle: a hidden size, head count
    and head size that are no powers of two (SmolLM2's 576 / 9 heads / 3 kv heads; a head of 80)."""
    out = {}
    for hidden, heads, kv, d in ((576, 9, 3, 64), (160, 2, 1, 80)):
        spec = llama.Spec(layers=1, hidden=hidden, intermediate=3 * hidden - 17, vocab=100, heads=heads, kv_heads=kv,
                          head_dim=d, eps=1e-5, rope=(1e4, None), optional=())  # fmt: skip
        g = torch.Generator().manual_seed(0)
        w = {k: torch.randn(s, generator=g) * (0.1 if len(s) == 2 else 1) for k, s in llama.shapes(spec).items()}
        dec = llama.Decoder(spec, w)
        h = torch.randn(2, 9, hidden, generator=g)
        cos, sin = llama.rotary(dec.inv_freq, 9, torch.float32)
        eager = llama.make_layer(spec)(h, cos, sin, dec.per_layer[0])
        kern = llama.make_layer(spec, llama_kernels.OPS)(h, cos, sin, dec.per_layer[0])
        out[f"{hidden}/{heads}/{kv}/{d}"] = worst([(eager, kern)])
    return out


def backend(root: Path) -> dict:
    """Through the hf backend, against eager transformers; then refused outside the interpreter."""
    target = make_tiny_target(root / "tiny")
    taps = resolve_taps("auto", target.num_layers)
    eager = HFBackend(target, taps, dtype="float32", device="cpu", compile=False)
    kern = HFBackend(target, taps, dtype="float32", device="cpu", compile="kernels")
    seqs = random_samples(3, target.vocab_size, 2, 40, seed=4) + [np.array([5], dtype=np.int32)]
    pairs = [(torch.cat([a.flatten(0, 1), f]), torch.cat([a1.flatten(0, 1), f1]))
             for (a, f), (a1, f1) in zip(eager.extract(seqs), kern.extract(seqs))]  # fmt: skip
    out = {**worst(pairs), "lengths": [len(s) for s in seqs], "version": kern.describe()["version"],
           "layer_module": kern.decoder.ops.rotate.__module__, "compile_s": kern.timings["compile_s"]}  # fmt: skip
    os.environ.pop("TRITON_INTERPRET")
    try:
        HFBackend(target, taps, device="cpu", compile="kernels")
    except EaglenestError as e:
        out["refused"] = str(e)
    return out


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    root = Path(sys.argv[1])
    out = {family: layers(root, family) for family in ("llama_bias", "qwen3")}
    out["odd_shapes"] = odd_shapes()
    out["backend"] = backend(root)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
