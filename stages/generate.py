"""Stage `generate@<part>`: self-distillation. With generate.enabled the target's own answers
replace the assistant turns (greedy when temperature is 0); otherwise the part passes through.

    python -m stages.generate <part>   (params: generate.*; in: data/parts/<part>.jsonl,
                                        out: data/generated/<part>.jsonl)
"""
import argparse
import logging
import shutil
from pathlib import Path

from eaglenest.conversations import read_jsonl, write_jsonl
from eaglenest.errors import exit_on_error
from eaglenest.generate import regenerate
from eaglenest.target import load_model, load_target, load_tokenizer

from . import _params

log = logging.getLogger("stages.generate")


@exit_on_error
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part")
    args = ap.parse_args(argv)
    p = _params.load("generate")
    on_error = _params.load("tokenize").get("on_error", "fail")
    src, out = Path(f"data/parts/{args.part}.jsonl"), Path(f"data/generated/{args.part}.jsonl")
    convs, _ = read_jsonl(src, on_error=on_error)  # validate early, naming file and line
    if not p.get("enabled", False):
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, out)
        log.info("part %s: generate.enabled is false, passed through %d conversations", args.part, len(convs))
        return
    target = load_target(Path("data/target"))
    model = load_model(target, dtype=p.get("dtype", "bfloat16"), device=p.get("device", "cpu"))
    convs = regenerate(model, load_tokenizer(target), convs, int(p["max_new_tokens"]), float(p["temperature"]),
                       int(p["batch_size"]), int(p["max_turns"]), int(p.get("seed", 0)))
    write_jsonl(convs, out)
    log.info("part %s: regenerated the assistant turns of %d conversations", args.part, len(convs))


if __name__ == "__main__":
    main()
