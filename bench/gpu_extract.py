"""The extract stage's own wall clock on a GPU, the way `dvc repro extract@<part>` runs it: a fresh
`python -m stages.extract <part>` process per part, the product's defaults, a cold compile cache for
the first part. Writes its run into bench/results/gpu_extract.json as `runs[<defaults | the -S
settings>]`, keeping the other runs there.

    python -m bench.gpu_extract [--tokens 2600000] [--parts 4] [--layers 32] [--gate-samples 1,8,32]
                                [--workdir ~/gpu_extract] [--out bench/results/gpu_extract.json]
                                [--budget SECONDS] [--dvc-repro | --only-dvc-repro] [--checksum-jobs N]
                                [-S section.key=value ...]

Builds once, in --workdir: a Llama-3.1-8B-shaped target with random bf16 weights
(`bench.gpu.llama8b`; --layers fewer for a quick run), fingerprinted as the `target` stage does;
--parts random-token parts of --tokens tokens each (lengths 128..2048); a stage workspace with the
repository's params.yaml (CUDA, max_seq_len 2048). Then per part: the stage in a fresh process,
timed from outside, and its report's `fixed_cost` (imports, fingerprint, prepare, load, warm-up,
gate, publish). Wall MFU = 2 x params x tokens / wall / peak, with the short bf16 matmul peak
measured in the same run (`bench.gpu.matmul_peak`); steady MFU the same over the forward loop alone.
Last, the gate's cost against validate.samples, on the last part's store; with --dvc-repro, then
`dvc repro extract` over the same parts in a DVC project of its own (`dvc_repro`: its wall clock
against the stages' own, i.e. what DVC adds), where every part's store stays; --only-dvc-repro skips
the per-part runs and the gate's cost; --checksum-jobs N sets that project's core.checksum_jobs.

Disk: a part's store takes ~4 states x hidden x 2 bytes per token (32 KiB for the 8B shape: 85 GB for
2.6M tokens, before zstd), so each part's store is deleted once measured (the last one kept for the
gate), and the run refuses to start a part that cannot fit on the disk. Resumable: finished parts
are kept in --workdir (partial.json); with --budget, no part starts that the budget cannot finish, and
the same command continues it. Runs on the CPU too, to check the harness, not for figures:
--device cpu --layers 3 --tokens 6000 -S 'extract.taps=[0,1,2]' (auto taps need 8+ layers)."""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

from eaglenest.profile import apply_sets

REPO = Path(__file__).resolve().parents[1]


def build_target(model_dir: Path, layers: int, small: bool) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.gpu import llama8b

    if (model_dir / "config.json").exists():
        return
    cfg = llama8b(layers)
    if small:  # the harness check on a CPU
        cfg = LlamaConfig(**{**cfg.to_dict(), "hidden_size": 256, "intermediate_size": 512, "vocab_size": 32000})
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(model_dir)
    del model


def write_parts(ws: Path, parts: list[str], tokens: int, vocab: int) -> None:
    from eaglenest.data.chat import token_table, write_tokenized

    for k, part in enumerate(parts):
        path = ws / "data" / "tokenized" / f"{part}.parquet"
        if path.exists():
            continue
        rng, seqs, n = np.random.default_rng(k), [], 0
        while n < tokens:
            seqs.append(rng.integers(0, vocab, int(rng.integers(128, 2049))))
            n += len(seqs[-1])
        write_tokenized(token_table(seqs, [f"{part}-{i}" for i in range(len(seqs))]), path)


def tag(sets: list[str]) -> str:
    """A file-name-safe name for a set of overrides (letters, digits, '.', '_', '-')."""
    return "__".join("".join(c if c.isalnum() or c in "._" else "-" for c in x) for x in sets)


SUMMARY = (
    "target",
    "device",
    "peak_tflops",
    "part_tokens",
    "wall_mfu",
    "fixed_s",
    "steady_mfu_defaults",
    "gate_by_samples",
)


def record(out: Path, sets: list[str], res: dict) -> None:
    """This setting's results as `runs[<defaults | tag(sets)>]` of the results file, beside the
    runs already there (earlier settings, earlier dates); the top-level summary keys are the
    defaults run's."""
    doc = json.loads(out.read_text()) if out.exists() else {}
    doc.setdefault("runs", {})[tag(sets) if sets else "defaults"] = res
    if not sets:
        doc.update({k: res[k] for k in SUMMARY if k in res})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")


