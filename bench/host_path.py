"""The extraction host path, one phase at a time, on this host's cores and disk (issue: GPU
performance). Finds the phase that bounds `extract` when the GPU outruns the store:

    python -m bench.host_path [--dir DIR] [--pieces 8] [--processes 1 2 4 6 8] [--hidden 4096]

Per core: fill copy (numpy into a touched buffer), sample digest (xxh3), shard encode (none, zstd-1),
crc32c. Disk: a piece's bytes written + fsynced by P processes at once (aggregate GB/s), the same
without fsync, one O_DIRECT stream. Then `write_piece` itself (digest + encode + write + fsync) in
P writer processes over shared memory, and `extract`'s PieceWriter around it (hand-over to the
processes + the manifest's durable commit, reported as piece_s minus the measured phases). Pieces
are 8B-shaped (3 taps + final x 4096, 256 MB shards) of random-normal bf16 states, which zstd-1
shrinks about as much as real states. Writes bench/out/host_path.json (BENCH_OUT overrides the
directory)."""

import argparse
import json
import mmap
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from eaglenest.hashing import content_digest
from eaglenest.store.hidden_store import Layout
from eaglenest.store.piece_buffers import BufferPool
from eaglenest.store.shard_writer import crc32c, encode_shard, write_piece_shared

OUT = Path(os.environ.get("BENCH_OUT", "bench/out"))


