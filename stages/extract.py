"""Stage `extract@<part>`: hidden states of a tokenized part into a validated Zarr store.

    python -m stages.extract <part>
    params: extract.* (backend, taps, dtype, device, batch_tokens, writers, revision, work_dir;
            extract.hf.compile for the hf backend: auto = decoder layers compiled on CUDA;
            extract.sglang.* for the sglang backend: server_url or launch-and-stop, concurrency,
            retries, capture_dir),
            store.* (codec, level, chunk_mb, shard_mb, states: bf16 | fp8), validate.* (gate),
            tokenize.max_seq_len
A crash leaves finished pieces in extract.work_dir; rerunning resumes. A failed validation gate
writes metrics/extract/<part>.json and exits non-zero without touching data/hidden/<part>.
"""

import argparse
from pathlib import Path

from eaglenest.atomic import write_json
from eaglenest.errors import exit_on_error
from eaglenest.extraction.backends import make_backend
from eaglenest.extraction.loop import GateFailed, extract_part
from eaglenest.taps import resolve_taps
from eaglenest.target import check_fingerprint, load_target

from . import _params


@exit_on_error
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    params = _params.load()
    ex, st, va = params["extract"], params["store"], params.get("validate", {})
    target = load_target(Path("data/target"))
    check_fingerprint(target)
    taps = resolve_taps(ex.get("taps", "auto"), target.num_layers)
    name = ex.get("backend", "hf")
    states = st.get("states", "bf16")
    kw = {"states": states} if name == "hf" else {}  # hf quantizes on its device; others' states in the fill
    backend = make_backend(
        name,
        target=target,
        taps=taps,
        dtype=ex.get("dtype", "bfloat16"),
        device=ex.get("device", "auto"),
        **kw,
        **(ex.get(name) or {}),
    )
    metrics_path = Path(f"metrics/extract/{args.part}.json")
    try:
        metrics = extract_part(
            part=args.part,
            tokenized=Path(f"data/tokenized/{args.part}.parquet"),
            target=target,
            backend=backend,
            taps=taps,
            dtype=ex.get("dtype", "bfloat16"),
            revision=ex.get("revision", 0),
            layout_cfg={**{k: st[k] for k in ("chunk_mb", "shard_mb", "codec", "level")}, "states": states},
            validate_cfg=va,
            out_dir=Path(f"data/hidden/{args.part}"),
            work_root=Path(ex.get("work_dir", ".eaglenest/work")),
            batch_tokens=int(ex.get("batch_tokens", 4096)),
            max_seq_len=int(params["tokenize"]["max_seq_len"]),
            progress=not args.no_progress,
            writers=ex.get("writers") if ex.get("writers") != "auto" else None,
        )
    except GateFailed as e:
        write_json(metrics_path, e.metrics)
        raise
    finally:
        backend.close()  # stops a server the sglang backend launched
    write_json(metrics_path, metrics)


if __name__ == "__main__":
    main()
