"""checksums.json, the commit of a store: the digest of each metadata file (the group's and each array's
zarr.json, index.parquet), written last and durably, and checked on every open."""

import json
from pathlib import Path

from eaglenest.files.atomic import write_json
from eaglenest.files.hashing import content_digest
from eaglenest.runtime.errors import EaglenestError
from eaglenest.store import states as state_format

INDEX = "index.parquet"
CHECKSUMS = "checksums.json"
RESTORE = "restore the store (`dvc checkout`) or extract the part again"


def metadata_files(states: str) -> list[str]:
    arrays = ["input_ids", *state_format.arrays(states, 0, 0)]
    return ["zarr.json", *(f"{n}/zarr.json" for n in arrays), INDEX]


def states_of(attrs: dict) -> str:
    """The state format a store's attributes declare (bf16 for stores made before `store.states`)."""
    return attrs.get("layout", {}).get("states", "bf16")


def _states(path: Path) -> str:
    return states_of(json.loads((Path(path) / "zarr.json").read_text())["attributes"])


def write_checksums(path: Path) -> None:
    """Commit a finished store: digests of its metadata files, written last and durably."""
    write_json(
        Path(path) / CHECKSUMS,
        {f: content_digest((Path(path) / f).read_bytes()) for f in metadata_files(_states(path))},
        durable=True,
    )


def check_checksums(path: Path) -> None:
    path = Path(path)
    if not (path / CHECKSUMS).is_file():
        raise EaglenestError(f"{path}/{CHECKSUMS}: missing: the store was never committed (half-written?); {RESTORE}")
    try:
        expected = json.loads((path / CHECKSUMS).read_text())
    except ValueError as e:
        raise EaglenestError(f"{path}/{CHECKSUMS}: corrupt ({e})") from None

    def check(f: str) -> None:
        if not (path / f).is_file():
            raise EaglenestError(f"{path}/{f}: missing; {RESTORE}")
        if content_digest((path / f).read_bytes()) != expected.get(f):
            raise EaglenestError(f"{path}/{f}: metadata checksum mismatch (corrupt or edited file)")

    check("zarr.json")  # first: it names the state format, hence the other files
    for f in metadata_files(_states(path))[1:]:
        check(f)