def workspace(root: Path, args, name: str | None = None) -> tuple[Path, dict]:
    from eaglenest.target.directory import materialize

    model_dir = root / "model"
    build_target(model_dir, args.layers, small=args.device == "cpu")
    ws = root / (name or ("ws-" + tag(args.sets) if args.sets else "ws"))  # the target is built once per workdir
    if not (ws / "data" / "target" / "target.json").exists():
        # the `target` stage: fingerprint once, recording the digests for the extract stage's check
        materialize(str(model_dir), ws / "data" / "target", digests=ws / ".eaglenest" / "digests.json")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["tokenize"]["max_seq_len"] = 2048
    params["extract"]["device"] = args.device
    (ws / "params.yaml").write_text(yaml.safe_dump(params))
    apply_sets(args.sets, ws / "params.yaml", ws / "set.yaml")  # -S section.key=value, e.g. extract.batch_tokens=65536
    cfg = json.loads((model_dir / "config.json").read_text())
    return ws, cfg


def n_params(cfg: dict) -> float:
    """Matmul parameters a token meets in the decoder stack (no lm_head: extraction never runs it)."""
    H, inter, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = H * cfg["num_key_value_heads"] // cfg["num_attention_heads"]
    return L * (2 * H * H + 2 * H * kv + 3 * H * inter)


