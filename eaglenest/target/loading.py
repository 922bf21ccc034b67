"""Loading the target's model, tokenizer and shared heads with transformers, on a chosen device."""

import threading

from eaglenest.target.directory import Target


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
