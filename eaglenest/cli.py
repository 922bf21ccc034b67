"""`eaglenest` command line: inspect and verify hidden-state stores.

    eaglenest verify data/hidden/*      re-hash every sample; exit 1 if any does not match
    eaglenest info data/hidden/<part>   attributes, sample and token counts
    eaglenest stores [data/hidden]      list stores grouped by extractor fingerprint
"""
import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from .errors import EaglenestError, exit_on_error
from .store import HiddenStore, verify_store


def cmd_verify(args) -> int:
    bad_total = 0
    for path in args.stores:
        bad = verify_store(Path(path), progress=not args.quiet)
        for msg in bad:
            print(f"CORRUPT {msg}")
        if not bad:
            print(f"OK      {path}")
        bad_total += len(bad)
    if bad_total:
        print(f"{bad_total} bad sample(s)", file=sys.stderr)
    return 1 if bad_total else 0


def cmd_info(args) -> int:
    print(json.dumps(HiddenStore(Path(args.store)).describe(), indent=2, sort_keys=True))
    return 0


def find_stores(root: Path) -> list[Path]:
    return sorted(p.parent for p in Path(root).glob("*/zarr.json"))


def cmd_stores(args) -> int:
    groups = defaultdict(list)
    for path in find_stores(Path(args.root)):
        try:
            s = HiddenStore(path)
            groups[s.attrs["extractor_fingerprint"]].append((path, s.attrs["extractor"], len(s), s.n_tokens))
        except EaglenestError as e:
            print(f"UNREADABLE {path}: {e}")
    for fp, rows in groups.items():
        print(f"extractor {fp[:16]}  {json.dumps(rows[0][1], sort_keys=True)}")
        for path, _, n, t in rows:
            print(f"  {path}  {n} samples, {t} tokens")
    return 0


@exit_on_error
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="eaglenest", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verify", help="re-hash every sample of the given stores")
    v.add_argument("stores", nargs="+")
    v.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    v.set_defaults(fn=cmd_verify)
    i = sub.add_parser("info", help="show a store's attributes and counts")
    i.add_argument("store")
    i.set_defaults(fn=cmd_info)
    s = sub.add_parser("stores", help="list stores by extractor fingerprint")
    s.add_argument("root", nargs="?", default="data/hidden")
    s.set_defaults(fn=cmd_stores)
    args = ap.parse_args(argv)
    sys.exit(args.fn(args))


if __name__ == "__main__":
    main()
