"""The store commands: verify (stores, the DVC cache), info, stores, invalidate."""

import json
import sys
from collections import defaultdict
from pathlib import Path

from eaglenest.runtime.errors import EaglenestError
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
    from eaglenest.files.dvc_cache import check_cache

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
