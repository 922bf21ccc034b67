"""Stage `target`: materialise the target as a plain HF directory and record its fingerprint.

python -m stages.target            (params: target.path, target.dtype; out: data/target and
                                    reports/target.json: its fingerprint and shape)
"""

import argparse
from pathlib import Path

from eaglenest.files.atomic import write_json
from eaglenest.runtime.errors import exit_on_error
from eaglenest.target.directory import materialize

from . import _params
from . import _paths as paths


@exit_on_error
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(paths.TARGET), help="output directory (default: %(default)s)")
    ap.add_argument("--report", default=str(paths.report("target")))
    args = ap.parse_args(argv)
    p = _params.load("target")
    t = materialize(p["path"], Path(args.out), dtype=p["dtype"], digests=paths.DIGESTS)
    write_json(
        Path(args.report),
        {
            "fingerprint": t.fingerprint,
            "num_layers": t.num_layers,
            "hidden_size": t.hidden_size,
            "vocab_size": t.vocab_size,
            "spec": t.spec,
        },
    )


if __name__ == "__main__":
    main()
