"""A stage's figures, split in two: what the same code, params and machine kind compute again byte for
byte (its report, a DVC output whose hash `dvc.lock` records), and how this run went -- wall clock,
throughput, resumed pieces, devices and writers used -- which differs on every run
(`_paths.timing`: neither in git nor a DVC output, so `make repro` on a fresh clone leaves
`dvc.lock` and `metrics/` as committed)."""

from pathlib import Path

from eaglenest.files.atomic import write_json

# besides every key ending in "_s" or "seconds" (tokens_per_s too): figures of the run, not of the result
RUN_KEYS = {
    "seconds",
    "seconds_by_step",
    "pieces_resumed",
    "tokens_extracted_now",
    "devices",
    "writers",
    "writer_busy",
    "writer_utilisation",
    "bound_by",
    "fixed_cost",
    "forward_path",  # the own Llama-family layers (CUDA) or transformers' forward: by the device
    "reference",  # whole or streamed, and its memory: chosen by the machine's free memory
}


def is_run_key(key: str) -> bool:
    return key.endswith(("_s", "seconds")) or key in RUN_KEYS


def split(figures: dict) -> tuple[dict, dict]:
    """(result, run): nested dicts are split key by key; a dict left empty on one side is dropped."""
    result, run = {}, {}
    for k, v in figures.items():
        if is_run_key(k):
            run[k] = v
        elif isinstance(v, dict) and v:
            a, b = split(v)
            if a:
                result[k] = a
            if b:
                run[k] = b
        else:
            result[k] = v
    return result, run


def write(report: Path, timing: Path, figures: dict) -> tuple[dict, dict]:
    """Write both halves; returns them."""
    result, run = split(figures)
    write_json(report, result)
    write_json(timing, run)
    return result, run
