"""Where the stages read and write, relative to the repository root: the one home of the data layout
that dvc.yaml declares as deps and outs (tests/test_paths.py checks that the two agree)."""

from pathlib import Path

TARGET = Path("data/target")
PACKED = Path("data/packed")
DRAFTER = Path("data/drafter")
HIDDEN = Path("data/hidden")
TOKENIZED = Path("data/tokenized")
DIGESTS = Path(".eaglenest/digests.json")  # the target's file digests by stat (not a DVC output: a cache)


def part(name: str) -> Path:
    """A conversations part: cut from ShareGPT, or a user's JSONL tracked with `dvc add`."""
    return Path(f"data/parts/{name}.jsonl")


def generated(name: str) -> Path:
    return Path(f"data/generated/{name}.jsonl")


def tokenized(name: str) -> Path:
    return TOKENIZED / f"{name}.parquet"


def hidden(name: str) -> Path:
    return HIDDEN / name


def metrics(stage: str, name: str | None = None, ext: str = "json") -> Path:
    """metrics/<stage>.json, or metrics/<stage>/<part>.json for a per-part stage."""
    return Path("metrics", stage, f"{name}.{ext}") if name else Path("metrics", f"{stage}.{ext}")


def report(stage: str, name: str) -> Path:
    """A per-part stage's full figures, beside its headline metrics."""
    return Path("reports", stage, f"{name}.json")
