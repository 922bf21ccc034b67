"""`eaglenest` command line: inspect and verify hidden-state stores.

eaglenest verify data/hidden/*      re-hash every sample; exit 1 if any does not match (a missing
                                    shard file is named with the samples it held)
eaglenest verify --cache            re-hash every DVC cache object behind the workspace's outputs
                                    (dvc.lock, *.dvc); exit 1 naming any whose bytes changed
eaglenest info data/hidden/<part>   attributes, sample and token counts
eaglenest stores [data/hidden]      list stores grouped by extractor fingerprint
eaglenest invalidate                list extractor fingerprints and the parts each one made
eaglenest invalidate FP [--run]     re-extract exactly the parts made by extractor FP (prefix)
eaglenest plan                      bytes of every part's store, pack and the DVC cache for params.yaml
eaglenest plan --config C --tokens N  the same for a target known only by its config.json
eaglenest profile                   list the params profiles (profiles/*.yaml)
eaglenest profile NAME [--dry-run]  write profile NAME's keys into params.yaml
eaglenest serve-flags               SGLang's and vLLM's flags for the fastest chain and tree evaluate measured

A path that is missing, empty or of the wrong kind fails the command (exit 2), naming it.
"""

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from eaglenest.errors import EaglenestError, exit_on_error
from eaglenest.names import plain_name
from eaglenest.store.hidden_store import HiddenStore, verify_store


def directory(path, what: str) -> Path:
    """`path` as an existing directory, or an error naming it and what was expected there."""
    p = Path(path)
    if not p.exists():
        raise EaglenestError(f"{p}: no such {what}")
    if not p.is_dir():
        raise EaglenestError(f"{p}: a file, not a {what}")
    return p


def store_dir(path) -> Path:
    p = directory(path, "hidden-state store (a directory such as data/hidden/<part>)")
    if not (p / "zarr.json").is_file():
        inside = find_stores(p)
        hint = f"; it holds {len(inside)} store(s): `eaglenest stores {p}` lists them" if inside else ""
        raise EaglenestError(f"{p}: not a hidden-state store, or an incomplete one ({p / 'zarr.json'}: missing){hint}")
    return p


def cmd_verify(args) -> int:
    if not args.stores and not args.cache:
        raise EaglenestError("verify: name stores (data/hidden/*), or --cache for the DVC cache, or both")
    stores = [store_dir(p) for p in args.stores]  # every path checked before any long work
    bad_total = verify_cache(args.quiet) if args.cache else 0
    for path in stores:
        bad = verify_store(path, progress=not args.quiet)
        for msg in bad:
            print(f"BAD     {msg}")
        if not bad:
            print(f"OK      {path}")
        bad_total += len(bad)
    if bad_total:
        print(f"{bad_total} bad sample(s) or cache object(s)", file=sys.stderr)
    return 1 if bad_total else 0


def verify_cache(quiet: bool) -> int:
    """The DVC cache objects of this workspace's outputs against their md5; the number corrupt."""
    from eaglenest.dvc_cache import check_cache

    r = check_cache(Path("."), progress=not quiet)
    for msg in r.corrupt:
        print(f"BAD     {msg}")
    absent = f", {r.absent} not in the cache (never pulled)" if r.absent else ""
    print(f"{'OK' if not r.corrupt else 'BAD':8s}DVC cache: {r.checked} object(s), {r.bytes:,} bytes checked{absent}")
    if r.corrupt:
        print("a corrupt object holds other bytes than its name says: remove it and `dvc pull` it, or rerun the stage "
              "that made it (`dvc repro -f <stage>`)", file=sys.stderr)  # fmt: skip
    return len(r.corrupt)


def cmd_info(args) -> int:
    print(json.dumps(HiddenStore(store_dir(args.store)).describe(), indent=2, sort_keys=True))
    return 0


def find_stores(root: Path) -> list[Path]:
    return sorted(p.parent for p in Path(root).glob("*/zarr.json"))


