"""The hidden-state store of one part: a Zarr v3 group (docs/design.md: Store).

    aux        [n_pieces*S, n_aux, H] uint16 (bfloat16 bits), chunks (C, n_aux, H), shards (S, n_aux, H)
    final      [n_pieces*S, H]        uint16 (bfloat16 bits)
    input_ids  [n_pieces*S]           int32
  or, with `store.states: fp8` (state_format): aux and final as uint8 (float8_e4m3fn bits) plus
    aux_scale  [n_pieces*S, n_aux]    float32, chunks (C, n_aux), shards (S, n_aux)
    final_scale [n_pieces*S]          float32
    index.parquet  id, key, start, length, digest, piece
    checksums.json xxh3-128 of every metadata file (every zarr.json, index.parquet); written last:
                   its presence commits the store

A piece is one zarr shard of S token rows holding whole samples, zero-padded at its end, so every
writer owns whole shards. Digest = xxh3-128 over the sample's ids and state arrays as stored. Every inner
chunk carries a crc32c (and so does each shard index), so a flipped byte anywhere in a
shard, padding included, fails the read of the sample it sits in; metadata is covered by
checksums.json, checked on every open. Samples are read from the shard files by shard_reader (the
same checks, without zarr's per-read cost), or by zarr where a store's layout is another.
"""

import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec

from eaglenest.files.atomic import replaced_file
from eaglenest.files.hashing import content_digest, sha256_text
from eaglenest.runtime.errors import EaglenestError
from eaglenest.runtime.versions import STORE_SCHEMA_VERSION as SCHEMA_VERSION
from eaglenest.store import states as state_format
from eaglenest.store.checksums import INDEX, RESTORE, check_checksums, states_of
from eaglenest.store.shard_reader import ShardReader

log = logging.getLogger(__name__)

INDEX_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("key", pa.string()),
        ("start", pa.int64()),
        ("length", pa.int32()),
        ("digest", pa.string()),
        ("piece", pa.int32()),
    ]
)
TAP_SEMANTICS = (
    "tap j = HF outputs.hidden_states[j] = residual stream entering decoder layer j "
    "(0 = embeddings); final = last layer output after the final norm (lm_head input)"
)


