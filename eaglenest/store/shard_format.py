"""What shard_writer and shard_reader share of zarr v3's sharding format, as zarr writes it: each
inner chunk and the shard index end in a crc32c, and the index entry of a chunk left out is EMPTY."""

import google_crc32c
import numpy as np

EMPTY = np.uint64(2**64 - 1)  # the shard index entry (offset and length) of a chunk that was not written


def crc32c(b) -> bytes:
    """crc32c as zarr appends it (uint32 little-endian); `Checksum` takes any buffer without a copy."""
    c = google_crc32c.Checksum()
    c.update(b)
    return int.from_bytes(c.digest(), "big").to_bytes(4, "little")
