"""The exported drafter in a real serving engine: `eaglenest.serving.check` on MT-bench first turns,
the engine's own tau and acceptance beside the offline decoder's, lossless against the engine's own
plain greedy run. vLLM (`make vllm-env`) drafts chains; SGLang (`make sglang-env`) drafts chains
and trees (on a CPU through eaglenest's kernel stand-in, sglang_patch/standins). Not a DVC stage
(each engine has its own environment); run it after `dvc repro`.

    python -m stages.serve_check [--engine vllm|sglang] [--k 3 | --tree 5,4,8] [--questions 80]
                                 [--max-new-tokens 64]
Writes reports/serve_<engine>.json (a tree: reports/serve_sglang_tree-5x4x8.json); server logs in
.eaglenest/serve/.
"""

import argparse
import json
import logging
from pathlib import Path

from eaglenest.decoding.modes import mode_key
from eaglenest.decoding.tree import TreeShape
from eaglenest.evaluate import mtbench_prompts
from eaglenest.files.atomic import replaced_file
from eaglenest.runtime.errors import EaglenestError, exit_on_error
from eaglenest.serving.check import serve_check
from eaglenest.serving.sglang import SGLANG_PYTHON, SGLang
from eaglenest.serving.vllm import VLLM, VLLM_PYTHON
from eaglenest.target.directory import load_target

from . import _params
from . import _paths as paths

log = logging.getLogger("stages.serve_check")


def tree_arg(text: str) -> TreeShape:
    try:
        return TreeShape(*(int(x) for x in text.split(",")))
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"--tree {text!r}: steps,topk,tokens, e.g. 5,4,8 ({e})") from None


@exit_on_error
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["vllm", "sglang"], default="vllm")
    ap.add_argument("--drafter", type=Path, default=paths.DRAFTER, help="an exported drafter directory")
    ap.add_argument("--target", type=Path, default=paths.TARGET, help="the materialised target")
    ap.add_argument("--questions", type=int, default=80, help="MT-bench first turns")
    shape = ap.add_mutually_exclusive_group()
    shape.add_argument("--k", type=int, help="a chain of k drafts (default: the first of params.yaml evaluate.k)")
    shape.add_argument("--tree", type=tree_arg, help="a draft tree: steps,topk,tokens (SGLang's defaults: 5,4,8)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--python", type=Path, help="the engine environment's interpreter (default: .venv-<engine>)")
    ap.add_argument("--out", type=Path, help="the report (default: reports/serve_<engine>[_<tree>].json)")
    a = ap.parse_args(argv)
    mode = a.tree or a.k
    if mode is None:
        ks = _params.load("evaluate")["k"]
        mode = ks[0] if isinstance(ks, list) else ks
    if a.engine == "vllm":
        engine = VLLM(a.python or VLLM_PYTHON)
    else:
        engine = SGLang(a.python or SGLANG_PYTHON)
    out = a.out or paths.report(f"serve_{a.engine}" + (f"_{mode_key(mode)}" if a.tree else ""))
    if not (a.drafter / "config.json").is_file():
        raise EaglenestError(f"{a.drafter}: no exported drafter (config.json); run `dvc repro train` first")
    metrics, per_q = serve_check(engine, load_target(a.target), a.drafter, mtbench_prompts(a.questions), mode,
                                 a.max_new_tokens)  # fmt: skip
    with replaced_file(out) as tmp:
        tmp.write_text(json.dumps({**metrics, "per_question": per_q}, indent=1) + "\n")
    log.info(
        "%s tau %.3f vs offline %.3f, %s (%d questions x %d tokens); %d/%d identical to greedy",
        a.engine,
        metrics["tau_engine"],
        metrics["tau_offline"],
        metrics["mode"],
        metrics["questions"],
        a.max_new_tokens,
        metrics["identical_to_greedy"],
        metrics["questions"],
    )


if __name__ == "__main__":
    main()
