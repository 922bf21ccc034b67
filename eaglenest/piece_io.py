"""Writing one finished piece (= one zarr shard per array): digests of the exact stored bytes,
zarr encode + write, fsync. Runs in a writer thread, or in a writer PROCESS over shared-memory
buffers: zarr encodes through one event loop per process, which caps a process at a few hundred
MB/s, so a many-core GPU host writes pieces in several processes at once."""
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import zarr

from .atomic import fsync_path
from .store import sample_digest


class PieceBuffers:
    """ids [S] int32 (-1 = padding), aux [S, A, H] and final [S, H] uint16, optionally in shared memory."""

    SPECS = (("ids", np.int32), ("aux", np.uint16), ("final", np.uint16))

    def __init__(self, S: int, A: int, H: int, shared: bool):
        shapes = {"ids": (S,), "aux": (S, A, H), "final": (S, H)}
        self.shm, self.arrays = {}, {}
        for name, dtype in self.SPECS:
            size = int(np.prod(shapes[name])) * np.dtype(dtype).itemsize
            if shared:
                self.shm[name] = shared_memory.SharedMemory(create=True, size=size)
                self.arrays[name] = np.ndarray(shapes[name], dtype=dtype, buffer=self.shm[name].buf)
                self.arrays[name].fill(-1 if name == "ids" else 0)
            else:
                self.arrays[name] = np.full(shapes[name], -1 if name == "ids" else 0, dtype=dtype)
        self.spec = {name: (self.shm[name].name, shapes[name], np.dtype(dtype).str)
                     for name, dtype in self.SPECS} if shared else None

    def release(self) -> None:
        self.arrays = {}
        for shm in self.shm.values():
            try:
                shm.close()
            except BufferError:  # a view still alive (an error path): the mapping goes with it
                pass
            shm.unlink()
        self.shm = {}


def shard_files(store: Path, piece: int) -> list[Path]:
    return [store / "aux" / "c" / str(piece) / "0" / "0", store / "final" / "c" / str(piece) / "0",
            store / "input_ids" / "c" / str(piece)]


def write_piece(store: Path, index: int, S: int, ids, aux, final, rows: list[dict]) -> tuple[list[str], int]:
    """Returns (digest per row, bytes written). The caller commits the piece's manifest afterwards."""
    digests = []
    for r in rows:
        o, n = r["start"] - index * S, r["length"]
        digests.append(sample_digest(ids[o:o + n], aux[o:o + n], final[o:o + n]))
    group = zarr.open_group(str(store), mode="r+")
    sl = slice(index * S, (index + 1) * S)
    group["input_ids"][sl] = ids
    group["aux"][sl] = aux
    group["final"][sl] = final
    written = 0
    for f in shard_files(Path(store), index):
        if f.exists():  # an all-fill shard is not written by zarr
            fsync_path(f)
            written += f.stat().st_size
    return digests, written


def write_piece_shared(store: str, index: int, S: int, spec: dict, rows: list[dict]) -> tuple[list[str], int]:
    """`write_piece` in a writer process, reading the piece from the parent's shared memory."""
    handles, arrays = [], {}
    try:
        for name, (shm_name, shape, dtype) in spec.items():
            shm = shared_memory.SharedMemory(name=shm_name)
            handles.append(shm)
            arrays[name] = np.ndarray(shape, dtype=np.dtype(dtype), buffer=shm.buf)
        return write_piece(Path(store), index, S, arrays["ids"], arrays["aux"], arrays["final"], rows)
    finally:
        arrays.clear()
        for shm in handles:
            shm.close()
