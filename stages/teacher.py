"""Stage `teacher@<part>`: the target's argmax for every token of the part, from its stored final states
(data/teacher/<part>: argmax.npy, manifest.json). The one read of a part's states before training,
cached by DVC with the part, so pack never reads states (docs/design.md: Teacher).

    python -m stages.teacher <part>   (untracked: teacher.device, where the argmax over the vocabulary
                                       is computed, ~0.5 PFLOP at 10M tokens of a 128k-vocabulary
                                       target; teacher.workers, processes reading the store: auto =
                                       cores, max 16; teacher.unit_mb, states read per unit of work)
Wall clock and tokens/s go to reports/timing/teacher/<part>.json.
"""

import argparse
import logging
import time

from eaglenest.data.teacher import teacher, tokenized_ids
from eaglenest.files.atomic import write_json
from eaglenest.runtime.errors import EaglenestError, exit_on_error
from eaglenest.runtime.made_on import made_on
from eaglenest.target.directory import load_target
from eaglenest.target.loading import load_heads, pick_device

from . import _params
from . import _paths as paths

log = logging.getLogger("stages.teacher")


@exit_on_error
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", type=paths.part_name, help="the part (a plain name: data/parts/<part>.jsonl)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.time()
    p = _params.load("teacher")
    src = paths.tokenized(args.part)
    if not src.is_file():
        raise EaglenestError(f"{src}: not found (dvc repro tokenize@{args.part})")
    if not paths.hidden(args.part).is_dir():
        raise EaglenestError(f"{paths.hidden(args.part)}: not found (dvc repro extract@{args.part})")
    device = pick_device(p["device"])
    manifest = teacher(
        paths.hidden(args.part),
        tokenized_ids(src),
        paths.teacher(args.part),
        lm_head=load_heads(load_target(paths.TARGET))["lm_head"],
        device=device,
        workers=_params.workers(p["workers"]),
        unit_mb=float(p["unit_mb"]),
        progress=not args.no_progress,
    )
    wall = time.time() - t0
    log.info("%s: teacher argmax of %s tokens in %.1f s", args.part, f"{manifest['tokens']:,}", wall)
    timing = {"wall_s": round(wall, 2), "tokens_per_s": round(manifest["tokens"] / max(wall, 1e-9), 1)}
    write_json(paths.timing("teacher", args.part), {**timing, **made_on(device)})


if __name__ == "__main__":
    main()
