"""Bytes before work (docs/design.md: Disk plan): what a part's store, pack (an index into the
stores: no state copied) and the DVC cache will take, from token counts and the target's shape
alone, and a refusal to start what the disk cannot hold. A store holds per token (taps + 1) x hidden
states (`store.states`: bf16 2 bytes each; fp8 1 and a float32 scale per tap), zstd-compressed by
the ratio of the stores already written in that format (`ratio_of`), or by none (DEFAULT_RATIO)
before the first."""

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eaglenest.files.sizes import size
from eaglenest.runtime.errors import EaglenestError
from eaglenest.store import states as state_format

DEFAULT_RATIO = 1.0  # no compression assumed before a store of the format exists to measure it by
PACK_TOKEN_BYTES = 6  # pack's per-token arrays (input id, loss mask, in-vocabulary): no state is copied
PACK_SAMPLE_BYTES = 100  # per sample: its row of pack's index and its offset
TEACHER_TOKEN_BYTES = 4  # the teacher's argmax per token (int32, data/teacher/<part>)


def row_bytes(states: str, n_aux: int, hidden: int) -> int:
    """One token's stored bytes, uncompressed."""
    return sum(int(np.prod(shape)) * dt.itemsize for shape, dt in state_format.arrays(states, n_aux, hidden).values())


@dataclass(frozen=True)
class Shape:
    """What the bytes depend on: the target's width, the taps, the stored format."""

    hidden: int
    n_aux: int
    states: str

    @classmethod
    def from_config(cls, config_json: Path, n_aux: int, states: str) -> "Shape":
        try:
            cfg = json.loads(Path(config_json).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise EaglenestError(f"{config_json}: not a readable config.json ({e})") from None
        cfg = cfg.get("text_config", cfg)
        if "hidden_size" not in cfg:
            raise EaglenestError(f"{config_json}: no hidden_size")
        return cls(int(cfg["hidden_size"]), n_aux, state_format.check(states))

    @property
    def row(self) -> int:
        return row_bytes(self.states, self.n_aux, self.hidden)


def store_bytes(tokens: int, shape: Shape, ratio: float = DEFAULT_RATIO) -> int:
    return int(tokens * shape.row / ratio)


def pack_bytes(tokens: int, samples: int = 0) -> int:
    """pack writes the tokens, masks and an index into the stores; the states stay in the stores."""
    return tokens * PACK_TOKEN_BYTES + samples * PACK_SAMPLE_BYTES


def ratio_of(stores_root: Path, states: str) -> tuple[float, str]:
    """Raw over stored bytes across the committed stores of `states` under stores_root, and where
    the figure comes from."""
    from eaglenest.store.hidden_store import HiddenStore

    raw = stored = 0
    found = []
    for path in sorted(Path(stores_root).glob("*/zarr.json")):
        try:
            store = HiddenStore(path.parent, check_metadata=False)
        except EaglenestError:
            continue  # not a committed store: nothing to measure
        if store.states != states:
            continue
        raw += store.n_tokens * row_bytes(states, len(store.attrs["taps"]), store.attrs["hidden_size"])
        stored += sum(f.stat().st_size for f in store.path.rglob("*") if f.is_file())
        found.append(store.part)
    if not stored:
        return DEFAULT_RATIO, f"no {states} store yet: none assumed"
    return raw / stored, f"measured on {', '.join(found)}"


def written(work_root: Path, part: str) -> int:
    """Bytes the part's work dirs already hold (a resume needs only the rest)."""
    return sum(f.stat().st_size for d in Path(work_root).glob(f"{part}-*") for f in d.rglob("*") if f.is_file())


def _filesystem(path: Path) -> tuple[int, Path]:
    """(device id, the nearest existing ancestor) of a path that may not exist yet."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return os.stat(path).st_dev, path


def check_space(part: str, need: int, paths: list[Path], reserve: int) -> None:
    """Refuse (one line: the part, the estimate, the free space) when a filesystem that one of
    `paths` lies on cannot hold `need` bytes plus `reserve`."""
    for _dev, where in {_filesystem(p)[0]: _filesystem(p)[1] for p in paths}.items():
        free = shutil.disk_usage(where).free
        if need + reserve > free:
            raise EaglenestError(
                f"part {part}: its store needs ~{size(need)} (+ {size(reserve)} reserve) but {where} has "
                f"{size(free)} free; nothing started (free space, or move extract.work_dir / data/hidden)"
            )


def dvc_cache_copies(repo: Path) -> bool:
    """Whether DVC's cache holds a second copy of every output (cache.type copy, DVC's default)
    rather than links to one (hardlink, symlink, reflink)."""
    config = Path(repo) / ".dvc" / "config"
    text = config.read_text() if config.is_file() else ""
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "type":
            return "copy" in value
    return True


def for_config(config_json: Path, tokens: int, n_aux: int = 3, ratio: float = DEFAULT_RATIO) -> dict:
    """Every format's store and pack bytes for a target known only by its config.json."""
    out = {}
    for states in state_format.FORMATS:
        shape = Shape.from_config(config_json, n_aux, states)
        out[states] = {"row_bytes": shape.row, "store_bytes": store_bytes(tokens, shape, ratio),
                       "pack_bytes": pack_bytes(tokens), "teacher_bytes": tokens * TEACHER_TOKEN_BYTES}  # fmt: skip
    return out


