"""Stage `tokenize@<part>`: render with the target's chat template, loss mask over assistant
tokens (derived from the rendering), truncate at max_seq_len, write Parquet; counts (samples,
tokens, truncated, skipped, malformed lines by reason) to reports/tokenize/<part>.json.

    python -m stages.tokenize <part>   (params: tokenize.max_seq_len, tokenize.on_error, tokenize.workers)
"""

import argparse
import logging
from pathlib import Path

from eaglenest.data.chat import require_template, tokenize_part, write_tokenized
from eaglenest.data.conversations import read_jsonl
from eaglenest.files.atomic import write_json
from eaglenest.runtime.errors import EaglenestError, exit_on_error
from eaglenest.target.directory import load_target
from eaglenest.target.loading import load_tokenizer

from . import _params
from . import _paths as paths

log = logging.getLogger("stages.tokenize")


@exit_on_error
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", type=paths.part_name, help="the part (a plain name: data/parts/<part>.jsonl)")
    ap.add_argument("--input", help="conversations JSONL (default: data/generated/<part>.jsonl)")
    args = ap.parse_args(argv)
    p = _params.load("tokenize")
    on_error = p["on_error"]
    if on_error not in ("fail", "skip"):
        raise EaglenestError(f"tokenize.on_error must be fail or skip, got {on_error!r}")
    src = Path(args.input) if args.input else paths.generated(args.part)
    target = load_target(paths.TARGET)
    tok = load_tokenizer(target)
    require_template(tok, str(target.model_dir))
    convs, report = read_jsonl(src, on_error=on_error)
    workers = _params.workers(p["workers"])
    table, stats = tokenize_part(tok, convs, int(p["max_seq_len"]), str(src), on_error=on_error, workers=workers)
    if stats["samples"] == 0:
        raise EaglenestError(f"{src}: no usable samples after tokenization")
    write_tokenized(table, paths.tokenized(args.part))
    stats.update(
        lines=report.lines,
        malformed_lines=sum(report.skipped.values()),
        malformed_reasons=dict(report.skipped),
        max_seq_len=int(p["max_seq_len"]),
    )
    write_json(paths.report("tokenize", args.part), stats)
    log.info(
        "part %s: %d samples, %d tokens (%d loss), %d truncated, %d skipped",
        args.part,
        stats["samples"],
        stats["tokens"],
        stats["loss_tokens"],
        stats["truncated"],
        stats["skipped"] + stats["malformed_lines"],
    )


if __name__ == "__main__":
    main()
