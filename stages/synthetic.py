"""Stage `synthetic@<part>`: a part whose prompts the target writes. The target samples `--count` user
messages from its chat template's opening of a user turn (after `synthetic.system`, if set), seeded,
filtered for degenerate text and deduplicated (exact and near). The part holds prompt-only
conversations; `generate@<part>` answers them by self-distillation (generate.enabled must be true).
With `--turns T` > 1 each conversation also asks generate for T - 1 follow-up user turns, which the
target writes after each of its answers (same temperature and filters; a dropped one ends the
conversation, counted in reports/generate/<part>.json).

    python -m stages.synthetic <part> --count N --seed S --temperature T [--turns T]
        (params: synthetic.*; in: data/target, out: data/parts/<part>.jsonl, reports/synthetic/<part>.json)

Declare a part in params.yaml as `data.synthetic.<part>: {count, seed, temperature}` (and `turns`,
optional) and list it in `data.parts`: `dvc repro` then runs only the new part's stages.
reports/synthetic/<part>.json counts what was sampled, kept and dropped by reason; wall clock goes to
reports/timing/synthetic/<part>.json.
"""

import argparse
import logging
import time

from eaglenest.data.conversations import write_jsonl
from eaglenest.files.atomic import write_json
from eaglenest.runtime.errors import exit_on_error
from eaglenest.runtime.made_on import compute_dtype, made_on
from eaglenest.synthetic import conversations, sample_prompts
from eaglenest.target.directory import load_target
from eaglenest.target.loading import load_model, load_tokenizer, pick_device

from . import _params
from . import _paths as paths

log = logging.getLogger("stages.synthetic")


@exit_on_error
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", type=paths.part_name, help="the part (a plain name: data/parts/<part>.jsonl)")
    ap.add_argument("--count", type=int, required=True, help="user prompts to keep")
    ap.add_argument("--seed", type=int, required=True, help="seeds the sampling (rounds use seed-derived seeds)")
    ap.add_argument("--temperature", type=float, required=True, help="sampling temperature, > 0")
    ap.add_argument(
        "--turns", type=int, default=1, help="user turns per conversation, the target writing each next one (default 1)"
    )
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    p = _params.load("synthetic")
    if args.turns < 1:
        ap.error(f"--turns must be >= 1, got {args.turns}")
    t0 = time.perf_counter()
    target = load_target(paths.TARGET)
    device = pick_device(p["device"])
    dtype = compute_dtype(p["dtype"], device)
    model = load_model(target, dtype=dtype, device=device)
    prompts, stats = sample_prompts(
        model,
        load_tokenizer(target),
        args.count,
        args.seed,
        args.temperature,
        system=p["system"],
        max_prompt_tokens=int(p["max_prompt_tokens"]),
        near_duplicate=float(p["near_duplicate"]),
        batch_tokens=int(p["batch_tokens"]),
        max_rows=int(p["max_rows"]),
        progress=not args.no_progress,
    )
    follow_ups = {
        "turns": args.turns - 1,
        "temperature": args.temperature,
        "seed": args.seed,
        "max_tokens": int(p["max_prompt_tokens"]),
        "near_duplicate": float(p["near_duplicate"]),
    }
    write_jsonl(
        conversations(args.part, prompts, p["system"], follow_ups if args.turns > 1 else None), paths.part(args.part)
    )
    stats.update(seed=args.seed, temperature=args.temperature, turns=args.turns, **made_on(device, dtype))
    write_json(paths.report("synthetic", args.part), stats)
    wall = time.perf_counter() - t0
    write_json(paths.timing("synthetic", args.part), {"wall_s": round(wall, 2)})
    log.info(
        "part %s: %d prompts kept of %d sampled in %d rounds (dropped: %s), %.1f s",
        args.part,
        stats["kept"],
        stats["sampled"],
        stats["rounds"],
        {k[8:]: v for k, v in stats.items() if k.startswith("dropped_")},
        wall,
    )


if __name__ == "__main__":
    main()
