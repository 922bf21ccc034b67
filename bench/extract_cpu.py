"""CPU extraction benchmark. Not a test: records figures in bench/RESULTS.md.

    python -m bench.extract_cpu [--tokens 40000] [--noop-repro]

Uses data/target and data/tokenized/<first part>.parquet from `dvc repro` (run it first).
Measures: forward-only tokens/s of the hf backend; end-to-end extraction tokens/s (forward +
bf16 bits + digest + zstd/none + zarr write + fsync) with MB/s written, bytes/token and
compression ratio per codec; and the wall time of a no-op `dvc repro`.
"""

import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import yaml

from eaglenest.extraction.backends.hf import HFBackend
from eaglenest.extraction.loop import extract_part
from eaglenest.extraction.plan import batch_tokens_for, length_batches
from eaglenest.target.directory import load_target
from eaglenest.target.taps import resolve_taps
from stages import _params

OUT = Path("bench/out")


def subset(parquet: Path, tokens: int) -> Path:
    t = pq.read_table(parquet)
    n, total = 0, 0
    for L in t.column("n_tokens").to_pylist():
        if total >= tokens:
            break
        n, total = n + 1, total + L
    path = OUT / "subset.parquet"
    pq.write_table(t.slice(0, n), path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=40000)
    ap.add_argument("--noop-repro", action="store_true", help="also time a no-op `dvc repro` (3 runs, min)")
    args = ap.parse_args()
    params = yaml.safe_load(Path("params.yaml").read_text())
    part = params["data"]["parts"][0]
    OUT.mkdir(parents=True, exist_ok=True)
    target = load_target(Path("data/target"))
    taps = resolve_taps(params["extract"]["taps"], target.num_layers)
    sub = subset(Path(f"data/tokenized/{part}.parquet"), args.tokens)
    seqs = [__import__("numpy").asarray(x, dtype="int32") for x in pq.read_table(sub).column("input_ids").to_pylist()]
    lengths = [len(s) for s in seqs]
    bt = batch_tokens_for(params["extract"]["batch_tokens"], "cpu")
    be = HFBackend(target, taps, dtype="bfloat16", device="cpu")
    be.extract([seqs[0]])  # load + warm up
    t = time.time()
    for b in length_batches(range(len(seqs)), lengths, bt):
        be.extract([seqs[i] for i in b])
    fwd = sum(lengths) / (time.time() - t)
    results = {"tokens": sum(lengths), "samples": len(seqs), "batch_tokens": bt, "forward_only_tok_s": round(fwd, 1)}
    for codec in ("zstd", "none"):
        shutil.rmtree(OUT / "store", ignore_errors=True)
        shutil.rmtree(OUT / "work", ignore_errors=True)
        st = params["store"]
        m = extract_part(
            part="bench",
            tokenized=sub,
            target=target,
            backend=be,
            taps=taps,
            dtype="bfloat16",
            revision=0,
            layout_cfg=dict(chunk_mb=st["chunk_mb"], shard_mb=st["shard_mb"], codec=codec, level=st["level"]),
            validate_cfg={**_params.load("validate"), "samples": 2},
            out_dir=OUT / "store",
            work_root=OUT / "work",
            batch_tokens=bt,
            max_seq_len=int(params["tokenize"]["max_seq_len"]),
            progress=False,
        )
        results[codec] = {
            "end_to_end_tok_s": m["tokens_per_s"],
            "bytes_per_token": m["bytes_per_token"],
            "compression_ratio": m["compression_ratio"],
            "written_MB_s": round(m["stored_bytes"] / m["extract_seconds"] / 1e6, 2),
            "overhead_vs_forward": round(1 - m["tokens_per_s"] / fwd, 3),
        }
    if args.noop_repro:
        times = []
        for _ in range(3):
            t = time.time()
            out = subprocess.run(["dvc", "repro"], capture_output=True, text=True, check=True).stdout
            times.append(time.time() - t)
            assert "Running stage" not in out, "repro was not a no-op: run `dvc repro` first"
        results["noop_dvc_repro_s"] = round(min(times), 2)
        t = time.time()
        subprocess.run(["dvc", "status"], capture_output=True, check=True)
        results["dvc_status_s"] = round(time.time() - t, 2)
    print(json.dumps(results, indent=2))
    (OUT / "extract_cpu.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
