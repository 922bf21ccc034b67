"""Stage `extract@<part>`: hidden states of a tokenized part into a validated Zarr store.

    python -m stages.extract <part>
    params: extract.* (backend, taps, dtype, device, devices, batch_tokens, writers, revision, work_dir;
            extract.hf.compile for the hf backend: auto = kernels on CUDA (the backend's own layers for
            Llama, Mistral, Qwen2 and Qwen3, with its own Triton kernels), layers = the same layers as
            one torch.compile graph, true = inside transformers' forward;
            extract.sglang.* for the sglang backend: server_url or launch-and-stop, concurrency,
            retries, capture_dir; extract.vllm.* for the vllm backend: python, server_args, concurrency),
            store.* (codec, level, chunk_mb, shard_mb, states: bf16 | fp8), validate.* (gate),
            tokenize.max_seq_len
Writes metrics/extract/<part>.json (the headline figures `dvc metrics show` tabulates: tokens,
tokens/s, bytes, the gate's verdict and its worst figures) and reports/extract/<part>.json (all of
it: per-tap gate figures and thresholds, the host path's timings). A crash leaves finished pieces in
extract.work_dir; rerunning resumes. A failed validation gate writes both and exits non-zero without
touching data/hidden/<part>.
"""

import argparse
import time
from pathlib import Path

from eaglenest.atomic import write_json
from eaglenest.errors import EaglenestError, exit_on_error
from eaglenest.extraction.backends import make_backend
from eaglenest.extraction.devices import devices_for
from eaglenest.extraction.loop import GateFailed, extract_part
from eaglenest.extraction.plan import batch_tokens_for
from eaglenest.extraction.wall_clock import add_fixed_cost
from eaglenest.taps import resolve_taps
from eaglenest.target import check_fingerprint, load_target, pick_device

from . import _params
from . import _paths as paths


@exit_on_error
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    t_main = time.time()
    params = _params.load()
    ex, st, va = params["extract"], params["store"], params["validate"]
    target = load_target(paths.TARGET)
    check_fingerprint(target, paths.DIGESTS)  # digests by stat: the weights are not re-read per part
    fingerprint_s = time.time() - t_main
    taps = resolve_taps(ex["taps"], target.num_layers)
    name = ex["backend"]
    states = st["states"]
    kw = {"states": states} if name == "hf" else {}  # hf quantizes on its device; others' states in the fill
    options = {"taps": taps, "dtype": ex["dtype"], **kw, **(ex[name] or {})}
    devices = devices_for(ex["devices"], ex["device"])
    if len(devices) > 1 and name != "hf":
        raise EaglenestError(f"extract.devices {ex['devices']!r}: several devices need backend hf ({name} has its own: "
                             f"--dp-size / --data-parallel-size in extract.{name}.server_args)")  # fmt: skip
    backend = make_backend(name, target=target, device=devices[0], **options)
    metrics_path, report_path = paths.metrics("extract", args.part), paths.report("extract", args.part)
    try:
        metrics = extract_part(
            part=args.part,
            tokenized=paths.tokenized(args.part),
            target=target,
            backend=backend,
            taps=taps,
            dtype=ex["dtype"],
            revision=ex["revision"],
            layout_cfg={**{k: st[k] for k in ("chunk_mb", "shard_mb", "codec", "level")}, "states": states},
            validate_cfg=va,
            out_dir=paths.hidden(args.part),
            work_root=Path(ex["work_dir"]),
            batch_tokens=batch_tokens_for(ex["batch_tokens"], pick_device(devices[0])),
            max_seq_len=int(params["tokenize"]["max_seq_len"]),
            progress=not args.no_progress,
            writers=ex["writers"] if ex["writers"] != "auto" else None,
            devices=devices,
            backend_spec=(name, options),
        )
    except GateFailed as e:
        add_fixed_cost(e.metrics, t_main, fingerprint_s)
        write_json(report_path, e.metrics)
        write_json(metrics_path, headline(e.metrics))
        raise
    finally:
        backend.close()  # stops a server the sglang or vllm backend launched
    add_fixed_cost(metrics, t_main, fingerprint_s)
    write_json(report_path, metrics)
    write_json(metrics_path, headline(metrics))


HEADLINE = (
    "committed",
    "samples",
    "tokens",
    "tokens_extracted_now",
    "pieces",
    "pieces_resumed",
    "tokens_per_s",
    "wall_s",  # from process start; its forward loop and fixed cost are itemised in the report
    "stored_bytes",
    "compression_ratio",
)


def headline(m: dict) -> dict:
    """A part's figures worth a column in `dvc metrics show`; the rest stays in the report."""
    v = m.get("validation", {})
    taps = v.get("taps", {}).values()
    return {
        **{k: m[k] for k in HEADLINE if k in m},
        "fixed_s": m.get("fixed_cost", {}).get("total_s"),
        "gate_passed": v.get("passed"),
        "gate_worst_cosine": min((t["cosine_min"] for t in taps), default=None),
        "gate_worst_rel_err_mean": max((t["rel_err_mean"] for t in taps), default=None),
    }


if __name__ == "__main__":
    main()