def stores_under(root) -> list[Path]:
    """The stores in `root` (data/hidden by default); an error if there are none."""
    root = directory(root, "directory of hidden-state stores")
    found = find_stores(root)
    if not found:
        raise EaglenestError(f"{root}: no hidden-state stores in it (each is a <part>/ directory with a zarr.json)")
    return found


def read_stores(root) -> tuple[list[HiddenStore], list[str]]:
    """(the readable stores under root, one line per unreadable one)."""
    stores, bad = [], []
    for path in stores_under(root):
        try:
            stores.append(HiddenStore(path))
        except EaglenestError as e:
            bad.append(f"UNREADABLE {path}: {e}")
    return stores, bad


def cmd_stores(args) -> int:
    stores, bad = read_stores(args.root)
    groups = defaultdict(list)
    for s in stores:
        groups[s.attrs["extractor_fingerprint"]].append(s)
    for line in bad:
        print(line)
    for fp, rows in groups.items():
        print(f"extractor {fp[:16]}  {json.dumps(rows[0].attrs['extractor'], sort_keys=True)}")
        for s in rows:
            print(f"  {s.path}  {len(s)} samples, {s.n_tokens} tokens")
    return 1 if bad else 0


def parts_by_extractor(root: Path) -> dict[str, list[str]]:
    stores, bad = read_stores(root)
    for line in bad:
        print(line)
    out = defaultdict(list)
    for s in stores:
        out[s.attrs["extractor_fingerprint"]].append(s.path.name)
    return out


def cmd_invalidate(args) -> int:
    """The CLI edge that drives DVC: the library itself knows nothing of it."""
    import subprocess

    groups = parts_by_extractor(Path(args.root))
    if not args.fingerprint:
        return cmd_stores(args)
    hits = [fp for fp in groups if fp.startswith(args.fingerprint)]
    if not hits:
        raise EaglenestError(
            f"extractor fingerprint prefix {args.fingerprint!r} matches none of the {len(groups)} extractor(s) "
            f"of the stores in {args.root}: {', '.join(fp[:16] for fp in groups)} (`eaglenest invalidate` lists them)"
        )
    if len(hits) > 1:
        raise EaglenestError(
            f"extractor fingerprint prefix {args.fingerprint!r} matches {len(hits)} extractors "
            f"({', '.join(fp[:16] for fp in hits)}); give a longer prefix"
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


def cmd_plan(args) -> int:
    from eaglenest import disk_plan
    from eaglenest.sizes import size

    if args.config:
        if not args.tokens:
            raise EaglenestError("plan --config needs --tokens (the tokens the parts will hold)")
        out = disk_plan.for_config(Path(args.config), int(args.tokens), args.taps, args.ratio)
        if args.json:
            print(json.dumps(out, indent=1))
            return 0
        print(f"{args.config}: {int(args.tokens):,} tokens, {args.taps} taps + final, compression {args.ratio} "
              f"(zstd measured 1.25 on bf16 states here; 1 assumes none)")  # fmt: skip
        for states, v in out.items():
            print(f"  {states:5s} {v['row_bytes']:>8,} B a token   stores {size(v['store_bytes']):>9}   "
                  f"pack {size(v['pack_bytes']):>9}")  # fmt: skip
        return 0
    from eaglenest.names import load_yaml

    params = load_yaml(Path(args.params))
    out = disk_plan.for_params(params, Path("."))
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"store.states {out['states']}: {out['row_bytes']:,} B a token uncompressed, compression "
          f"{out['compression_ratio']} ({out['compression_from']})")  # fmt: skip
    for part, v in out["parts"].items():
        tokens = f"{v['tokens']:>12,} tokens" if v["tokens"] is not None else "not tokenized yet".rjust(19)
        print(f"  {part:24s} {tokens}   store {size(v['store_bytes']) if v['store_bytes'] is not None else '?':>9}")
    print(f"  {'stores':24s} {'':19s}         {size(out['stores_bytes']):>9}")
    print(f"  {'teacher':24s} {'':19s}         {size(out['teacher_bytes']):>9}   (the target's argmax, 4 B a token)")
    print(f"  {'pack':24s} {'':19s}         {size(out['pack_bytes']):>9}   (tokens and an index: no state copied)")
    cache = "a copy of every output" if out["dvc_cache_bytes"] else "links, no second copy: cache.type"
    print(f"  {'DVC cache':24s} {'':19s}         {size(out['dvc_cache_bytes']):>9}   ({cache})")
    print(f"  {'free on data/':24s} {'':19s}         {size(out['free_bytes']):>9}")
    if out["untokenized"]:
        todo = " ".join("tokenize@" + p for p in out["untokenized"])
        print(f"  parts not tokenized yet are not counted: dvc repro {todo}")
    if out["extract_hours"] is not None:
        print(f"  extraction at this machine's measured rate (reports/timing/extract): ~{out['extract_hours']} h")
    return 0


