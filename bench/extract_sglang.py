"""sglang vs hf extraction backend on this CPU (issue: SGLang backend). Not a test.

    python -m bench.extract_sglang [--tokens 40000] [--concurrency 8 16]

Uses data/target and the first tokenized part from `dvc repro`, and .venv-sglang (`make sglang-env`).
Both backends run the same subset in bf16: forward-only tokens/s (backend.extract over length
batches, nothing stored) and end to end through `extract_part` (zstd store + validation gate).
The sglang server is launched once by the backend (startup time reported apart) with the flags
printed in the output."""

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import yaml

from eaglenest.extraction.backends.hf import HFBackend
from eaglenest.extraction.backends.sglang_client import SGLangBackend
from eaglenest.extraction.loop import extract_part
from eaglenest.extraction.plan import batch_tokens_for, length_batches
from eaglenest.taps import resolve_taps
from eaglenest.target import load_target
from stages import _params

from .extract_cpu import OUT, subset


def forward_only(backend, seqs, batch_tokens) -> float:
    lengths = [len(s) for s in seqs]
    t = time.time()
    for b in length_batches(range(len(seqs)), lengths, batch_tokens):
        backend.extract([seqs[i] for i in b])
    return sum(lengths) / (time.time() - t)


def end_to_end(backend, sub, target, taps, params, batch_tokens) -> dict:
    shutil.rmtree(OUT / "store", ignore_errors=True)
    shutil.rmtree(OUT / "work", ignore_errors=True)
    st = params["store"]
    m = extract_part(
        part="bench",
        tokenized=sub,
        target=target,
        backend=backend,
        taps=taps,
        dtype="bfloat16",
        revision=0,
        layout_cfg={k: st[k] for k in ("chunk_mb", "shard_mb", "codec", "level")},
        validate_cfg={**_params.load("validate"), "samples": 4},
        out_dir=OUT / "store",
        work_root=OUT / "work",
        batch_tokens=batch_tokens,
        max_seq_len=int(params["tokenize"]["max_seq_len"]),
        progress=False,
    )
    v = m["validation"]["taps"]
    return {
        "end_to_end_tok_s": m["tokens_per_s"],
        "gate_passed": m["validation"]["passed"],
        "gate_min_cosine_mean": min(x["cosine_mean"] for x in v.values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=40000)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 16])
    args = ap.parse_args()
    params = yaml.safe_load(Path("params.yaml").read_text())
    OUT.mkdir(parents=True, exist_ok=True)
    target = load_target(Path("data/target"))
    taps = resolve_taps(params["extract"]["taps"], target.num_layers)
    sub = subset(Path(f"data/tokenized/{params['data']['parts'][0]}.parquet"), args.tokens)
    seqs = [np.asarray(x, dtype=np.int32) for x in pq.read_table(sub).column("input_ids").to_pylist()]
    bt = batch_tokens_for(params["extract"]["batch_tokens"], "cpu")
    res = {"tokens": int(sum(map(len, seqs))), "samples": len(seqs), "batch_tokens": bt}

    hf = HFBackend(target, taps, dtype="bfloat16", device="cpu")
    hf.extract([seqs[0]])
    res["hf"] = {
        "forward_only_tok_s": round(forward_only(hf, seqs, bt), 1),
        **end_to_end(hf, sub, target, taps, params, bt),
    }
    hf.close()

    for c in args.concurrency:
        sg = SGLangBackend(target, taps, dtype="bfloat16", device="cpu", concurrency=c)
        t = time.time()
        sg.extract([seqs[0]])  # launches the server, waits until ready, warms up
        startup = time.time() - t
        # every length batch goes out as concurrent requests: a batch must hold >= c samples to fill the server
        sbt = max(bt, c * 512)
        res[f"sglang_c{c}"] = {
            "server_startup_s": round(startup, 1),
            "batch_tokens": sbt,
            "forward_only_tok_s": round(forward_only(sg, seqs, sbt), 1),
            **end_to_end(sg, sub, target, taps, params, sbt),
            "server_cmd": " ".join(sg.server.cmd[1:]),
        }
        sg.close()
    for k, v in res.items():
        if isinstance(v, dict) and k != "hf":
            v["vs_hf_forward"] = round(v["forward_only_tok_s"] / res["hf"]["forward_only_tok_s"], 3)
    print(json.dumps(res, indent=2))
    (OUT / "extract_sglang.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