def rate(nbytes: int, fn, reps: int = 3) -> float:
    """GB/s of the best of `reps` runs of fn()."""
    best = min(_timed(fn) for _ in range(reps))
    return round(nbytes / best / 1e9, 2)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def states(layout: Layout, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    S, A, H = layout.shard_tokens, layout.n_aux, layout.hidden
    bits = lambda shape: (rng.standard_normal(shape, dtype=np.float32) * 0.7).view(np.uint32) >> 16  # noqa: E731
    return {
        "input_ids": rng.integers(0, 128000, S, dtype=np.int32),
        "aux": bits((S, A, H)).astype(np.uint16),
        "final": bits((S, H)).astype(np.uint16),
    }


def per_core(layout: Layout, a: dict) -> dict:
    aux = a["aux"]
    dst = np.empty_like(aux)
    dst[:] = 1  # touched: the pool reuses buffers
    out = {
        "fill_copy_GB_s": rate(aux.nbytes, lambda: np.copyto(dst, aux)),
        "digest_xxh3_GB_s": rate(aux.nbytes, lambda: content_digest(aux)),
        "crc32c_GB_s": rate(aux.nbytes, lambda: crc32c(aux)),
    }
    for codec in ("none", "zstd"):
        parts = encode_shard(aux, layout.chunk_tokens, codec, 1, 0)
        out[f"encode_{codec}_GB_s"] = rate(
            aux.nbytes, lambda codec=codec: encode_shard(aux, layout.chunk_tokens, codec, 1, 0)
        )
        out[f"encode_{codec}_ratio"] = round(aux.nbytes / sum(len(memoryview(p).cast("B")) for p in parts), 3)
    return out


def _write(path: str, blob_size: int, files: int, fsync: bool, direct: bool) -> None:
    """One process: `files` files of blob_size bytes, each fsynced (or not)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    if direct:  # O_DIRECT wants an aligned buffer and whole blocks
        blob_size = -(-blob_size // 4096) * 4096
        buf = mmap.mmap(-1, 64 << 20)
        buf.write(np.random.default_rng(1).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes())
        blob = memoryview(buf)
    else:
        blob = memoryview(np.random.default_rng(1).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes())
    for k in range(files):
        fd = os.open(f"{path}.{k}", flags, 0o644)
        left = blob_size
        while left > 0:
            left -= os.write(fd, blob[: min(left, len(blob))])
        if fsync:
            os.fsync(fd)
        os.close(fd)


def disk(root: Path, blob_size: int, pieces: int, procs: list[int]) -> dict:
    out = {}
    for name, fsync, direct, plist in (
        ("write_fsync", True, False, procs),
        ("write_no_fsync", False, False, [1, 4]),
        ("write_odirect", True, True, [1, 2]),
    ):
        for p in plist:
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            per = max(1, pieces // p)
            with ProcessPoolExecutor(p) as ex:
                list(ex.map(int, range(p)))  # started
                t = time.perf_counter()
                for f in [ex.submit(_write, str(root / f"w{i}"), blob_size, per, fsync, direct) for i in range(p)]:
                    f.result()
                if not fsync:
                    os.sync()
                dt = time.perf_counter() - t
            out[f"{name}_p{p}_GB_s"] = round(p * per * blob_size / dt / 1e9, 2)
            print(name, p, out[f"{name}_p{p}_GB_s"], flush=True)
    shutil.rmtree(root, ignore_errors=True)
    return out


def _filled_buffers(pool: BufferPool, a: dict, n: int) -> list:
    """n pooled piece buffers holding the sample piece (pooled buffers stay touched, as in extract)."""
    bufs = [pool.get() for _ in range(n)]
    for b in bufs:
        for k, v in a.items():
            b.arrays[k][:] = v
    return bufs


def writers(root: Path, layout: Layout, a: dict, pieces: int, procs: list[int]) -> dict:
    """`write_piece` in P processes over shared memory, as `extract` runs it."""
    import zarr

    from eaglenest.store.hidden_store import create_arrays

    S = layout.shard_tokens
    rows = [{"start": 0, "length": S}]
    out = {}
    for codec in ("none", "zstd"):
        lay = Layout(layout.hidden, layout.n_aux, layout.chunk_tokens, S, codec, 1)
        for p in procs:
            shutil.rmtree(root, ignore_errors=True)
            create_arrays(zarr.open_group(str(root), mode="w"), lay, pieces)
            pool = BufferPool(lay, shared=True)
            bufs = _filled_buffers(pool, a, p)
            with ProcessPoolExecutor(p) as ex:
                for b in bufs:  # map each buffer once, as pooled buffers stay mapped
                    ex.submit(write_piece_shared, str(root / "warm"), 0, lay, b.spec, []).result()
                t = time.perf_counter()
                futs = [
                    ex.submit(
                        write_piece_shared, str(root), i, lay, bufs[i % p].spec, [dict(r, start=i * S) for r in rows]
                    )
                    for i in range(pieces)
                ]
                phases = [f.result()[2] for f in futs]
                dt = time.perf_counter() - t
            pool.close()
            nbytes = pieces * sum(v.nbytes for v in a.values())
            tot = {k: round(sum(ph[k] for ph in phases), 2) for k in phases[0]}
            out[f"write_piece_{codec}_p{p}"] = {
                "GB_s": round(nbytes / dt / 1e9, 2),
                "tok_s": round(pieces * S / dt, 1),
                "seconds_summed": tot,
            }
            print(codec, p, out[f"write_piece_{codec}_p{p}"], flush=True)
    shutil.rmtree(root, ignore_errors=True)
    return out


class _Filled:
    """A piece whose buffers are already filled: what `extract` hands its writer, minus the copies."""

    def __init__(self, index: int, bufs, S: int):
        self.piece, self.bufs = SimpleNamespace(index=index), bufs
        self.rows = [{"id": f"s{index}", "key": f"k{index}", "start": index * S, "length": S, "piece": index}]

    def finish(self):
        return self.rows, 0.0

    def settle(self):
        pass


def piece_writer(root: Path, layout: Layout, a: dict, pieces: int, procs: list[int]) -> dict:
    """`extract`'s own PieceWriter (hand-over to writer processes + write_piece + the manifest's
    durable commit): piece_s minus the measured phases is what the hand-over and commit cost."""
    import zarr

    from eaglenest.extraction.work_dir import WorkDir
    from eaglenest.extraction.writers import PieceWriter
    from eaglenest.store.hidden_store import create_arrays

    S, out = layout.shard_tokens, {}
    for codec in ("none", "zstd"):
        lay = Layout(layout.hidden, layout.n_aux, layout.chunk_tokens, S, codec, 1)
        for p in procs:
            shutil.rmtree(root, ignore_errors=True)
            work = WorkDir(root, "bench", "0" * 20)
            create_arrays(zarr.open_group(str(work.store), mode="w"), lay, pieces)
            writer = PieceWriter(work, lay, workers=p, processes=p > 1)
            pool = BufferPool(lay, shared=writer.shared)
            for b in _filled_buffers(pool, a, 3 * p + 2):  # enough for the queue (2p) + in flight (p)
                b.release()
            t = time.perf_counter()
            for i in range(pieces):
                writer.put(_Filled(i, pool.get(), S))
            writer.close()
            dt = time.perf_counter() - t
            pool.close()
            sec = {k: round(v, 2) for k, v in writer.seconds.items()}
            sec["handover_and_commit_s"] = round(sec["piece_s"] - sec["digest_s"] - sec["encode_s"] - sec["write_s"], 2)
            nbytes = pieces * sum(v.nbytes for v in a.values())
            out[f"piece_writer_{codec}_p{p}"] = {
                "GB_s": round(nbytes / dt / 1e9, 2),
                "tok_s": round(pieces * S / dt, 1),
                "seconds_summed": sec,
            }
            print(codec, p, out[f"piece_writer_{codec}_p{p}"], flush=True)
    shutil.rmtree(root, ignore_errors=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=OUT / "host_path_tmp", help="scratch directory on the disk under test")
    ap.add_argument("--pieces", type=int, default=8, help="pieces written per configuration")
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4, 6, 8])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--skip-disk", action="store_true")
    args = ap.parse_args()
    layout = Layout.for_sizes(args.hidden, 3, max_seq_len=2048, chunk_mb=1, shard_mb=256, codec="none", level=1)
    a = states(layout)
    piece_bytes = sum(v.nbytes for v in a.values())
    res = {
        "cpus": os.cpu_count(),
        "piece_MB": round(piece_bytes / 1e6, 1),
        "shard_tokens": layout.shard_tokens,
        "bytes_per_token": piece_bytes // layout.shard_tokens,
    }
    res["per_core"] = per_core(layout, a)
    print(json.dumps(res), flush=True)
    if not args.skip_disk:
        res["disk"] = disk(args.dir, int(res["piece_MB"] * 1e6), args.pieces, args.processes)
    res["write_piece"] = writers(args.dir, layout, a, args.pieces, args.processes)
    res["piece_writer"] = piece_writer(args.dir, layout, a, args.pieces, args.processes)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "host_path.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
