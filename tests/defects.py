"""Extraction defects the gate must catch, as hf backends that make them: each is a class of real
failure (docs/design.md: Gate), injected where the states are computed."""

import torch

from eaglenest.extraction.backends.hf import HFBackend


class OffByOneTap(HFBackend):
    """Captures the residual stream one layer too late (the SGLang id-vs-index confusion)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.taps = [t + 1 for t in self.taps]


class PreNormFinal(HFBackend):
    """Stores the last layer's output BEFORE the final norm as `final`."""

    def extract_async(self, batch):
        if self.decoder is None:
            self.load()
        grabbed = {}
        h = self.decoder.norm.register_forward_pre_hook(lambda _m, a: grabbed.setdefault("x", a[0]))
        try:
            wait = super().extract_async(batch)
        finally:
            h.remove()
        pre = grabbed["x"].to(torch.bfloat16).cpu()
        return lambda: [(a, pre[b, : len(x)]) for b, ((a, _), x) in enumerate(zip(wait(), batch))]


class DroppedFirstPosition(HFBackend):
    """Loses the first position and shifts the rest forward (padding the end), as a capture that
    misses the first token would."""

    def extract_async(self, batch):
        wait = super().extract_async(batch)
        return lambda: [(torch.cat([a[1:], a[-1:]]), torch.cat([f[1:], f[-1:]])) for a, f in wait()]


class PrefixOutOfContext(HFBackend):
    """Each sample in two requests, the second half computed without the first in its context: the
    states an engine returns when it takes a prefix from its cache but not the prefix's keys and values."""

    def extract_async(self, batch):
        halves = [part for x in batch for part in (x[: len(x) // 2], x[len(x) // 2 :])]
        wait = super().extract_async(halves)

        def joined():
            got = wait()
            return [tuple(torch.cat([a, b]) for a, b in zip(got[2 * i], got[2 * i + 1])) for i in range(len(batch))]

        return joined


class OtherSeed(HFBackend):
    """The target's architecture with weights drawn from another seed, in memory (as `random_weights`
    draws them): the states of another model, where a second checkpoint would not fit the disk."""

    seed = 1

    def _load(self):
        from transformers import AutoConfig, AutoModelForCausalLM

        super()._load()
        torch.manual_seed(self.seed)
        with torch.device(self.device):
            other = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(self.target.model_dir), dtype=getattr(torch, self.dtype)
            )
        self.decoder.load_state_dict(other.get_decoder().state_dict())
