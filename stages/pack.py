"""Stage `pack`: every part's store -> draft vocabulary + train/val shards (data/packed).

python -m stages.pack      (params: data.parts, pack.draft_vocab_size, pack.val_fraction, pack.shard_mb;
                            untracked: pack.device, where the teacher's argmax over the vocabulary is
                            computed, and pack.workers, processes writing shards: auto = cores, max 16)
"""

import argparse

from eaglenest.atomic import write_json
from eaglenest.data.pack import pack
from eaglenest.errors import exit_on_error
from eaglenest.target import load_heads, load_target, pick_device

from . import _params
from . import _paths as paths


@exit_on_error
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    params = _params.load()
    p = params["pack"]
    target = load_target(paths.TARGET)
    metrics = pack(
        params["data"]["parts"],
        paths.HIDDEN,
        paths.TOKENIZED,
        paths.PACKED,
        lm_head=load_heads(target)["lm_head"],
        draft_vocab_size=int(p["draft_vocab_size"]),
        val_fraction=float(p["val_fraction"]),
        shard_mb=float(p["shard_mb"]),
        progress=not args.no_progress,
        device=pick_device(p["device"]),
        workers=_params.workers(p["workers"]),
    )
    write_json(paths.metrics("pack"), metrics)


if __name__ == "__main__":
    main()
