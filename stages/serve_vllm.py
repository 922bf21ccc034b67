"""The exported drafter in vLLM (`make vllm-env`): `eaglenest.serve_check` on MT-bench first turns,
vLLM's own tau and acceptance beside the offline decoder's, lossless against vLLM's plain greedy run.
Not a DVC stage (it needs the vLLM environment); run it after `dvc repro`.

    python -m stages.serve_vllm [--questions 80] [--k 3] [--max-new-tokens 64]
Writes reports/serve_vllm.json; server logs in .eaglenest/serve/.
"""

import argparse
import json
import logging
from pathlib import Path

from eaglenest.errors import EaglenestError, exit_on_error
from eaglenest.evaluate import mtbench_prompts
from eaglenest.serve_check import VLLM_PYTHON, serve_check
from eaglenest.target import load_target

from . import _params
from . import _paths as paths

log = logging.getLogger("stages.serve_vllm")


@exit_on_error
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", type=Path, default=paths.DRAFTER, help="an exported drafter directory")
    ap.add_argument("--target", type=Path, default=paths.TARGET, help="the materialised target")
    ap.add_argument("--questions", type=int, default=80, help="MT-bench first turns")
    ap.add_argument("--k", type=int, help="draft tokens (default: the first of params.yaml evaluate.k)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--python", type=Path, default=VLLM_PYTHON, help="the vLLM environment's interpreter")
    ap.add_argument("--out", type=Path, default=paths.report("serve_vllm"))
    a = ap.parse_args(argv)
    if a.k is None:
        ks = _params.load("evaluate")["k"]
        a.k = ks[0] if isinstance(ks, list) else ks
    if not (a.drafter / "config.json").is_file():
        raise EaglenestError(f"{a.drafter}: no exported drafter (config.json); run `dvc repro train` first")
    metrics, per_q = serve_check(load_target(a.target), a.drafter, mtbench_prompts(a.questions), a.k, a.max_new_tokens,
                                 a.python)  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({**metrics, "per_question": per_q}, indent=1) + "\n")
    log.info(
        "vLLM tau %.3f vs offline %.3f at k=%d (%d questions x %d tokens); %d/%d identical to greedy",
        metrics["tau_engine"],
        metrics["tau_offline"],
        a.k,
        metrics["questions"],
        a.max_new_tokens,
        metrics["identical_to_greedy"],
        metrics["questions"],
    )


if __name__ == "__main__":
    main()
