"""`hf` backend: transformers in-process, CPU or CUDA. Right-padded batches with an attention mask;
a real token never attends to padding, so a batch equals its samples run one by one (within dtype)."""
import logging

import numpy as np
import torch

from ..target import Target, load_model
from ..versions import CAPTURE_VERSIONS

log = logging.getLogger(__name__)


def pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class HFBackend:
    def __init__(self, target: Target, taps: list[int], dtype: str = "bfloat16", device: str = "auto",
                 attn: str = "sdpa", compile: bool = False):
        self.device = pick_device(device)
        self.target, self.taps, self.dtype, self.attn, self.compile = target, list(taps), dtype, attn, compile
        self.decoder = None  # loaded on first use: a fully resumed part never loads the model
        self.pad_id = 0

    def _load(self):
        model = load_model(self.target, dtype=self.dtype, device=self.device, attn=self.attn)
        # The decoder stack without lm_head: no full-vocab logits are ever computed.
        self.decoder = model.get_decoder()
        if self.compile:  # fuses norms/activations; compiles once per new batch shape
            self.decoder = torch.compile(self.decoder, dynamic=True)
        log.info("hf backend: %s on %s, taps %s", self.dtype, self.device, self.taps)

    def describe(self) -> dict:
        import transformers
        return {"backend": "hf", "version": f"transformers-{transformers.__version__}",
                "capture_version": CAPTURE_VERSIONS["hf"], "device": self.device}

    def close(self) -> None:
        self.decoder = None

    def extract(self, batch: list[np.ndarray]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.extract_async(batch)()

    @torch.inference_mode()
    def extract_async(self, batch: list[np.ndarray]):
        """Launch the forward and the copies to pinned host memory; returns a callable that waits
        for them and gives [(aux [n, A, H], final [n, H]) bf16 CPU] per sample. On CUDA the caller
        can launch the next batch first, so the GPU never idles while the host copies."""
        if self.decoder is None:
            self._load()
        lengths = [len(x) for x in batch]
        T = max(lengths)
        ids = torch.full((len(batch), T), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), T), dtype=torch.long)
        for b, x in enumerate(batch):
            ids[b, :len(x)] = torch.from_numpy(np.asarray(x, dtype=np.int64))
            mask[b, :len(x)] = 1
        out = self.decoder(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                           output_hidden_states=True, use_cache=False)
        # hidden_states[j] enters layer j; last_hidden_state is after the final norm (lm_head input).
        aux = torch.stack([out.hidden_states[j] for j in self.taps], dim=2).to(torch.bfloat16)
        final = out.last_hidden_state.to(torch.bfloat16)
        done = None
        if aux.is_cuda:  # pinned buffers: a fast DMA copy instead of a staged pageable one
            aux = torch.empty(aux.shape, dtype=aux.dtype, pin_memory=True).copy_(aux, non_blocking=True)
            final = torch.empty(final.shape, dtype=final.dtype, pin_memory=True).copy_(final, non_blocking=True)
            done = torch.cuda.Event()
            done.record()

        def wait():
            if done is not None:
                done.synchronize()
            return [(aux[b, :n], final[b, :n]) for b, n in enumerate(lengths)]
        return wait
