"""Pieces of an extract part's fixed cost, each in a fresh process: the target's load (transformers'
`from_pretrained` against the hf backend's own layers and loader, `llama` + `hf_weights`), and the
own layer's cold compile with inductor's own account of its phases (`compile_times`), also under -E
settings (environment, e.g. TORCHINDUCTOR_COMPILE_THREADS=1). Run after `bench.gpu_extract` has built
its target (or pass --model); --device cpu checks the harness here (the compile only), not for figures.

    python -m bench.gpu_fixed_cost [--model ~/gpu_extract/model] [--only compile] [-E NAME=VALUE ...] [--out FILE]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEVICE = os.environ.get("FIXED_COST_DEVICE", "cuda")  # set by --device for the measuring processes


def load(model: Path, how: str) -> dict:
    import torch

    from eaglenest.extraction.backends import llama
    from eaglenest.extraction.backends.hf_weights import copy_weights, plan_copy
    from eaglenest.target import load_model, materialize

    t = time.perf_counter()
    if how == "transformers":
        target = materialize(str(model), Path(tempfile.mkdtemp()) / "target")
        t = time.perf_counter()
        load_model(target, dtype="bfloat16", device="cuda")
        return {"load_s": round(time.perf_counter() - t, 2)}
    torch.empty(1, device="cuda")
    cuda = time.perf_counter() - t
    spec = llama.plan(model)
    weights = llama.allocate(spec, torch.bfloat16, "cuda")
    built = time.perf_counter() - t
    n = copy_weights(plan_copy(model, weights), "cuda")
    s = time.perf_counter() - t
    return {"load_s": round(s, 2), "cuda_init_s": round(cuda, 2), "build_s": round(built - cuda, 2),
            "GB_per_s": round(n / 1e9 / (s - built), 1)}  # fmt: skip


def compile_layer(model: Path) -> dict:
    """The own layer of the target's shape compiled as the backend compiles it (`LayerCompile`, here
    awaited at once), cold cache, with inductor's account of its phases."""
    import dataclasses

    import torch
    from torch._dynamo.utils import compile_times

    from eaglenest.extraction.backends import llama
    from eaglenest.extraction.backends.hf_compile import LayerCompile

    t0 = time.perf_counter()
    spec = dataclasses.replace(llama.plan(model), layers=1)
    dec = llama.Decoder(spec, llama.allocate(spec, torch.bfloat16, DEVICE))
    built = time.perf_counter() - t0
    t = time.perf_counter()
    job = LayerCompile(dec, DEVICE)
    job.wait()
    first = time.perf_counter() - t
    rows = [ln.split() for ln in compile_times(repr="str", aggregate=True).splitlines()]
    phases = {r[0]: float(r[-1]) for r in rows if len(r) >= 2 and r[-1].replace(".", "", 1).isdigit()}
    top = dict(sorted(phases.items(), key=lambda x: -x[1])[:16])  # nested phases: they overlap
    return {"build_s": round(built, 2), "compile_s": round(first, 2), "phases": top}


MEASURES = {"transformers": "load_transformers", "own": "load_own", "compile": "compile_default"}


def child(what: str, model: Path) -> None:
    out = load(model, what) if what in ("transformers", "own") else compile_layer(model)
    print("RESULT " + json.dumps(out), flush=True)


def run(model: Path, what: str, env: dict, device: str) -> dict:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, **env, "PYTHONPATH": path, "FIXED_COST_DEVICE": device}
    env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()  # cold, as on a fresh machine
    t = time.time()
    p = subprocess.run([sys.executable, "-m", "bench.gpu_fixed_cost", "--child", what, "--model", str(model)],
                       env=env, capture_output=True, text=True)  # fmt: skip
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        return {"error": p.stderr[-2000:]}
    return {**json.loads(lines[-1][7:]), "process_s": round(time.time() - t, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path.home() / "gpu_extract" / "model")
    ap.add_argument("--only", choices=sorted(MEASURES), help="this one alone (default: both loads, the compile)")
    ap.add_argument("--device", default="cuda", help="cpu: the compile only, to check the harness")
    ap.add_argument("-E", dest="envs", action="append", default=[], help="NAME=VALUE for more compile runs")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.model)
    if a.only:
        todo = [a.only]
    else:
        todo = ["transformers", "own", "compile"] if a.device == "cuda" else ["compile"]
    res = {MEASURES[w]: run(a.model, w, {}, a.device) for w in todo}
    for e in a.envs:
        k, v = e.split("=", 1)
        res[f"compile_{k}={v}"] = run(a.model, "compile", {k: v}, a.device)
    print(json.dumps(res, indent=1))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
