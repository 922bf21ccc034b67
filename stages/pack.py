"""Stage `pack`: every part's store index, loss masks and teacher argmax (`teacher@<part>`) -> draft
vocabulary, train/val split, tokens and an index into the stores (data/packed). No state is read
or copied: training reads the states from the stores.

python -m stages.pack      (params: data.parts, pack.draft_vocab_size, pack.val_fraction)
Writes metrics/data.json (pack's and the stores' bytes, in MB) and reports/pack.json (the split,
the tokens, the draft vocabulary's coverage, and each part's headline figures from its stages'
reports: samples, truncated and skipped, turns regenerated, the validation gate's worst figures).
"""

import argparse
import json
import logging

from eaglenest.data.pack import pack
from eaglenest.files.atomic import write_json
from eaglenest.runtime.errors import exit_on_error
from eaglenest.runtime.made_on import made_on

from . import _params
from . import _paths as paths

log = logging.getLogger("stages.pack")


@exit_on_error
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-progress", action="store_true", help="accepted for symmetry; pack reads no states")
    ap.parse_args(argv)
    params = _params.load()
    p, parts = params["pack"], params["data"]["parts"]
    headlines = {part: part_headline(part) for part in parts}
    figures = pack(
        parts,
        paths.HIDDEN,
        paths.TOKENIZED,
        paths.TEACHER,
        paths.PACKED,
        draft_vocab_size=int(p["draft_vocab_size"]),
        val_fraction=float(p["val_fraction"]),
    )
    made = made_on("cpu")
    # each state is stored once: pack's bytes beside the stores' (the rest: reports/pack.json)
    sizes = {"pack_mb": round(figures["pack_bytes"] / 1e6, 2), "stores_mb": round(figures["store_bytes"] / 1e6, 1)}
    write_json(paths.metrics("data"), {**sizes, **made})
    write_json(paths.report("pack"), {**figures, "parts": headlines, **made})


def part_headline(part: str) -> dict:
    """A part's figures worth a line in reports/pack.json, from its stages' own reports (DVC outputs
    cached with its data, so every part has them in a pipeline; outside one, a missing report is
    only a warning: the packed data does not depend on it)."""
    reports = {}
    for stage in ("tokenize", "generate", "extract"):
        f = paths.report(stage, part)
        if f.is_file():
            reports[stage] = json.loads(f.read_text())
        else:
            log.warning("%s: missing, so reports/pack.json lacks its figures (`dvc checkout %s` restores it)", f, f)
    tok, ex, gen = (reports.get(k, {}) for k in ("tokenize", "extract", "generate"))
    taps = ex.get("validation", {}).get("taps", {}).values()
    return {
        "samples": tok.get("samples"),
        "tokens": tok.get("tokens"),
        "truncated": tok.get("truncated"),
        "skipped": tok["skipped"] + tok["malformed_lines"] if tok else None,
        "regenerated_turns": gen.get("regenerated", 0) if gen else None,
        "stored_bytes": ex.get("stored_bytes"),
        "gate_passed": ex.get("validation", {}).get("passed"),
        "gate_worst_cosine": min((t["cosine_min"] for t in taps), default=None),
        "gate_worst_rel_err_mean": max((t["rel_err_mean"] for t in taps), default=None),
    }


if __name__ == "__main__":
    main()
