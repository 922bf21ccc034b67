"""The hf backend's compiled layers: which decoders the backend runs layer by layer, that loop, the
compile, and the lengths a graph may be compiled at."""

import torch

# decoders whose forward is exactly: embed, rotary, each layer, norm (no embedding scale, no
# sliding-window masks), so running the layers in the backend's own loop gives the same states
OWN_LOOP = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")


def runs_own_loop(decoder, mode, attn: str) -> bool:
    """Whether the backend runs this decoder's layers itself (`compile: layers`, class docstring)."""
    return mode == "layers" and type(decoder).__name__ in OWN_LOOP and attn == "sdpa"


def run_layers(dec, ids: torch.Tensor, keep: tuple) -> tuple[list, torch.Tensor]:
    """Embeddings, each layer (keeping the input of layer j where keep[j]), the final norm."""
    h = dec.embed_tokens(ids)
    pos = torch.arange(ids.shape[1], device=ids.device)[None]
    rope = dec.rotary_emb(h, pos)
    kept = []
    for layer, k in zip(dec.layers, keep):
        if k:
            kept.append(h)
        out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=rope, use_cache=False)
        h = out[0] if isinstance(out, tuple) else out  # a tuple in older transformers
    return kept, dec.norm(h)


def compile_layers(decoder) -> list:
    """Compile each decoder layer (dynamic shapes: one graph for every length and batch size)."""
    layers = [m for m in decoder.modules() if type(m).__name__.endswith("DecoderLayer")]
    for m in layers:
        m.compile(dynamic=True)
    return layers


def compile_length(T: int, hidden: int, head: int) -> int:
    """T, or the next length that is not 2 (the rows), the hidden or the head size: dynamo gives equal
    sizes one symbol and would specialise the graph to that length, so every other length would
    compile again."""
    while T in (2, hidden, head):
        T += 1
    return T
