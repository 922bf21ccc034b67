"""Versioning benchmark. Not a test: figures go to bench/RESULTS.md.

    python -m bench.versioning [--parts 10] [--per-part 12]

In a scratch clone (bench/out/versioning) with N small ShareGPT parts it measures:
  - full extraction of N parts (`dvc repro` up to extract) vs adding one more part of the same size
  - no-op `dvc repro` and `dvc status`
  - `dvc push` / `dvc pull` of the stores to a real sshd on 127.0.0.1 (MB/s), files per GB stored
"""

import argparse
import json
import shutil
import time
from pathlib import Path

from tests.conftest import commit, make_clone, ran, sh, tiny_params, write_params
from tests.servers import SSHServer

OUT = Path("bench/out/versioning").resolve()


def timed(cmd, cwd, **kw):
    t = time.time()
    p = sh(cmd, cwd, **kw)
    return time.time() - t, p.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", type=int, default=10)
    ap.add_argument("--per-part", type=int, default=12)
    args = ap.parse_args()
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    names = [f"b{i:02d}" for i in range(args.parts + 1)]
    params = tiny_params(names[:-1], per_part=args.per_part)
    params["tokenize"]["max_seq_len"] = 512
    params["store"].update(chunk_mb=1, shard_mb=128)
    repo = make_clone(OUT / "a", params)
    sh("dvc repro target", repo)
    extracts = " ".join(f"extract@{n}" for n in names[:-1])
    full_s, _ = timed(f"dvc repro {extracts}", repo)
    commit(repo, "full")
    params_more = tiny_params(names, per_part=args.per_part)
    params_more["tokenize"]["max_seq_len"] = 512
    params_more["store"].update(chunk_mb=1, shard_mb=128)
    write_params(repo, params_more)
    add_s, out = timed(f"dvc repro extract@{names[-1]}", repo)
    assert ran(out) == {
        f"sharegpt@{names[-1]}",
        f"generate@{names[-1]}",
        f"tokenize@{names[-1]}",
        f"extract@{names[-1]}",
    }, out
    commit(repo, "one more part")
    noop = min(timed("dvc repro " + " ".join(f"extract@{n}" for n in names), repo)[0] for _ in range(3))
    status = min(timed("dvc status", repo)[0] for _ in range(3))

    stored = sum(p.stat().st_size for p in (repo / "data/hidden").rglob("*") if p.is_file())
    files = sum(1 for p in (repo / "data/hidden").rglob("*") if p.is_file())
    server = SSHServer(OUT)
    try:
        (OUT / "remote").mkdir()
        sh(f"dvc remote add -d shared {server.url(OUT / 'remote')}", repo)
        sh(f"dvc remote modify --local shared keyfile {server.key}", repo)
        commit(repo, "remote")
        push_s, _ = timed("dvc push", repo)
        b = OUT / "b"
        sh(f"git clone -q {repo} {b}", OUT)
        sh(f"dvc remote modify --local shared keyfile {server.key}", b)
        pull_s, _ = timed("dvc pull " + " ".join(f"data/hidden/{n}" for n in names), b)
    finally:
        server.stop()
    pushed = sum(p.stat().st_size for p in (OUT / "remote").rglob("*") if p.is_file())
    res = {
        "parts": args.parts,
        "per_part": args.per_part,
        "full_extract_s": round(full_s, 1),
        "add_one_part_s": round(add_s, 1),
        "add_vs_full_ratio": round(add_s / full_s, 3),
        "noop_repro_s": round(noop, 2),
        "dvc_status_s": round(status, 2),
        "stored_MB": round(stored / 1e6, 1),
        "store_files": files,
        "files_per_GB": round(files / (stored / 1e9), 1),
        "push_s": round(push_s, 2),
        "push_MB_s": round(pushed / 1e6 / push_s, 1),
        "pull_s": round(pull_s, 2),
        "pull_MB_s": round(pushed / 1e6 / pull_s, 1),
    }
    print(json.dumps(res, indent=2))
    (OUT.parent / "versioning.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
