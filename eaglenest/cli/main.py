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
import sys

from eaglenest.cli import planning, stores
from eaglenest.runtime.errors import exit_on_error


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
    v.set_defaults(fn=stores.cmd_verify)
    i = sub.add_parser("info", help="show a store's attributes and counts")
    i.add_argument("store")
    i.set_defaults(fn=stores.cmd_info)
    s = sub.add_parser("stores", help="list stores by extractor fingerprint")
    s.add_argument("root", nargs="?", default="data/hidden")
    s.set_defaults(fn=stores.cmd_stores)
    inv = sub.add_parser("invalidate", help="re-extract the parts made by one extractor fingerprint")
    inv.add_argument("fingerprint", nargs="?", help="extractor fingerprint (a unique prefix)")
    inv.add_argument("--run", action="store_true", help="run the dvc commands (default: only print them)")
    inv.add_argument("--root", default="data/hidden")
    inv.set_defaults(fn=stores.cmd_invalidate)
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
    pl.set_defaults(fn=planning.cmd_plan)
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
    pr.set_defaults(fn=planning.cmd_profile)
    sf = sub.add_parser(
        "serve-flags",
        help="SGLang's and vLLM's flags for the chain and tree that evaluate found fastest",
        description="Reads the evaluate stage's timing (best_k, best_tree: the fastest at batch 1 on the "
        "device evaluate ran on) and prints the serving command lines for the exported drafter.",
    )
    sf.add_argument("--timing", default="reports/timing/evaluate.json")
    sf.add_argument("--target", default="data/target/model", help="the target model path to serve")
    sf.add_argument("--drafter", default="data/drafter")
    sf.set_defaults(fn=planning.cmd_serve_flags)
    args = ap.parse_args(argv)
    sys.exit(args.fn(args))


if __name__ == "__main__":
    main()
