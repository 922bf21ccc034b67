"""`dvc status` over four parts, as store bytes grow. Not a test.

    python -m bench.dvc_status_parts [--sizes 80 320] [--files 115]

For each size (ShareGPT conversations a part) a scratch clone (bench/out/dvc_status_parts/<size>)
runs the real pipeline up to pack for four parts (sharegpt, tokenize, extract, teacher, pack), then
times `dvc status pack` (every per-part stage and pack):
  - warm: in the clone that ran the stages, clean, best of 3;
  - after checkout: in a `git clone` of it sharing its DVC cache, after `dvc checkout --with-deps
    pack`, the first `dvc status` (a teammate's or another machine's first look), then the next.

`store.shard_mb` is set from each arm's token counts so that every store holds at least `--files`
files, the count of a quarter of the GPU profile's fp8 stores (4.65 GB in 128 MB shards: ~36 pieces
x 3 arrays + 6); whole samples per piece make it more. The arms differ 4x in bytes: if status does
not grow with them, bytes are not what it costs. JSON: bench/results/dvc_status_parts.json.
"""

import argparse
import json
import shutil
from pathlib import Path

from bench.versioning import timed
from tests.conftest import commit, make_clone, sh, tiny_params, write_params

OUT = Path("bench/out/dvc_status_parts").resolve()
PARTS = [f"sharegpt-q{i}" for i in range(4)]
ROW_BYTES = 576 * 2 * 4 + 4  # a token in a SmolLM2-135M bf16 store: three taps, the final state, its id
STATUS = "dvc status pack"  # every per-part stage and pack; train and evaluate are not run here


def store_files(repo: Path) -> tuple[int, int]:
    files = [p for p in (repo / "data/hidden").rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def arm(size: int, files: int) -> dict:
    root = OUT / str(size)
    root.mkdir(parents=True)
    params = tiny_params(PARTS, per_part=size, local_target=True)
    params["tokenize"]["max_seq_len"] = 512
    repo = make_clone(root / "a", params)
    sh("dvc repro " + " ".join(f"tokenize@{p}" for p in PARTS), repo)
    # shard_mb from the parts' own token counts: every store holds at least `files` files
    tokens = max(json.loads((repo / f"reports/tokenize/{p}.json").read_text())["tokens"] for p in PARTS)
    pieces = max(1, (files - 6) // 3)
    params["store"].update(chunk_mb=0.25, shard_mb=round(tokens * ROW_BYTES / pieces / 2**20, 3))
    write_params(repo, params)
    commit(repo, "shard size")
    repro_s, _ = timed("dvc repro pack", repo)
    commit(repo, "four parts")
    out = sh(STATUS, repo).stdout
    assert "up to date" in out, out
    warm = [timed(STATUS, repo)[0] for _ in range(3)]
    n_files, n_bytes = store_files(repo)

    b = root / "b"
    sh(f"git clone -q {repo} {b}", root)
    sh(f"dvc cache dir --local {repo / '.dvc/cache'}", b)
    checkout_s, _ = timed("dvc checkout --with-deps pack", b)
    first_s, out = timed(STATUS, b)
    assert "up to date" in out, out
    second_s, _ = timed(STATUS, b)
    return {
        "conversations_a_part": size,
        "shard_mb": params["store"]["shard_mb"],
        "store_files": n_files,
        "store_MB": round(n_bytes / 1e6, 1),
        "repro_to_pack_s": round(repro_s, 1),
        "status_warm_s": round(min(warm), 2),
        "status_warm_all_s": [round(t, 2) for t in warm],
        "checkout_s": round(checkout_s, 2),
        "status_after_checkout_first_s": round(first_s, 2),
        "status_after_checkout_next_s": round(second_s, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[80, 320], help="conversations a part, one arm each")
    ap.add_argument("--files", type=int, default=115, help="files a store should hold (shard_mb is set for it)")
    args = ap.parse_args()
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    arms = []
    for size in args.sizes:
        arms.append(arm(size, args.files))
        print(json.dumps(arms[-1]), flush=True)
    res = {"parts": len(PARTS), "status_command": STATUS, "arms": arms}
    (Path("bench/results") / "dvc_status_parts.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    shutil.rmtree(OUT, ignore_errors=True)


if __name__ == "__main__":
    main()
