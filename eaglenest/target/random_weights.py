"""Tiny random-weight targets of other architectures, from transformers' own configs and a tokenizer
already on disk (the built-in target's), for runs where no such model can be downloaded:

    python -m eaglenest.target.random_weights deepseek-v3 data/targets/dsv3 --tokenizer data/target/model

then `target.path: data/targets/dsv3` in params.yaml; or `target.path: random:deepseek-v3[:v2-lite]`,
which the `target` stage builds itself (seed 0, the built-in target's tokenizer, on a GPU if there is
one; `WIDTHS`: a real width). The weights are random (seeded): the states
and drafters they give exercise the pipeline and the gate, not a language model's quality."""

import argparse
import json
import shutil
from pathlib import Path

from eaglenest.files.atomic import replaced_dir
from eaglenest.runtime.errors import EaglenestError, exit_on_error
from eaglenest.target.files import TOKENIZER_FILES

DEEPSEEK_V3_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
                    "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
SMALL = {"hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4, "max_position_embeddings": 4096}
ARCHITECTURES = {
    # name: (config class, its fields beyond SMALL)
    # head_dim 64: a size vLLM's CPU attention kernels take
    "llama": ("LlamaConfig", {"intermediate_size": 128, "num_key_value_heads": 2, "head_dim": 64}),
    "gemma3": ("Gemma3TextConfig", {"intermediate_size": 128, "num_key_value_heads": 2, "head_dim": 16,
                                    "sliding_window": 64}),
    "qwen3-moe": ("Qwen3MoeConfig", {"intermediate_size": 128, "moe_intermediate_size": 32, "num_key_value_heads": 2,
                                     "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2}),
    "mixtral": ("MixtralConfig", {"intermediate_size": 64, "num_key_value_heads": 2, "num_local_experts": 8,
                                  "num_experts_per_tok": 2}),
    # MLA attention, one shared and 8 routed experts in 2 groups, the first layer dense (DeepSeek-V3's shape);
    # its YaRN rope and the config.json fields engines read (SGLang: moe_layer_freq; a CPU server runs MLA
    # with YaRN rope only)
    "deepseek-v3": ("DeepseekV3Config", {"intermediate_size": 128, "moe_intermediate_size": 32,
                                         "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1,
                                         "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
                                         "first_k_dense_replace": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
                                         "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
                                         "max_position_embeddings": 163840, "rope_parameters": DEEPSEEK_V3_ROPE,
                                         "moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}),
}  # fmt: skip
# Real widths over an architecture's tiny shape. v2-lite: DeepSeek-V2-Lite's size with V3's router,
# 15.7B parameters, 2.28B active (bench/RESULTS.md, "A mixture of experts at real width").
WIDTHS = {
    ("deepseek-v3", "v2-lite"): {"hidden_size": 2048, "num_hidden_layers": 27, "intermediate_size": 10944,
                                 "moe_intermediate_size": 1408, "num_attention_heads": 16, "num_key_value_heads": 16,
                                 "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2, "n_group": 8,
                                 "topk_group": 4, "first_k_dense_replace": 1, "q_lora_rank": 1536,
                                 "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                                 "v_head_dim": 128, "vocab_size": 102400},
}  # fmt: skip


def parse_spec(spec: str) -> tuple[str, dict]:
    """`random:<arch>[:<width>]` (target.path) -> (arch, config fields over the tiny shape)."""
    arch, _, width = spec.removeprefix("random:").partition(":")
    if arch not in ARCHITECTURES:
        raise EaglenestError(f"target.path {spec!r}: architecture {arch!r} is not one of {', '.join(ARCHITECTURES)}")
    if width and (arch, width) not in WIDTHS:
        known = ", ".join(f"random:{a}:{w}" for a, w in WIDTHS) or "none"
        raise EaglenestError(f"target.path {spec!r}: no width {width!r} for {arch} (known: {known})")
    return arch, dict(WIDTHS.get((arch, width), {}))


def build(
    arch: str,
    out: Path,
    tokenizer_dir: Path,
    seed: int = 0,
    max_shard_size: str = "5MB",
    overrides: dict | None = None,
    device: str = "cpu",
) -> Path:
    """A random `arch` target with the tokenizer (and chat template) of `tokenizer_dir`, saved as
    sharded safetensors with an index (as large checkpoints are) in `out`. `overrides`: config fields
    over the tiny shape (a real width: hidden_size, n_routed_experts, ...); `device`: where the
    weights are drawn (a GPU draws a 16B model in seconds, in bf16 directly)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if arch not in ARCHITECTURES:
        raise EaglenestError(f"architecture {arch!r}: not one of {', '.join(ARCHITECTURES)}")
    tokenizer_dir = Path(tokenizer_dir)
    if not (tokenizer_dir / "tokenizer_config.json").is_file():
        raise EaglenestError(f"{tokenizer_dir}: no tokenizer_config.json (give a model directory with a tokenizer)")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    cls, fields = ARCHITECTURES[arch]
    shape = {**SMALL, **fields, "vocab_size": len(tok), **(overrides or {})}
    unknown = [k for k in overrides or {} if not hasattr(getattr(transformers, cls)(), k)]
    if unknown:
        raise EaglenestError(f"{arch}: {cls} has no field {', '.join(unknown)}")
    if shape["vocab_size"] < len(tok):
        raise EaglenestError(f"vocab_size {shape['vocab_size']} < the tokenizer's {len(tok)} tokens")
    config = getattr(transformers, cls)(
        **shape,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    if device == "cpu":
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(torch.bfloat16)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with replaced_dir(Path(out)) as tmp:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, tmp / name)
        for name in ("generation_config.json",):  # the end-of-turn ids evaluate stops at
            if (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, tmp / name)
    return Path(out)


@exit_on_error
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("arch", choices=sorted(ARCHITECTURES))
    ap.add_argument("out", type=Path, help="the model directory to write (replaced whole)")
    ap.add_argument("--tokenizer", type=Path, default=Path("data/target/model"),
                    help="a model directory whose tokenizer and chat template the target takes (default: the "
                    "built-in target's, after `dvc repro target`)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="FIELD=JSON",
                    help="a config field over the tiny shape, e.g. --set hidden_size=2048 (again for more)")  # noqa: E501  # fmt: skip
    ap.add_argument("--device", default="cpu", help="where the weights are drawn: cpu, or cuda for a large target")
    ap.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (default 5GB)")
    args = ap.parse_args(argv)
    overrides = {}
    for s in args.sets:
        key, sep, value = s.partition("=")
        try:
            overrides[key] = json.loads(value)
        except ValueError:
            raise EaglenestError(f"--set {s!r}: expected FIELD=<JSON value>, e.g. hidden_size=2048") from None
        if not sep or not key:
            raise EaglenestError(f"--set {s!r}: expected FIELD=<JSON value>")
    print(build(args.arch, args.out, args.tokenizer, args.seed, args.max_shard_size, overrides, args.device))


if __name__ == "__main__":
    main()
