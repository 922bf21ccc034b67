"""The hf backend's own weight loader: parameters filled straight from the safetensors files -- the
file read into pinned buffers and copied to the GPU by DMA, several buffers in flight (an 8B target's
16 GB at 11.8 GB/s on the H200) -- instead of transformers' loader. The parameters are the own
layers' (`llama.allocate`), or a decoder transformers built from the config on the device
(`build_decoder`, for the decoders the own layers do not run). Only where the files hold exactly those
parameters, in their dtype; anything else (another dtype, extra or missing tensors, no safetensors)
is reported by `plan_copy`: the own layers then read through safetensors with a cast (`copy_cast`),
transformers' decoder loads through transformers. The gate's reference is loaded by transformers,
independently of this path, so a wrong mapping here fails the gate."""

import logging
import os
import queue
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from eaglenest.runtime.errors import EaglenestError
from eaglenest.target.files import read_header
from eaglenest.target.loading import LOADING, quiet_transformers

log = logging.getLogger(__name__)

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
CHUNK = 256 << 20  # bytes read and copied at a time, per reader
READERS = 4  # page-cache copies scale with threads; the DMA engines do not need more


class Unsupported(Exception):
    """The files do not hold exactly the decoder's parameters: load through transformers instead."""


def build_decoder(model_dir: Path, dtype: str, device: str, attn: str):
    """The target's decoder stack (no lm_head), allocated on `device` and left uninitialised: every
    parameter is overwritten by `copy_weights`. Under `target.LOADING`, as every model build here
    (transformers sets torch's process-wide default dtype while it builds a model)."""
    from transformers import AutoConfig, AutoModel
    from transformers.initialization import no_init_weights

    quiet_transformers()
    cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with LOADING, torch.device(device), no_init_weights():
        model = AutoModel.from_config(cfg, dtype=getattr(torch, dtype), attn_implementation=attn)
    return model.eval().requires_grad_(False)


def plan_copy(model_dir: Path, want: dict[str, torch.Tensor]) -> list[tuple[Path, int, int, torch.Tensor]]:
    """(file, byte offset, byte count, destination bytes) for every parameter in `want` (name ->
    tensor: a decoder's state_dict, or `llama.allocate`'s), in file order; raises Unsupported unless the
    files hold each parameter once, in its shape and dtype (a causal LM's `model.` prefix and its
    lm_head are allowed)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise Unsupported(f"no safetensors in {model_dir}")
    copies, seen = [], set()
    for path in files:
        header, base = read_header(path)
        for name, meta in header.items():
            if name == "__metadata__" or name.startswith("lm_head."):
                continue
            key = name.removeprefix("model.") if name.removeprefix("model.") in want else name
            t = want.get(key)
            if t is None or key in seen:
                raise Unsupported(f"{path.name}: tensor {name} is not a parameter of the decoder, or twice")
            if DTYPES.get(meta["dtype"]) != t.dtype or list(meta["shape"]) != list(t.shape) or not t.is_contiguous():
                have = f"{meta['dtype']} {meta['shape']}"
                raise Unsupported(f"{path.name}: {name} is {have}, the decoder's {t.dtype} {list(t.shape)}")
            a, b = meta["data_offsets"]
            seen.add(key)
            copies.append((path, base + a, b - a, t.data.view(-1).view(torch.uint8)))
    if missing := sorted(set(want) - seen):
        raise Unsupported(f"{len(missing)} decoder parameters not in the files, e.g. {missing[0]}")
    return sorted(copies, key=lambda c: (str(c[0]), c[1]))


def copy_weights(copies, device: str) -> int:
    """Fill the parameters from the files: `READERS` threads each read CHUNK-sized runs of the files
    (os.preadv: one page-cache copy, no page faults) into a pinned buffer and copy them out on a CUDA
    stream of their own; on the CPU straight into the parameters. Returns the bytes copied."""
    cuda = device.startswith("cuda")
    runs = []  # (file, offset, bytes, [(dst, dst offset, run offset, n)]) of at most CHUNK bytes
    for path, off, n, dst in copies:
        for s in range(0, n, CHUNK):
            k = min(CHUNK, n - s)
            if runs and runs[-1][0] == path and runs[-1][1] + runs[-1][2] == off + s and runs[-1][2] + k <= CHUNK:
                runs[-1][3].append((dst, s, runs[-1][2], k))
                runs[-1][2] += k
            else:
                runs.append([path, off + s, k, [(dst, s, 0, k)]])
    fds = {p: os.open(p, os.O_RDONLY) for p in {r[0] for r in runs}}
    slots = queue.Queue()  # (pinned buffer, stream, event of its last copies) per reader
    if cuda:
        for _ in range(READERS):
            slots.put((torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True), torch.cuda.Stream(device), None))

    def read(path, buf, off):
        if os.preadv(fds[path], [memoryview(buf)], off) != len(buf):
            raise EaglenestError(f"{path}: short read at byte {off}: the file is shorter than its header says")

    def one(run):
        path, off, n, parts = run
        if not cuda:
            for dst, d, r, k in parts:
                read(path, dst[d : d + k].numpy(), off + r)
            return n
        buf, stream, done = slots.get()
        try:
            if done is not None:
                done.synchronize()  # the buffer's previous copies have read it
            read(path, buf[:n].numpy(), off)
            with torch.cuda.stream(stream):
                for dst, d, r, k in parts:
                    dst[d : d + k].copy_(buf[r : r + k], non_blocking=True)
                done = torch.cuda.Event()
                done.record()
        finally:
            slots.put((buf, stream, done))
        return n

    try:
        with ThreadPoolExecutor(READERS, thread_name_prefix="weights") as pool:
            total = sum(pool.map(one, runs))
        if cuda:
            torch.cuda.synchronize(device)
    finally:
        for fd in fds.values():
            os.close(fd)
    return total


def copy_cast(model_dir: Path, want: dict[str, torch.Tensor]) -> int:
    """Fill `want` from the safetensors through the safetensors library, cast to each destination's
    dtype: the slow path, for files in another dtype. An error names a tensor missing or misshapen."""
    from safetensors import safe_open

    done, n = set(), 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                key = name.removeprefix("model.")
                if key not in want:
                    continue
                t = f.get_tensor(name)
                if t.shape != want[key].shape:
                    raise EaglenestError(f"{path}: {name} is {list(t.shape)}, expected {list(want[key].shape)}")
                want[key].copy_(t)
                done.add(key)
                n += t.nbytes
    if missing := sorted(set(want) - done):
        raise EaglenestError(f"{model_dir}: {len(missing)} tensors missing from the safetensors, e.g. {missing[0]}")
    return n
