"""vLLM's hidden states on the real target under the gate: the first N samples of a tokenized part
extracted with `extract.backend: vllm` (a vLLM server from `.venv-vllm`), every one of them checked
by the gate against the float32 reference; optionally other backends on the same samples for the
throughput side by side (server options from params.yaml `extract.<backend>`).

    python -m bench.vllm_extract [--tokenized data/tokenized/sharegpt-000.parquet] [--samples 32]
                                 [--also hf,sglang] [--dtype bfloat16|float32] [--out FILE]

--dtype float32 compares the engines where bf16 has no hardware support (this AVX2-only box: bf16
matmuls are emulated and measure the emulation, not the engine). Writes bench/results/vllm_extract.json.
"""

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import yaml

from eaglenest.extraction.backends import make_backend
from eaglenest.extraction.loop import GateFailed, extract_part
from eaglenest.target.directory import load_target
from eaglenest.target.taps import resolve_taps


def run(backend_name: str, target, tokenized: Path, taps, validate: dict, work: Path, dtype: str) -> dict:
    options = yaml.safe_load(Path("params.yaml").read_text())["extract"].get(backend_name) or {}
    if backend_name == "hf":
        options = {**options, "compile": False}
    backend = make_backend(backend_name, target=target, taps=taps, dtype=dtype, device="cpu", **options)
    t = time.time()
    try:
        m = extract_part(part="bench", tokenized=tokenized, target=target, backend=backend, taps=taps,
                         dtype=dtype, revision=0,
                         layout_cfg=dict(chunk_mb=1, shard_mb=128, codec="zstd", level=1, states="bf16"),
                         validate_cfg=validate, out_dir=work / backend_name, work_root=work / "work",
                         batch_tokens=4096, max_seq_len=4096, progress=False)  # fmt: skip
    except GateFailed as e:
        m = e.metrics
    finally:
        backend.close()
    v = m["validation"]
    startup = sum(m["fixed_cost"].get(k, 0) for k in ("load_s", "warm_up_s"))
    return {
        "backend_version": backend.describe()["version"],
        "gate_passed": v["passed"],
        "failures": v["failures"],
        "per_tap": v["taps"],
        "samples_checked": len(v["sample_ids"]),
        "tokens": m.get("tokens"),
        "tokens_per_s": m.get("tokens_per_s"),  # server start or model load included
        # the forward loop alone: extract_seconds less the server start / model load (fixed_cost)
        "forward_tokens_per_s": round(m["tokens_extracted_now"] / (m["extract_seconds"] - startup), 1),
        "fixed_cost": m.get("fixed_cost"),
        "extract_seconds": m.get("extract_seconds"),
        "gate_seconds": v.get("seconds"),
        "wall_s": round(time.time() - t, 1),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenized", type=Path, default=Path("data/tokenized/sharegpt-000.parquet"))
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--also", default="", help="other backends on the same samples, e.g. hf,sglang")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", type=Path, default=Path("bench/results/vllm_extract.json"))
    a = ap.parse_args()
    target = load_target(Path("data/target"))
    taps = resolve_taps("auto", target.num_layers)
    validate = {**yaml.safe_load(Path("params.yaml").read_text())["validate"], "samples": a.samples}
    work = Path(tempfile.mkdtemp(prefix="vllm-extract-"))
    try:
        table = pq.read_table(a.tokenized).slice(0, a.samples)
        pq.write_table(table, work / "part.parquet")
        res = {"target": target.spec, "tokenized": str(a.tokenized), "samples": table.num_rows, "dtype": a.dtype,
               "thresholds": {k: v for k, v in validate.items() if k.startswith(("min_", "max_"))}}  # fmt: skip
        for name in ["vllm", *filter(None, a.also.split(","))]:
            # every sample through the gate for vLLM's states; the others are here for their speed
            gate = validate if name == "vllm" else {**validate, "samples": 4}
            res[name] = run(name, target, work / "part.parquet", taps, gate, work, a.dtype)
            print(name, json.dumps({k: v for k, v in res[name].items() if k != "per_tap"}), flush=True)
        res.update(gate_passed=res["vllm"]["gate_passed"], per_tap=res["vllm"]["per_tap"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
