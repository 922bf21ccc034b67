"""States off the GPU without stalling it: copies to pinned host memory on a side stream."""

import torch


class PinnedCopy:
    """Copies to pinned host memory on a side stream (a DMA copy instead of a staged pageable one), so
    the next batch's forward runs while this one's states cross PCIe."""

    def __init__(self):
        self.stream = None

    def __call__(self, *tensors):
        """The host tensors, and the event that marks them complete."""
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors]
            for t in tensors:  # not reused by the compute stream before the copy has read it
                t.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record()
        return *host, done
