"""`eaglenest` command line: inspect and verify hidden-state stores.

eaglenest verify data/hidden/*      re-hash every sample; exit 1 if any does not match
eaglenest info data/hidden/<part>   attributes, sample and token counts
eaglenest stores [data/hidden]      list stores grouped by extractor fingerprint
eaglenest invalidate                list extractor fingerprints and the parts each one made
eaglenest invalidate FP [--run]     re-extract exactly the parts made by extractor FP (prefix)
eaglenest profile                   list the params profiles (profiles/*.yaml)
eaglenest profile NAME [--dry-run]  write profile NAME's keys into params.yaml
"""

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from eaglenest.errors import EaglenestError, exit_on_error
from eaglenest.store.hidden_store import HiddenStore, verify_store


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


def parts_by_extractor(root: Path) -> dict[str, list[str]]:
    out = defaultdict(list)
    for path in find_stores(root):
        try:
            out[HiddenStore(path).attrs["extractor_fingerprint"]].append(path.name)
        except EaglenestError as e:
            print(f"UNREADABLE {path}: {e}")
    return out


def cmd_invalidate(args) -> int:
    """The CLI edge that drives DVC: the library itself knows nothing of it."""
    import subprocess

    groups = parts_by_extractor(Path(args.root))
    if not args.fingerprint:
        cmd_stores(args)
        return 0
    hits = [fp for fp in groups if fp.startswith(args.fingerprint)]
    if len(hits) != 1:
        raise EaglenestError(
            f"extractor fingerprint prefix {args.fingerprint!r} matches {len(hits)} of "
            f"{len(groups)} extractors; give a longer prefix (see `eaglenest invalidate`)"
        )
    parts = sorted(groups[hits[0]])
    cmds = [["dvc", "repro", "--force", "--single-item", f"extract@{p}"] for p in parts]
    print(f"extractor {hits[0][:16]} made {len(parts)} part(s): {', '.join(parts)}")
    for c in cmds:
        print(("running: " if args.run else "would run: ") + " ".join(c))
        if args.run and subprocess.run(c).returncode != 0:
            raise EaglenestError(f"`{' '.join(c)}` failed; the previous versions stay in the DVC cache")
    print(
        "then `dvc repro` rebuilds what depends on them (pack, train, evaluate)"
        if args.run
        else "add --run to do it; old versions stay in the DVC cache until `dvc gc`"
    )
    return 0


def cmd_profile(args) -> int:
    from eaglenest import profile

    if not args.name:
        for p in sorted(Path(args.dir).glob("*.yaml")):
            first = next((line.lstrip("# ").strip() for line in p.read_text().splitlines() if line.startswith("#")), "")
            print(f"{p.stem:12s} {first}")
        return 0
    changes = profile.apply(Path(args.dir) / f"{args.name}.yaml", Path(args.params), dry_run=args.dry_run)
    for key, old, new in changes:
        print(f"{key}: {json.dumps(old, default=str)} -> {json.dumps(new, default=str)}")
    verb = "would change" if args.dry_run else "changed"
    print(f"profile {args.name}: {verb} {len(changes)} key(s) in {args.params}")
    if not args.dry_run:
        print(
            f"next: `dvc exp run -n {args.name}` (or `dvc repro`); `git checkout {args.params}` returns to the "
            f"committed params"
        )
    return 0


@exit_on_error
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="eaglenest", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
    inv = sub.add_parser("invalidate", help="re-extract the parts made by one extractor fingerprint")
    inv.add_argument("fingerprint", nargs="?", help="extractor fingerprint (a unique prefix)")
    inv.add_argument("--run", action="store_true", help="run the dvc commands (default: only print them)")
    inv.add_argument("--root", default="data/hidden")
    inv.set_defaults(fn=cmd_invalidate)
    pr = sub.add_parser(
        "profile",
        help="apply a params profile (profiles/NAME.yaml) to params.yaml",
        description="A profile holds only the keys that differ from params.yaml; applying it "
        "sets each of them in params.yaml (comments kept). Without NAME: list them.",
    )
    pr.add_argument("name", nargs="?")
    pr.add_argument("--dry-run", action="store_true", help="show the changes, write nothing")
    pr.add_argument("--params", default="params.yaml")
    pr.add_argument("--dir", default="profiles")
    pr.set_defaults(fn=cmd_profile)
    args = ap.parse_args(argv)
    sys.exit(args.fn(args))


if __name__ == "__main__":
    main()