def cmd_profile(args) -> int:
    from eaglenest import profile

    profiles = directory(args.dir, "profiles directory")
    if args.name and not Path(args.params).is_file():
        raise EaglenestError(f"{args.params}: no such params file")
    if not args.name:
        found = sorted(profiles.glob("*.yaml"))
        if not found:
            raise EaglenestError(f"{profiles}: no profiles (*.yaml) in it")
        for p in found:
            first = next((line.lstrip("# ").strip() for line in p.read_text().splitlines() if line.startswith("#")), "")
            print(f"{p.stem:12s} {first}")
        return 0
    name = plain_name(args.name, "profile")
    changes = profile.apply(Path(args.dir) / f"{name}.yaml", Path(args.params), dry_run=args.dry_run)
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


def cmd_serve_flags(args) -> int:
    from eaglenest.serve_flags import flags, read_timing

    timing = read_timing(args.timing)
    print(f"# from {args.timing} (batch 1 on the device evaluate ran on)")
    for what, cmd in flags(timing, args.target, args.drafter):
        print(f"# {what}\n{cmd}")
    return 0


@exit_on_error
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="eaglenest", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verify", help="re-hash every sample of the given stores, or the DVC cache's objects")
    v.add_argument("stores", nargs="*")
    v.add_argument("--cache", action="store_true",
                   help="also check every DVC cache object of this workspace's outputs against its md5")  # fmt: skip
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
    pl = sub.add_parser(
        "plan",
        help="bytes before work: every part's store, pack and the DVC cache",
        description="Estimate what the extraction will write, without running anything: per part "
        "tokens x (taps + 1) x hidden x bytes per element over the compression the stores already "
        "written show (or none), pack (tokens and an index: no state) and the DVC cache; with --config, for a target "
        "known only by its config.json, in every store format.",
    )
    pl.add_argument("--params", default="params.yaml")
    pl.add_argument("--config", help="a target's config.json instead of params.yaml and data/target")
    pl.add_argument("--tokens", type=float, help="with --config: tokens over all parts (21e6 works)")
    pl.add_argument("--taps", type=int, default=3, help="with --config: auxiliary taps (default 3)")
    pl.add_argument("--ratio", type=float, default=1.0, help="with --config: compression ratio (default 1: none)")
    pl.add_argument("--json", action="store_true", help="the figures as JSON")
    pl.set_defaults(fn=cmd_plan)
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
    sf = sub.add_parser(
        "serve-flags",
        help="SGLang's and vLLM's flags for the chain and tree that evaluate found fastest",
        description="Reads the evaluate stage's timing (best_k, best_tree: the fastest at batch 1 on the "
        "device evaluate ran on) and prints the serving command lines for the exported drafter.",
    )
    sf.add_argument("--timing", default="reports/timing/evaluate.json")
    sf.add_argument("--target", default="data/target/model", help="the target model path to serve")
    sf.add_argument("--drafter", default="data/drafter")
    sf.set_defaults(fn=cmd_serve_flags)
    args = ap.parse_args(argv)
    sys.exit(args.fn(args))


if __name__ == "__main__":
    main()
