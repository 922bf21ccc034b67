"""Where the stages read and write, relative to the repository root: the one home of the data layout
that dvc.yaml declares as deps and outs (tests/test_paths.py checks that the two agree)."""

import argparse
from pathlib import Path

from eaglenest.files.names import plain_name
from eaglenest.runtime.errors import EaglenestError

TARGET = Path("data/target")
PACKED = Path("data/packed")
DRAFTER = Path("data/drafter")
HIDDEN = Path("data/hidden")
TOKENIZED = Path("data/tokenized")
TEACHER = Path("data/teacher")
TRAIN_CKPT = Path(".eaglenest/train")  # train's checkpoints: outside DVC's outputs, they outlive a failed run
DIGESTS = Path(".eaglenest/digests.json")  # the target's file digests by stat (not a DVC output: a cache)


def part_name(name: str) -> str:
    """argparse's type for a stage's part argument: a plain name, checked before any work."""
    try:
        return plain_name(name, "part")
    except EaglenestError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def part(name: str) -> Path:
    """A conversations part: cut from ShareGPT, or a user's JSONL tracked with `dvc add`."""
    return Path(f"data/parts/{plain_name(name, 'part')}.jsonl")


def generated(name: str) -> Path:
    return Path(f"data/generated/{plain_name(name, 'part')}.jsonl")


def tokenized(name: str) -> Path:
    return TOKENIZED / f"{plain_name(name, 'part')}.parquet"


def hidden(name: str) -> Path:
    return HIDDEN / plain_name(name, "part")


def teacher(name: str) -> Path:
    """A part's teacher argmax (stages/teacher.py): what pack needs of its states."""
    return TEACHER / plain_name(name, "part")


def metrics(stage: str, ext: str = "json") -> Path:
    """metrics/<stage>.json: a stage's headline figures, in git (`cache: false`), the columns of
    `dvc metrics show`; made only by whole-pipeline stages, so a fresh clone reads every one."""
    return Path("metrics", f"{stage}.{ext}")


def report(stage: str, name: str | None = None) -> Path:
    """Every figure a stage computed that the same machine kind computes again, byte for byte:
    reports/<stage>.json (in git), or reports/<stage>/<part>.json for a per-part stage (a cached
    output like its data, so DVC's run-cache can restore the part on another machine)."""
    return Path("reports", stage, f"{plain_name(name, 'part')}.json") if name else Path("reports", f"{stage}.json")


def timing(stage: str, name: str | None = None) -> Path:
    """reports/timing/<stage>[/<part>].json: wall clock and throughput, which differ on every run.
    Neither in git nor a DVC output, so neither `dvc.lock` nor `dvc metrics diff` sees them (read
    them with `dvc metrics show reports/timing/<stage>.json`)."""
    if name:
        return Path("reports", "timing", stage, f"{plain_name(name, 'part')}.json")
    return Path("reports", "timing", f"{stage}.json")