def run_part(ws: Path, part: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    t = time.time()
    p = subprocess.run([sys.executable, "-m", "stages.extract", part, "--no-progress"], cwd=ws, env=env,
                       capture_output=True, text=True)  # fmt: skip
    outside_s = time.time() - t
    (ws / "logs").mkdir(exist_ok=True)
    (ws / "logs" / f"{part}.log").write_text(p.stderr)  # the stage's log, for a reader of the figures
    if p.returncode != 0:
        sys.exit(f"extract {part} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    rep = part_figures(ws, part)
    rep["outside_wall_s"] = round(outside_s, 2)
    return rep


def part_figures(ws: Path, part: str) -> dict:
    """A part's report and its timing (stages/_figures.py split them) as one dict again."""

    def merge(a: dict, b: dict) -> dict:
        return {**a, **{k: merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
                        for k, v in b.items()}}  # fmt: skip

    read = lambda *p: json.loads(Path(ws, "reports", *p, "extract", f"{part}.json").read_text())
    return merge(read(), read("timing"))


def state_bytes_per_token(cfg: dict) -> int:
    """bf16 bytes a token takes in the store before compression: three taps and the final state."""
    return 4 * cfg["hidden_size"] * 2


def check_disk(ws: Path, tokens: int, cfg: dict) -> None:
    need = tokens * state_bytes_per_token(cfg)
    free = shutil.disk_usage(ws).free
    if need > free:
        sys.exit(
            f"{tokens:,} tokens need up to {need / 1e9:.0f} GB of store (bf16, before zstd) and "
            f"{ws} has {free / 1e9:.0f} GB free: pass a smaller --tokens (or fewer --parts with --dvc-repro)"
        )


def gate_costs(ws: Path, part: str, samples: list[int], device: str) -> dict:
    """The gate alone on the part's store, as the stage runs it (`reference_process`): seconds against
    validate.samples -- the reference's load and its states (beside the extraction in the stage), the
    comparison (after it)."""
    from eaglenest.extraction.reference_process import ReferenceProcess, choose
    from eaglenest.store.hidden_store import HiddenStore
    from eaglenest.target.directory import load_target
    from eaglenest.target.taps import resolve_taps

    target = load_target(ws / "data" / "target")
    params = yaml.safe_load((ws / "params.yaml").read_text())
    taps = resolve_taps(params["extract"]["taps"], target.num_layers)  # the stage's own (-S may set them)
    store = HiddenStore(ws / "data" / "hidden" / part)
    thresholds = {k: v for k, v in params["validate"].items() if k not in ("samples", "seed")}
    out = {}
    for n in samples:
        t = time.time()
        ref = ReferenceProcess(target, taps, device, ws / "data" / "tokenized" / f"{part}.parquet",
                               choose(len(store), n, int(params["validate"]["seed"])))  # fmt: skip
        try:
            m, _ = ref.compare(store.path, thresholds)
        finally:
            ref.close()
        out[str(n)] = {"seconds": round(time.time() - t, 2), "reference_load_s": m["reference_load_s"],
                       "reference_states_s": m["reference_states_s"],
                       "compare_s": round(sum(m["seconds_by_step"].values()), 2), "tokens": m["tokens"]}  # fmt: skip
        print(f"gate, {n} samples: {out[str(n)]}", flush=True)
    return out


def dvc_repro(root: Path, args, parts: list[str], flops_per_token: float, peak: float | None) -> dict:
    """`dvc repro extract` over the parts, as a user runs it: a DVC project (no git) in
    root/dvc-ws holding the repository's `extract` stage (foreach over these parts), its params and
    cache settings, the same target and parts; DVC runs each part's stage in a fresh process, one
    after another, and hashes and caches each store. Returns the whole wall clock, each stage's own
    (its report's `wall_s`) and what DVC adds around them (hashing deps and outputs, its own start)."""
    jobs = args.checksum_jobs
    ws, cfg = workspace(root, args, name=f"dvc-ws-j{jobs}" if jobs else "dvc-ws")
    write_parts(ws, parts, args.tokens, cfg["vocab_size"])  # seeded: the per-part runs' very tokens
    stage = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["extract"]
    (ws / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"extract": stage}}, sort_keys=False))
    params = yaml.safe_load((ws / "params.yaml").read_text())
    params.setdefault("data", {})["parts"] = parts
    (ws / "params.yaml").write_text(yaml.safe_dump(params))
    if not (ws / "eaglenest").exists():  # the stage's code dependency (eaglenest/runtime/versions.py), this checkout's
        (ws / "eaglenest").symlink_to(REPO / "eaglenest")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}  # fmt: skip
    dvc = [sys.executable, "-m", "dvc"]
    if not (ws / ".dvc").exists():
        subprocess.run([*dvc, "init", "--no-scm", "-q"], cwd=ws, env=env, check=True)
        subprocess.run([*dvc, "config", "cache.type", "hardlink,symlink"], cwd=ws, env=env, check=True)
        if jobs:  # files md5-hashed at once (DVC's default: min(4, cores / 2))
            subprocess.run([*dvc, "config", "core.checksum_jobs", str(jobs)], cwd=ws, env=env, check=True)
    check_disk(ws, args.tokens * len(parts), cfg)  # every part's store stays: DVC's outputs
    t = time.time()
    p = subprocess.run([*dvc, "repro", "extract"], cwd=ws, env=env, capture_output=True, text=True)
    wall = time.time() - t
    (ws / "logs").mkdir(exist_ok=True)
    (ws / "logs" / "dvc_repro.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        sys.exit(f"dvc repro failed ({p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    reports = {part: part_figures(ws, part) for part in parts}
    stages_s = sum(r["wall_s"] for r in reports.values())
    tokens = sum(r["tokens"] for r in reports.values())
    out = {"checksum_jobs": jobs or "dvc default",
           "parts": len(parts), "tokens": tokens, "wall_s": round(wall, 2), "stages_wall_s": round(stages_s, 2),
           "dvc_overhead_s": round(wall - stages_s, 2), "per_part_wall_s": {k: r["wall_s"] for k, r in reports.items()},
           "per_part_fixed_s": {k: r["fixed_cost"]["total_s"] for k, r in reports.items()},
           "gates_passed": all(r["validation"]["passed"] for r in reports.values())}  # fmt: skip
    if peak:
        out["wall_mfu"] = round(flops_per_token * tokens / wall / peak, 3)
    print("dvc repro:", json.dumps(out), flush=True)
    return out


def profile_batches(ws: Path, part: str, n: int, device: str) -> dict:
    """The stage's first n batches of `part`, in this process, planned as the stage plans them (pieces,
    windows, length batches): per batch its rows, real and padded tokens, the host's time to launch it
    and to have its outputs on the host, and its GPU time (CUDA events around the launch); then the
    kernels of batches 2..n by family (`bench.gpu.kernel_profile`). Tells a per-batch host cost from
    GPU work, and padding from both."""
    import torch

    from bench.gpu import kernel_profile
    from eaglenest.extraction.backends import make_backend
    from eaglenest.extraction.plan import batch_tokens_for, plan_pieces, plan_windows, read_tokenized, window_batches
    from eaglenest.store.hidden_store import Layout
    from eaglenest.target.directory import load_target
    from eaglenest.target.taps import resolve_taps

    params = yaml.safe_load((ws / "params.yaml").read_text())
    ex, st = params["extract"], params["store"]
    target = load_target(ws / "data" / "target")
    taps = resolve_taps(ex["taps"], target.num_layers)
    be = make_backend("hf", target=target, device=device, taps=taps, dtype=ex["dtype"], states=st["states"],
                      **(ex["hf"] or {}))  # fmt: skip
    _, seqs = read_tokenized(ws / "data" / "tokenized" / f"{part}.parquet")
    lengths = [len(x) for x in seqs]
    store = {k: st[k] for k in ("chunk_mb", "shard_mb", "codec", "level", "states")}
    max_len = int(params["tokenize"]["max_seq_len"])
    layout = Layout.for_sizes(target.hidden_size, len(taps), max_seq_len=max_len, **store)
    bt = batch_tokens_for(ex["batch_tokens"], device)
    windows = plan_windows(plan_pieces(lengths, layout.shard_tokens), lengths, bt)
    batches = [b for w in windows for b in window_batches(w, lengths, bt)][:n]
    rows = []
    cuda = device.startswith("cuda")  # on the CPU (a harness check) the GPU columns stay empty

    def one(b):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else []
        t = time.perf_counter()
        events and events[0].record()
        wait = be.extract_async([seqs[i] for i in b])
        launch = time.perf_counter() - t
        events and events[1].record()
        wait()
        cuda and torch.cuda.synchronize()
        wall = time.perf_counter() - t
        rows.append({
            "rows": len(b),
            "real_tokens": sum(lengths[i] for i in b),
            "padded_tokens": len(b) * max(lengths[i] for i in b),
            "launch_ms": round(launch * 1e3, 1),
            "wall_ms": round(wall * 1e3, 1),
            "gpu_ms": round(events[0].elapsed_time(events[1]), 1) if cuda else None,
        })  # fmt: skip

    def rest():
        for b in batches[1:]:
            one(b)

    one(batches[0])  # the load and the compile warm-up land here
    res = {"part": part, "batch_tokens": bt, "shard_tokens": layout.shard_tokens, "batches": rows}
    if cuda:
        res["kernels"] = kernel_profile(rest)
    else:
        rest()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2_600_000, help="tokens per part (the seed's 21M over 8 GPUs)")
    ap.add_argument("--parts", type=int, default=4)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--gate-samples", default="1,8,32")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workdir", type=Path, default=Path.home() / "gpu_extract")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gpu_extract.json")
    ap.add_argument("--budget", type=float, default=None, help="seconds: start no part the budget cannot finish")
    ap.add_argument("--profile-batches", type=int, default=0,
                    help="then the first N batches of the first part in this process: per batch host and GPU "
                         "time, padding, and the kernels (profile_batches)")  # fmt: skip
    ap.add_argument("--dvc-repro", action="store_true",
                    help="then `dvc repro extract` over the same parts in a DVC project of its own (dvc_repro); "
                         "every part's store stays, so the disk must hold them all")  # fmt: skip
    ap.add_argument("--only-dvc-repro", action="store_true",
                    help="--dvc-repro without the per-part runs and the gate's cost before it")  # fmt: skip
    ap.add_argument("--checksum-jobs", type=int, default=0,
                    help="with --dvc-repro: the project's core.checksum_jobs (default: DVC's own)")  # fmt: skip
    ap.add_argument("-S", dest="sets", action="append", default=[],
                    help="section.key=value over the repository's params.yaml (e.g. extract.batch_tokens=65536); "
                         "each setting has its own workspace and results; the target is shared")  # fmt: skip
    a = ap.parse_args()
    t0 = time.time()
    sys.path.insert(0, str(REPO))
    ws, cfg = workspace(a.workdir, a)
    parts = [f"p{k}" for k in range(a.parts)]
    write_parts(ws, parts, a.tokens, cfg["vocab_size"])
    partial = a.workdir / (f"partial-{tag(a.sets)}.json" if a.sets else "partial.json")
    res = json.loads(partial.read_text()) if partial.exists() else None
    if res is None:
        peak = None
        if a.device.startswith("cuda"):
            from bench.gpu import matmul_peak

            peak = matmul_peak() / 1e12
        res = {"target": f"Llama-3.1-8B shape, {cfg['num_hidden_layers']} layers, random bf16 weights",
               "device": a.device, "params_set": a.sets, "peak_tflops": round(peak, 1) if peak else None,
               "parts": {}}  # fmt: skip
    peak = res["peak_tflops"] * 1e12 if res["peak_tflops"] else None
    flops_per_token = 2 * n_params(cfg)
    cache = a.workdir / "inductor-cache"
    if not res["parts"]:
        shutil.rmtree(cache, ignore_errors=True)  # the first part compiles from nothing, as on a fresh machine
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    if a.only_dvc_repro:
        a.dvc_repro = True
    for i, part in enumerate(parts):
        if part in res["parts"] or a.only_dvc_repro:
            continue
        longest = max((r["outside_wall_s"] for r in res["parts"].values()), default=0)
        if a.budget and time.time() - t0 + longest > a.budget:
            record(a.out, a.sets, res)
            sys.exit(f"budget: {part} would not finish in {a.budget:.0f} s; run the same command again to go on")
        for other in parts[:i]:  # measured: only the last part's store stays, for the gate
            shutil.rmtree(ws / "data" / "hidden" / other, ignore_errors=True)
        shutil.rmtree(ws / "data" / "hidden" / part, ignore_errors=True)
        check_disk(ws, a.tokens, cfg)
        rep = run_part(ws, part)
        fc = rep["fixed_cost"]
        row = {
            "tokens": rep["tokens"],
            "wall_s": rep["wall_s"],
            "outside_wall_s": rep["outside_wall_s"],
            "forward_s": rep["forward_s"],
            "fixed_s": fc["total_s"],
            "fixed_cost": fc,
            "tokens_per_s_wall": round(rep["tokens"] / rep["wall_s"], 1),
            "host_path": rep.get("host_path"),
            "gate_passed": rep["validation"]["passed"],
            "store_bytes": sum(f.stat().st_size for f in (ws / "data" / "hidden" / part).rglob("*") if f.is_file()),
        }
        if peak:
            row["wall_mfu"] = round(flops_per_token * rep["tokens"] / rep["wall_s"] / peak, 3)
            row["steady_mfu"] = round(flops_per_token * rep["tokens"] / rep["forward_s"] / peak, 3)
        res["parts"][part] = row
        partial.write_text(json.dumps(res, indent=1))
        print(part, json.dumps({k: v for k, v in row.items() if k != "host_path"}), flush=True)
    first = res["parts"].get(parts[0], {})
    res.update(
        part_tokens=first.get("tokens"),
        wall_mfu=first.get("wall_mfu"),  # cold compile cache, as a fresh machine runs it
        fixed_s=first.get("fixed_s"),
        steady_mfu_defaults=max((r.get("steady_mfu") or 0 for r in res["parts"].values()), default=0) or None,
        # the parts back to back, each a fresh stage process as `dvc repro` starts them
        parts_wall_s=round(sum(r["outside_wall_s"] for r in res["parts"].values()), 1),
    )
    if "gate_by_samples" not in res and not a.only_dvc_repro:
        res["gate_by_samples"] = gate_costs(ws, parts[-1], [int(x) for x in a.gate_samples.split(",")], a.device)
        partial.write_text(json.dumps(res, indent=1))
    key = f"dvc_repro_checksum_jobs_{a.checksum_jobs}" if a.checksum_jobs else "dvc_repro"
    if a.dvc_repro and key not in res:
        shutil.rmtree(ws / "data" / "hidden", ignore_errors=True)  # the gate's part: room for DVC's stores
        res[key] = dvc_repro(a.workdir, a, parts, flops_per_token, peak)
        partial.write_text(json.dumps(res, indent=1))
    if a.profile_batches and "batch_profile" not in res:
        res["batch_profile"] = profile_batches(ws, parts[0], a.profile_batches, a.device)
        partial.write_text(json.dumps(res, indent=1))
    record(a.out, a.sets, res)
    print(json.dumps({k: v for k, v in res.items() if k not in ("parts", "batch_profile")}, indent=1))


if __name__ == "__main__":
    main()
