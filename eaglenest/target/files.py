"""The files that make a target directory what it is: the fingerprint over them, and a check that each
weight file is whole before anything reads it."""

import json
from pathlib import Path

from eaglenest.files.hashing import DigestCache, sha256_text
from eaglenest.runtime.errors import EaglenestError

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def fingerprint(model_dir: Path, cache: DigestCache | None = None) -> str:
    """sha256 over config.json, the tokenizer files and each weight file's own sha256 (taken from
    `cache` when the file's stat is unchanged since it was hashed)."""
    model_dir = Path(model_dir)
    digest = (cache or DigestCache(None)).sha256
    if not (model_dir / "config.json").is_file():
        raise EaglenestError(f"{model_dir}: not a HF model directory (no config.json)")
    parts = [f"config.json={digest(model_dir / 'config.json')}"]
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            parts.append(f"{name}={digest(model_dir / name)}")
    weights = sorted(p for p in model_dir.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    if not weights:
        raise EaglenestError(f"{model_dir}: no weight files (*.safetensors / *.bin)")
    parts += [f"{p.name}={digest(p)}" for p in weights]
    return sha256_text(*parts)


# bytes per element of each safetensors dtype
SAFETENSORS_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
                      "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}  # fmt: skip


def check_weights(model_dir: Path) -> None:
    """Every weight file can be what its header says: a safetensors file's tensors (dtype x shape)
    fill exactly the bytes after its header; a .bin file is a whole zip archive. A truncated or
    corrupt file fails here, naming it, before it is fingerprinted and loaded."""
    import zipfile

    for path in sorted(p for p in Path(model_dir).iterdir() if p.suffix in WEIGHT_SUFFIXES):
        if path.suffix == ".bin":
            if not zipfile.is_zipfile(path):
                raise EaglenestError(f"{path}: not a whole PyTorch weight file (truncated or corrupt); copy it again")
            continue
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            try:
                if not 0 < n <= size - 8:
                    raise ValueError(f"a header of {n} bytes in a file of {size}")
                header = json.loads(f.read(n))
                ends = [_tensor_end(name, t) for name, t in header.items() if name != "__metadata__"]
            except (ValueError, TypeError, KeyError, AttributeError) as e:
                raise EaglenestError(f"{path}: not a valid safetensors file ({e}); copy it again") from None
        if 8 + n + max(ends, default=0) != size:
            raise EaglenestError(
                f"{path}: its header describes {8 + n + max(ends, default=0):,} bytes but the file has {size:,} "
                f"(truncated or corrupt); copy it again"
            )


def read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (tensor name -> dtype, shape, data_offsets) and where its data begins."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)), 8 + n


def _tensor_end(name: str, t: dict) -> int:
    begin, end = t["data_offsets"]
    count = 1
    for d in t["shape"]:
        count *= int(d)
    if t["dtype"] not in SAFETENSORS_DTYPES:
        raise ValueError(f"tensor {name}: unknown dtype {t['dtype']!r}")
    if end - begin != count * SAFETENSORS_DTYPES[t["dtype"]] or begin < 0:
        raise ValueError(f"tensor {name}: {t['dtype']} {t['shape']} does not fill bytes [{begin}, {end})")
    return int(end)
