"""Stage `extract@<part>`: hidden states of a tokenized part into a validated Zarr store.

    python -m stages.extract <part>
    params: extract.* (backend, taps, dtype (auto: bfloat16 on a GPU or a CPU with bf16 units, else
            float32; part of the extractor fingerprint), device, devices, batch_tokens, writers, revision, work_dir;
            extract.hf.compile for the hf backend: auto = kernels on CUDA (the backend's own layers for
            Llama, Mistral, Qwen2 and Qwen3, with its own Triton kernels), layers = the same layers as
            one torch.compile graph, true = inside transformers' forward;
            extract.sglang.* for the sglang backend: server_url or launch-and-stop, concurrency,
            retries, capture_dir; extract.vllm.* for the vllm backend: python, server_args, concurrency),
            store.* (codec, level, chunk_mb, shard_mb, states: bf16 | fp8), validate.* (gate),
            tokenize.max_seq_len
Before anything loads it estimates the part's store bytes and refuses to start when the disk cannot
hold them plus extract.disk_reserve_gb (`eaglenest plan` shows the same figures for every part).
Writes reports/extract/<part>.json (samples, tokens, bytes, padding, the gate's verdict with every
tap's figures, thresholds and margins, what it was made on) and reports/timing/extract/<part>.json
(the run: tokens/s, the wall clock split into the forward loop and each fixed cost, the host path's
timings, resumed pieces). A crash leaves finished pieces in extract.work_dir; rerunning resumes. A
failed validation gate writes both and exits non-zero without touching data/hidden/<part>.
"""

import argparse
import logging
import time
from pathlib import Path

from eaglenest.disk_plan import Shape, check_space, ratio_of, store_bytes, written
from eaglenest.extraction.backends import make_backend
from eaglenest.extraction.devices import devices_for
from eaglenest.extraction.loop import GateFailed, extract_part
from eaglenest.extraction.plan import batch_tokens_for, token_count
from eaglenest.extraction.wall_clock import add_fixed_cost
from eaglenest.files.sizes import size
from eaglenest.runtime.errors import EaglenestError, exit_on_error
from eaglenest.runtime.made_on import compute_dtype, made_on
from eaglenest.target.directory import check_fingerprint, load_target
from eaglenest.target.loading import pick_device
from eaglenest.target.taps import resolve_taps

from . import _figures, _params
from . import _paths as paths

log = logging.getLogger(__name__)


@exit_on_error
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", type=paths.part_name, help="the part (a plain name: data/parts/<part>.jsonl)")
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
    devices = devices_for(ex["devices"], ex["device"])
    dtype = compute_dtype(ex["dtype"], pick_device(devices[0]))  # auto: float32 on a CPU without bf16 units
    options = {"taps": taps, "dtype": dtype, **kw, **(ex[name] or {})}
    if len(devices) > 1 and name != "hf":
        raise EaglenestError(f"extract.devices {ex['devices']!r}: several devices need backend hf ({name} has its own: "
                             f"--dp-size / --data-parallel-size in extract.{name}.server_args)")  # fmt: skip
    plan_disk(args.part, target, taps, states, Path(ex["work_dir"]), float(ex["disk_reserve_gb"]))
    backend = make_backend(name, target=target, device=devices[0], **options)
    report_paths = paths.report("extract", args.part), paths.timing("extract", args.part)
    try:
        metrics = extract_part(
            part=args.part,
            tokenized=paths.tokenized(args.part),
            target=target,
            backend=backend,
            taps=taps,
            dtype=dtype,
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
        _figures.write(*report_paths, {**e.metrics, **made_on(pick_device(devices[0]), dtype)})
        raise
    finally:
        backend.close()  # stops a server the sglang or vllm backend launched
    add_fixed_cost(metrics, t_main, fingerprint_s)
    _figures.write(*report_paths, {**metrics, **made_on(pick_device(devices[0]), dtype)})


def plan_disk(part: str, target, taps: list, states: str, work_root: Path, reserve_gb: float) -> None:
    """The part's store bytes before anything loads (docs/design.md: Disk plan); a filesystem that
    cannot hold them and the reserve refuses the part here."""
    tokens = token_count(paths.tokenized(part))
    shape = Shape(target.hidden_size, len(taps), states)
    ratio, whence = ratio_of(paths.HIDDEN, states)
    need = max(0, store_bytes(tokens, shape, ratio) - written(work_root, part))
    log.info("%s: %s tokens -> a store of ~%s (%d B a token, compression %.2f: %s)", part, f"{tokens:,}",
             size(store_bytes(tokens, shape, ratio)), shape.row, ratio, whence)  # fmt: skip
    check_space(part, need, [work_root, paths.hidden(part)], int(reserve_gb * 1e9))


if __name__ == "__main__":
    main()
