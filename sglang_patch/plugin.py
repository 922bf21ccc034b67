"""SGLang plugin (entry point group `sglang.srt.plugins`, name `eaglenest_capture`).

SGLang runs `load_plugins()` in the main process and again in every scheduler process, so the
two hooks below reach each tensor-parallel worker without editing an installed file:
  1. AFTER ModelRunner.load_model: turn on the model's EAGLE-3 aux capture at our taps.
  2. AROUND LogitsProcessor.forward: in prefill (EXTEND) batches, write every client request's
     aux taps + final post-norm state to a capture file; the receipt goes back to the client
     through LogitsProcessorOutput.customized_info -> meta_info["hs_capture"].
The plugin is inert unless the launcher set EAGLENEST_CAPTURE_DIR (installing it changes nothing
for other servers in the same environment)."""

import logging
import os

from .capture import CaptureWriter, aux_rows, requests_in_batch
from .protocol import DEFAULT_RID_PREFIX, ENV_DIR, ENV_RID_PREFIX, ENV_TAPS, RECEIPT_KEY

log = logging.getLogger("sglang_patch")

_state: dict = {}  # per process: the writer once the model is loaded, the rid prefix


def parse_taps(text: str | None) -> list[int] | None:
    if not text or text == "auto":
        return None
    return [int(x) for x in text.split(",")]


def check_taps(taps: list[int], num_layers: int) -> None:
    # SGLang captures the residual stream entering layer v+1 for id v; the stream entering layer 0
    # has no residual yet and layer L's input is never reached, so taps live in [1, L-1].
    bad = [t for t in taps if not 1 <= t <= num_layers - 1]
    if bad or taps != sorted(set(taps)):
        raise ValueError(
            f"capture taps {taps}: must be distinct, ascending and in [1, {num_layers - 1}] "
            f"for this {num_layers}-layer model (bad: {bad})"
        )


VERBATIM_IDS = {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"}


def after_load_model(result, runner, *args, **kwargs):
    if getattr(runner, "is_draft_worker", False):
        return result
    model = runner.model
    if not hasattr(model, "set_eagle3_layers_to_capture"):
        raise RuntimeError(f"eaglenest capture: {type(model).__name__} has no EAGLE-3 aux capture in this SGLang")
    num_layers = model.config.num_hidden_layers
    taps = parse_taps(os.environ.get(ENV_TAPS))
    if taps is None:
        model.set_eagle3_layers_to_capture(None)
    else:
        check_taps(taps, num_layers)
        model.set_eagle3_layers_to_capture([t - 1 for t in taps])  # SGLang ids name a layer's OUTPUT
    inner = getattr(model, "model", None)
    effective = list(getattr(inner, "layers_to_capture", []) or [])
    if taps is not None and effective == [t - 1 for t in taps] and type(model).__name__ in VERBATIM_IDS:
        # DeepSeek-V2/V3 add one to the ids only when the first is 1 (the EAGLE-3 drafts' convention for
        # them) and otherwise capture the ids as given, yet their loop captures the stream entering
        # layer i as Llama's does: the taps are set as capture indices directly (the gate checks them)
        inner.layers_to_capture = effective = list(taps)
    if taps is not None and effective != taps:
        # SGLang's id rule has moved before (sgl-project/sglang#25454): refuse rather than capture wrong layers.
        raise RuntimeError(f"eaglenest capture: asked for taps {taps}, SGLang set layers_to_capture={effective}")
    taps = effective or taps
    check_taps(taps, num_layers)
    _state["writer"] = CaptureWriter(os.environ[ENV_DIR], taps)
    _state["prefix"] = os.environ.get(ENV_RID_PREFIX, DEFAULT_RID_PREFIX)
    _state["write"] = getattr(runner, "tp_rank", 0) == 0  # states are replicated on every TP rank
    args_ = getattr(runner, "server_args", None)
    if args_ is not None and (not args_.disable_radix_cache or args_.chunked_prefill_size not in (-1, None)):
        log.warning(
            "eaglenest capture: radix cache or chunked prefill is ON; captures of cached or chunked "
            "prompts are partial (the client rejects them). Start the server with sglang_patch.launch."
        )
    log.info(
        "eaglenest capture: taps %s (HF hidden_states indices) + final post-norm state -> %s", taps, os.environ[ENV_DIR]
    )
    return result


def around_logits_forward(
    original, processor, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None, *args, **kwargs
):
    receipts = _capture(logits_metadata, input_ids, hidden_states, aux_hidden_states)  # before any in-place use
    out = original(processor, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states, *args, **kwargs)
    if receipts is not None:
        if out.customized_info is None:
            out.customized_info = {}
        out.customized_info[RECEIPT_KEY] = receipts
    return out


def _capture(fb, input_ids, hidden_states, aux_hidden_states) -> list | None:
    writer = _state.get("writer")
    if writer is None or aux_hidden_states is None or not _is_prefill(fb):
        return None
    reqs = requests_in_batch(fb.rids or [], fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu, _state["prefix"])
    if not reqs:
        return None
    total = sum(int(n) for n in fb.extend_seq_lens_cpu)
    if hidden_states.shape[0] != total:  # token-sharded layouts (DP attention) would mix requests
        raise RuntimeError(f"eaglenest capture: {hidden_states.shape[0]} hidden rows for {total} extend tokens")
    aux = aux_rows(aux_hidden_states, hidden_states.shape[-1])
    receipts = [None] * len(fb.rids)
    for r in reqs:
        receipts[r.index] = writer.write(r, input_ids, aux, hidden_states, write=_state["write"])
    return receipts


def _is_prefill(fb) -> bool:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    return isinstance(fb, ForwardBatch) and fb.forward_mode == ForwardMode.EXTEND


def register() -> None:
    if not os.environ.get(ENV_DIR):
        log.debug("eaglenest capture: %s not set, plugin inert", ENV_DIR)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.load_model", after_load_model, HookType.AFTER
    )
    HookRegistry.register(
        "sglang.srt.layers.logits_processor.LogitsProcessor.forward", around_logits_forward, HookType.AROUND
    )