@dataclass(frozen=True)
class Layout:
    hidden: int
    n_aux: int
    chunk_tokens: int  # inner chunk = unit of reading
    shard_tokens: int  # shard = piece = unit of writing
    codec: str = "zstd"
    level: int = 1
    states: str = "bf16"  # state_format: bf16 | fp8
    # shard files named <array>/c.<piece>.0..., side by side: DVC md5-hashes a directory's files
    # core.checksum_jobs at a time but one directory at a time, so zarr's default "/" (a directory per
    # piece) hashed a store on one core. Readers take it from each array's zarr.json: "/" stores still read.
    key_separator: str = "."

    @staticmethod
    def for_sizes(
        hidden: int,
        n_aux: int,
        chunk_mb: float,
        shard_mb: float,
        codec: str,
        level: int,
        max_seq_len: int,
        states: str = "bf16",
    ) -> "Layout":
        spec = state_format.arrays(states, n_aux, hidden)
        row = sum(int(np.prod(shape)) * dt.itemsize for shape, dt in spec.values())  # stored bytes per token
        chunk = max(16, int(chunk_mb * 2**20 / (n_aux * hidden * spec["aux"][1].itemsize)) // 16 * 16)
        shard = max(chunk, int(shard_mb * 2**20 / row) // chunk * chunk)
        # a sample never spans pieces, so a piece must hold the longest sample
        shard = max(shard, -(-max_seq_len // chunk) * chunk)
        if codec not in ("none", "zstd"):
            raise EaglenestError(f"store.codec must be none or zstd, got {codec!r}")
        return Layout(hidden, n_aux, chunk, shard, codec, level, states)

    def arrays(self) -> dict[str, tuple[tuple, np.dtype]]:
        return stored_arrays(self.states, self.n_aux, self.hidden)


def stored_arrays(states: str, n_aux: int, hidden: int) -> dict[str, tuple[tuple, np.dtype]]:
    """Every stored array: name -> (one token's row shape, dtype); input_ids first, as digested."""
    return {"input_ids": ((), np.dtype(np.int32)), **state_format.arrays(states, n_aux, hidden)}


def fill_value(name: str) -> int:
    return -1 if name == "input_ids" else 0  # -1: padding rows have no token


def _compressors(layout: Layout):
    crc = Crc32cCodec()
    return [ZstdCodec(level=layout.level), crc] if layout.codec == "zstd" else [crc]


def create_arrays(group: zarr.Group, layout: Layout, n_pieces: int) -> None:
    rows, C, S = n_pieces * layout.shard_tokens, layout.chunk_tokens, layout.shard_tokens
    comp = _compressors(layout)
    for name, (row, dtype) in layout.arrays().items():
        group.create_array(
            name,
            shape=(rows, *row),
            chunks=(C, *row),
            shards=(S, *row),
            dtype=dtype,
            compressors=comp,
            chunk_key_encoding={"name": "default", "separator": layout.key_separator},
            fill_value=fill_value(name),
            overwrite=True,
        )


def array_names(states: str) -> list[str]:
    return list(stored_arrays(states, 0, 0))


def sample_digest(arrays: dict[str, np.ndarray]) -> str:
    """Over input_ids then the state arrays, as stored (`Layout.arrays` order)."""
    return content_digest(*(np.ascontiguousarray(a) for a in arrays.values()))


def write_index(path: Path, rows: list[dict]) -> None:
    """rows in the order the index lists them (the part's input order); `start` says where each lies."""
    table = pa.table({k: [r[k] for r in rows] for k in INDEX_SCHEMA.names}, schema=INDEX_SCHEMA)
    with replaced_file(Path(path) / INDEX) as tmp:
        pq.write_table(table, tmp)


class HiddenStore:
    """Read side. Every sample read is checked against its digest; corruption names part and sample."""

    def __init__(self, path: Path, check_metadata: bool = True):
        self.path = Path(path)
        if not self.path.is_dir():
            raise EaglenestError(f"{self.path}: no such store")
        if not (self.path / "zarr.json").is_file():
            raise EaglenestError(f"{self.path}/zarr.json: missing (not a hidden-state store, or incomplete); {RESTORE}")
        if check_metadata:
            check_checksums(self.path)
        self.group = zarr.open_group(str(self.path), mode="r")
        self.attrs = dict(self.group.attrs)
        if self.attrs.get("schema_version") != SCHEMA_VERSION:
            raise EaglenestError(f"{self.path}: schema_version {self.attrs.get('schema_version')} != {SCHEMA_VERSION}")
        self.part = self.attrs.get("part", self.path.name)
        index = self.path / INDEX
        if not index.is_file():
            raise EaglenestError(f"{index}: missing: the store was never committed (half-written?); {RESTORE}")
        self.index = pq.read_table(index).to_pylist()
        self.states = states_of(self.attrs)
        self.arrays = {n: self.group[n] for n in array_names(self.states)}
        self.readers = {n: ShardReader.for_array(a, partial(self.shard_file, n)) for n, a in self.arrays.items()}

    def __len__(self) -> int:
        return len(self.index)

    @property
    def n_tokens(self) -> int:
        return sum(r["length"] for r in self.index)

    def samples_digest(self) -> str:
        """The store's content as indexed: the digest of its samples' digests, in its order (what
        the teacher's output and pack's index were made from)."""
        return sha256_text(*(r["digest"] for r in self.index))

    def shard_file(self, name: str, piece: int) -> Path:
        """The file of array `name` that holds `piece` (the key encoding is the store's own zarr.json's)."""
        a = self.arrays[name]
        return self.path / name / a.metadata.encode_chunk_key((piece,) + (0,) * (a.ndim - 1))

    def missing_files(self, piece: int) -> list[Path]:
        """Shard files of `piece` not on disk. zarr reads a missing shard as its fill value, so a
        deleted file shows only as a digest mismatch; this names it. (zarr writes no file for a shard
        that is all fill value, which no piece of real samples is.)"""
        return [f for f in (self.shard_file(n, piece) for n in self.arrays) if not f.is_file()]

    def samples_of_piece(self, piece: int) -> list[str]:
        return [r["id"] for r in self.index if r["piece"] == piece]

    def read_stored(self, i: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(input_ids int32 [n], the state arrays of sample i as stored: `states.arrays`); digest-verified."""
        r = self.index[i]
        sl = slice(r["start"], r["start"] + r["length"])
        where = f"store {self.part} ({self.path}): sample {r['id']!r} (index {i})"
        try:
            stored = {n: self._read(n, sl) for n in self.arrays}
        except Exception as e:  # crc32c, codec or shard-index checksum failure
            raise EaglenestError(f"{where} is unreadable, the shard is corrupt: {type(e).__name__}: {e}") from None
        if sample_digest(stored) != r["digest"]:
            missing = self.missing_files(r["piece"])
            if missing:
                held = self.samples_of_piece(r["piece"])
                raise EaglenestError(
                    f"{where}: {missing_message(missing, held)}; restore the store "
                    f"(`dvc checkout {self.path}`) or re-extract it"
                )
            raise EaglenestError(f"{where} digest mismatch: stored bytes are corrupt")
        return stored.pop("input_ids"), stored

    def _read(self, name: str, rows: slice) -> np.ndarray:
        reader = self.readers[name]
        return reader.read(rows.start, rows.stop) if reader else self.arrays[name][rows]

    def read(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input_ids int32 [n], aux uint16 [n, n_aux, H], final uint16 [n, H]) of sample i: bfloat16
        bit patterns, decoded from the stored format; digest-verified."""
        ids, stored = self.read_stored(i)
        return (ids, *state_format.decode(stored, self.states))

    def describe(self) -> dict:
        return {"path": str(self.path), "samples": len(self), "tokens": self.n_tokens, **self.attrs}


def verify_store(path: Path, progress: bool = True) -> list[str]:
    """Re-hash every sample; return one message per bad sample, or per piece whose shard files are
    missing, naming the files and the samples they held (empty list: all match)."""
    from tqdm import tqdm

    try:
        store = HiddenStore(path)
    except EaglenestError as e:
        return [str(e)]
    except Exception as e:  # unreadable metadata or index
        return [f"{path}: unreadable store: {type(e).__name__}: {e}"]
    bad, pieces_missing = [], set()
    for i in tqdm(range(len(store)), desc=f"verify {store.part}", unit="sample", disable=not progress):
        piece = store.index[i]["piece"]
        if piece in pieces_missing:
            continue  # already named with every sample it holds
        try:
            store.read_stored(i)
        except EaglenestError as e:
            missing = store.missing_files(piece)
            if missing:
                pieces_missing.add(piece)
                bad.append(f"store {store.part} ({path}): {missing_message(missing, store.samples_of_piece(piece))}")
            else:
                bad.append(str(e))
    return bad


def missing_message(files: list[Path], samples: list[str], show: int = 8) -> str:
    names = ", ".join(repr(s) for s in samples[:show])
    names += f", ... ({len(samples)} in all)" if len(samples) > show else ""
    return f"shard file{'s' if len(files) > 1 else ''} {', '.join(map(str, files))} missing: it held samples {names}"