def for_params(params: dict, repo: Path) -> dict:
    """Every part of the current params: its tokens (once tokenized) and store bytes; pack; the DVC
    cache; the free space; the extraction time at the rate this machine measured, if it has."""
    from eaglenest.extraction.plan import sample_count, token_count
    from eaglenest.target.directory import load_target
    from eaglenest.target.taps import resolve_taps

    repo = Path(repo)
    target = load_target(repo / "data" / "target")
    states = params["store"]["states"]
    shape = Shape(target.hidden_size, len(resolve_taps(params["extract"]["taps"], target.num_layers)), states)
    ratio, whence = ratio_of(repo / "data" / "hidden", states)
    parts = {}
    for part in params["data"]["parts"]:
        tokenized = repo / "data" / "tokenized" / f"{part}.parquet"
        tokens = token_count(tokenized) if tokenized.is_file() else None
        parts[part] = {"tokens": tokens, "store_bytes": None if tokens is None else store_bytes(tokens, shape, ratio),
                       "samples": sample_count(tokenized) if tokenized.is_file() else None}  # fmt: skip
    tokens = sum(p["tokens"] or 0 for p in parts.values())
    samples = sum(p["samples"] or 0 for p in parts.values())
    stores = sum(p["store_bytes"] or 0 for p in parts.values())
    rates = []
    for f in (repo / "reports" / "timing" / "extract").glob("*.json"):
        rate = json.loads(f.read_text()).get("tokens_per_s")
        rates += [rate] if rate else []
    stored, bf16 = target_weights(target.model_dir)
    return {
        "target_weights_bytes": stored,
        "target_bf16_bytes": bf16,  # the extraction's copy on a GPU
        "gpu_bytes": gpu_bytes(),
        "states": states,
        "row_bytes": shape.row,
        "compression_ratio": round(ratio, 3),
        "compression_from": whence,
        "parts": parts,
        "untokenized": [p for p, v in parts.items() if v["tokens"] is None],
        "stores_bytes": stores,
        "pack_bytes": pack_bytes(tokens, samples),
        "teacher_bytes": tokens * TEACHER_TOKEN_BYTES,
        "dvc_cache_bytes": stores + pack_bytes(tokens, samples) + tokens * TEACHER_TOKEN_BYTES
        if dvc_cache_copies(repo)
        else 0,
        "free_bytes": shutil.disk_usage(_filesystem(repo / "data")[1]).free,
        "extract_hours": round(tokens / (sum(rates) / len(rates)) / 3600, 2) if rates and tokens else None,
    }


def target_weights(model_dir: Path) -> tuple[int, int]:
    """The target's weight files as stored, and its tensors in bf16 (what the extraction's copy takes
    on a GPU): from the safetensors headers (a .bin file counts as stored)."""
    from eaglenest.target.files import WEIGHT_SUFFIXES, read_header

    stored = bf16 = 0
    for p in Path(model_dir).iterdir():
        if p.suffix not in WEIGHT_SUFFIXES:
            continue
        stored += p.stat().st_size
        if p.suffix != ".safetensors":
            bf16 += p.stat().st_size
            continue
        bf16 += sum(2 * int(np.prod(t["shape"])) for k, t in read_header(p)[0].items() if k != "__metadata__")
    return stored, bf16


def gpu_bytes() -> int | None:
    """The first GPU's memory, or None without one."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
