"""A sample's read from a store in one process, as the training loader's processes and the teacher
stage read: `HiddenStore.read_stored` (digest-checked), through eaglenest's shard reader and through
zarr, every sample of each store in a shuffled order, after checking that both give the same bytes.
Not a test.

    python -m bench.store_reads [--stores data/hidden/sharegpt-000 ...] [--fp8-of sharegpt-000]

--stores: default every store under data/hidden (the CPU default's: bf16 states, zstd), after
`make repro`. --fp8-of PART: also that part in the GPU profile's store format (fp8 states, codec
none), extracted by the extract stage (`store.states: fp8`, `store.codec: none`, the rest of
params.yaml) in a scratch directory from this checkout's target and tokenized part (~40 s on the
CPU), removed afterwards. Best of --passes timed passes each way, the page cache warm. JSON:
bench/results/store_reads.json.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from eaglenest.runtime.made_on import made_on
from eaglenest.store.hidden_store import HiddenStore

REPO = Path(__file__).resolve().parents[1]


def fp8_store(part: str, scratch: Path) -> Path:
    """`part` extracted again by the extract stage with fp8 states and no codec, in `scratch`."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["store"].update(states="fp8", codec="none")
    (scratch / "data/tokenized").mkdir(parents=True)
    (scratch / ".eaglenest").mkdir()
    (scratch / "params.yaml").write_text(yaml.safe_dump(params))
    (scratch / "data/target").symlink_to(REPO / "data/target")
    tokenized = REPO / f"data/tokenized/{part}.parquet"
    if not tokenized.is_file():
        sys.exit(f"{tokenized}: not found (run `make repro` first)")
    (scratch / f"data/tokenized/{part}.parquet").symlink_to(tokenized)
    (scratch / ".eaglenest/digests.json").write_bytes((REPO / ".eaglenest/digests.json").read_bytes())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "stages.extract", part, "--no-progress"]
    subprocess.run(cmd, cwd=scratch, env=env, check=True)
    return scratch / "data/hidden" / part


def passes(store: HiddenStore, order: list[int], n: int) -> float:
    """The best of n passes over `order`, seconds."""
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        for i in order:
            store.read_stored(i)
        best = min(best, time.perf_counter() - t)
    return best


def measure(path: Path, n: int) -> dict:
    store = HiddenStore(path)
    if not all(store.readers.values()):
        sys.exit(f"{path}: a layout the shard reader does not read ({store.readers})")
    order = np.random.default_rng(0).permutation(len(store)).tolist()
    readers = store.readers
    for i in order:  # the same bytes both ways (and the page cache warm)
        ours = store.read_stored(i)
        store.readers = dict.fromkeys(readers)
        theirs = store.read_stored(i)
        store.readers = readers
        assert np.array_equal(ours[0], theirs[0]) and all(np.array_equal(v, theirs[1][k]) for k, v in ours[1].items())
    ours = passes(store, order, n)
    store.readers = dict.fromkeys(readers)
    theirs = passes(store, order, n)
    layout = store.attrs["layout"]
    tokens = store.n_tokens
    return {
        "store": str(path.relative_to(REPO) if path.is_relative_to(REPO) else path.name),
        "states": store.states,
        "codec": layout["codec"],
        "chunk_tokens": layout["chunk_tokens"],
        "samples": len(store),
        "tokens": tokens,
        "shard_reader": {"tok_s": round(tokens / ours), "ms_per_sample": round(ours / len(store) * 1e3, 3)},
        "zarr": {"tok_s": round(tokens / theirs), "ms_per_sample": round(theirs / len(store) * 1e3, 3)},
        "speedup": round(theirs / ours, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stores", nargs="*", type=Path, default=sorted((REPO / "data/hidden").glob("*/zarr.json")))
    ap.add_argument("--fp8-of", metavar="PART")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/store_reads.json")
    args = ap.parse_args()
    stores = [p.parent if p.name == "zarr.json" else p for p in args.stores]
    if not stores and not args.fp8_of:
        sys.exit("no store under data/hidden: run `make repro` first, or name --stores")
    rows = [measure(p.resolve(), args.passes) for p in stores]
    if args.fp8_of:
        with tempfile.TemporaryDirectory(prefix="store_reads-") as scratch:
            rows.append(measure(fp8_store(args.fp8_of, Path(scratch)), args.passes))
            rows[-1]["store"] = f"{args.fp8_of}, extracted again with store.states fp8, store.codec none"
    for r in rows:
        print(
            f"{r['store']}: {r['states']}/{r['codec']}, {r['samples']} samples, {r['tokens']} tokens: shard reader "
            f"{r['shard_reader']['tok_s'] / 1e3:.0f}k tok/s ({r['shard_reader']['ms_per_sample']} ms a sample), "
            f"zarr {r['zarr']['tok_s'] / 1e3:.0f}k ({r['zarr']['ms_per_sample']} ms): {r['speedup']}x"
        )
    out = {
        "command": "python -m bench.store_reads " + " ".join(sys.argv[1:]),
        "what": "HiddenStore.read_stored per process, digest-checked, every sample in a shuffled order, "
        f"best of {args.passes} passes, page cache warm",
        "made_on": made_on() | {"cores": os.cpu_count()},
        "date": time.strftime("%Y-%m-%d"),
        "stores": rows,
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
