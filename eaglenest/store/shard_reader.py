"""A sample's rows read straight from a store's shard files, without zarr's read path: the mirror of
shard_writer, for the layout it writes and zarr reads (chunks split axis 0 only; inner chunks bytes
little-endian -> [zstd] -> crc32c; the shard index (offset, length) per chunk at the end, + crc32c;
a chunk left out, or a shard file absent, reads as the fill value, as in zarr). zarr's read of one
sample's rows of one array costs 1.5-3 ms of Python (its event loop and codec pipeline), whatever the
bytes: five arrays of an fp8 store held a training loader process to ~25k tokens/s. Every checksum
zarr checks is checked here too. A store in any other layout reads through zarr (`for_array`: None)."""

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from eaglenest.store.shard_format import EMPTY, crc32c

_BYTES = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "bytes"}]


class ShardReader:
    def __init__(
        self, shape: tuple, chunk_rows: int, shard_rows: int, dtype: np.dtype, fill, zstd: bool, file_of: Callable
    ):
        """file_of(piece) -> the shard file of rows [piece * shard_rows, (piece + 1) * shard_rows)."""
        self.row, self.chunk_rows, self.shard_rows = tuple(shape[1:]), chunk_rows, shard_rows
        self.dtype, self.fill, self.file_of = dtype.newbyteorder("<"), fill, file_of
        self.chunk_bytes = chunk_rows * int(np.prod(self.row, dtype=np.int64)) * dtype.itemsize
        self.n_chunks = shard_rows // chunk_rows
        self.index_bytes = self.n_chunks * 16 + 4
        self.zstd = None
        if zstd:
            from numcodecs import Zstd

            self.zstd = Zstd()
        self._indexes: dict[Path, tuple[tuple, np.ndarray]] = {}  # file -> (its stat, its chunk index)

    @staticmethod
    def for_array(array, file_of: Callable[[int], Path]) -> "ShardReader | None":
        """A reader of a zarr v3 array in the layout above, else None."""
        meta = array.metadata.to_dict()
        codecs = meta.get("codecs") or [{}]
        if len(codecs) != 1 or codecs[0].get("name") != "sharding_indexed" or meta["chunk_grid"]["name"] != "regular":
            return None
        conf, shard = codecs[0]["configuration"], meta["chunk_grid"]["configuration"]["chunk_shape"]
        inner, chunk, shape = list(conf["codecs"]), conf["chunk_shape"], meta["shape"]
        if (
            conf.get("index_location", "end") != "end"
            or list(conf["index_codecs"]) != [_BYTES[0], {"name": "crc32c"}]
            or inner[0] not in _BYTES
            or inner[-1] != {"name": "crc32c"}
            or [c["name"] for c in inner[1:-1]] not in ([], ["zstd"])
            or list(chunk[1:]) != list(shape[1:])
            or list(shard[1:]) != list(shape[1:])
            or shard[0] % chunk[0]
        ):
            return None
        return ShardReader(shape, chunk[0], shard[0], array.dtype, array.fill_value, len(inner) == 3, file_of)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of one piece (a sample never spans pieces)."""
        piece, at = divmod(start, self.shard_rows)
        if stop - piece * self.shard_rows > self.shard_rows:
            raise ValueError(f"rows {start}:{stop} span pieces {piece} and {piece + 1}")
        out = np.empty((stop - start, *self.row), self.dtype)
        path = self.file_of(piece)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            out[...] = self.fill
            return out
        try:
            index = self._index(fd, path)
            done = 0
            while done < len(out):
                c, off = divmod(at + done, self.chunk_rows)
                take = min(len(out) - done, self.chunk_rows - off)
                out[done : done + take] = self._chunk(fd, path, index, c)[off : off + take]
                done += take
        finally:
            os.close(fd)
        return out

    def _index(self, fd: int, path: Path) -> np.ndarray:
        st = os.fstat(fd)
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        known = self._indexes.get(path)
        if known and known[0] == key:
            return known[1]
        if st.st_size < self.index_bytes:
            raise ValueError(f"{path}: {st.st_size} bytes, shorter than its shard index ({self.index_bytes})")
        b = os.pread(fd, self.index_bytes, st.st_size - self.index_bytes)
        if crc32c(b[:-4]) != b[-4:]:
            raise ValueError(f"{path}: the shard index's crc32c does not match")
        index = np.frombuffer(b[:-4], "<u8").reshape(self.n_chunks, 2)
        self._indexes[path] = (key, index)
        return index

    def _chunk(self, fd: int, path: Path, index: np.ndarray, c: int) -> np.ndarray:
        offset, length = index[c]
        if offset == EMPTY and length == EMPTY:
            return np.full((self.chunk_rows, *self.row), self.fill, self.dtype)
        b = np.frombuffer(os.pread(fd, int(length), int(offset)), np.uint8)  # slices of it are views, not copies
        if len(b) != length or length < 4 or crc32c(b[:-4]) != b[-4:].tobytes():
            raise ValueError(f"{path}: chunk {c}'s crc32c does not match (or it is cut short)")
        data = self.zstd.decode(b[:-4]) if self.zstd else b[:-4]
        if len(data) != self.chunk_bytes:
            raise ValueError(f"{path}: chunk {c} holds {len(data)} bytes, not {self.chunk_bytes}")
        return np.frombuffer(data, self.dtype).reshape(self.chunk_rows, *self.row)
