"""The commands that come before work: plan (bytes), profile (params overrides), serve-flags."""

import json
from pathlib import Path

from eaglenest.cli.stores import directory
from eaglenest.files.names import plain_name
from eaglenest.runtime.errors import EaglenestError


def cmd_plan(args) -> int:
    from eaglenest import disk_plan
    from eaglenest.files.sizes import size

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
    from eaglenest.files.names import load_yaml

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
    need = out["stores_bytes"] + out["pack_bytes"] + out["teacher_bytes"] + out["dvc_cache_bytes"]
    print(f"  the outputs {'fit' if need <= out['free_bytes'] else 'DO NOT fit'} the free space on data/")
    w, gpu = out["target_bf16_bytes"], out["gpu_bytes"]
    fits = "no GPU here" if gpu is None else f"{'fits' if w <= 0.9 * gpu else 'DOES NOT fit'} the GPU's {size(gpu)}"
    print(f"  {'target weights':24s} {'':19s}         {size(out['target_weights_bytes']):>9}   as stored; in bf16 "
          f"{size(w)}: {fits}")  # fmt: skip
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
    from eaglenest.serving.flags import flags, read_timing

    timing = read_timing(args.timing)
    print(f"# from {args.timing} (batch 1 on the device evaluate ran on)")
    for what, cmd in flags(timing, args.target, args.drafter):
        print(f"# {what}\n{cmd}")
    return 0
