"""The states read from the stores give the batches the copies in pack's shards gave, bit for bit
(issue: states stored once). Not a test: the shard path it compares with is gone from the code; run
it against a checkout of the last commit that had it (ab0f517):

    git worktree add /tmp/old ab0f517
    python -m bench.batches_equal /tmp/old

It builds the tests' tiny target and two extracted parts with the old checkout's code, packs them
with each code base, and compares every collated batch of both splits over two epochs, plain
(bucket 0) and bucketed (32): every array, dtype and shape. Prints the count and exits 1 on any
difference."""

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DUMP = """
import sys
code, ws, out, kind = sys.argv[1:5]
sys.path.insert(0, code)
from pathlib import Path
import numpy as np
from eaglenest.data.pack import pack
from eaglenest.data.packed import PackedSplit, batch_shape, collate, epoch_batches
from eaglenest.target.loading import load_heads
from eaglenest.target.directory import load_target
ws = Path(ws)
target = load_target(ws / "data/target")
packed = ws / f"packed-{kind}"
if kind == "old":
    pack(["a", "b"], ws / "data/hidden", ws / "data/tokenized", packed, lm_head=load_heads(target)["lm_head"],
         draft_vocab_size=48, val_fraction=0.15, shard_mb=0.05, progress=False)
else:  # pack reads no state: the teacher's argmax per part first
    from eaglenest.data.teacher import teach_parts
    teach_parts(["a", "b"], ws / "data/hidden", ws / "data/tokenized", ws / "teacher", load_heads(target)["lm_head"],
                progress=False)
    pack(["a", "b"], ws / "data/hidden", ws / "data/tokenized", ws / "teacher", packed, 48, 0.15)
dump = {}
for name in ("train", "val"):
    split = PackedSplit(packed, name) if kind == "old" else PackedSplit(packed, name, ws / "data/hidden")
    for epoch in (0, 1):
        for bucket, budget in ((0, 240), (32, 256)):
            for n, b in enumerate(epoch_batches(split, epoch, 0, budget, bucket)):
                shape = batch_shape([split.length(i) for i in b], bucket, budget)
                for k, v in collate(split, b, shape).items():
                    dump[f"{name}/{epoch}/{bucket}/{n}/{k}"] = v.numpy()
np.savez(out, **dump)
"""
BUILD = """
import sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from tests.conftest import build_packed, make_tiny_target
root = Path(sys.argv[2])
build_packed(root / "ws", make_tiny_target(root / "tiny"))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", type=Path, help="a checkout of the code that packed copies of the states")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="batches-equal-"))
    try:
        subprocess.run([sys.executable, "-c", BUILD, str(args.old), str(tmp)], check=True, cwd=args.old)
        for code, kind in ((args.old, "old"), (REPO, "new")):
            subprocess.run([sys.executable, "-c", DUMP, str(code), str(tmp / "ws"), str(tmp / f"{kind}.npz"), kind],
                           check=True, cwd=code)  # fmt: skip
        old, new = np.load(tmp / "old.npz"), np.load(tmp / "new.npz")
        differ = sorted(set(old.files) ^ set(new.files))
        differ += [k for k in sorted(set(old.files) & set(new.files))
                   if old[k].dtype != new[k].dtype or not np.array_equal(old[k], new[k])]  # fmt: skip
        print(f"{len(old.files)} arrays compared, {len(differ)} differ" + (f": {differ[:5]}" if differ else ""))
        sys.exit(1 if differ else 0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
