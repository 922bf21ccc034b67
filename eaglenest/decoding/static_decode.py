"""Decode steps of a Llama-family target with a fixed-shape KV cache, replayed as one CUDA graph.

Why: a transformers forward of a 30-layer model launches ~600 kernels, and on the H100 and H200 hosts measured a
launch costs ~100 us of host time, so a decode step took 64 ms at 1 row and 100-140 ms at 256-1,024
rows whatever the GPU work. One graph replay per step leaves only the KV-cache reads.

The step is the transformers Llama layer written out with the model's own modules (projections,
norms, MLP, rotary embedding): q/k rotated at each row's position, k/v written at one cache column
shared by all rows (prompts are left-padded), attention over the whole cache under a mask of the
columns written so far. The grouped query heads of one KV head are laid out as that KV head's
"queries" (their positions are the same), so SDPA reads each cached key once and may use any kernel.
Prompts are prefilled by the model's own forward (rows in chunks of bounded tokens and attention
scores, so memory stays bounded) and their K/V copied into the cache; `fitting_batch_tokens` keeps a
batch's cache within the GPU's free memory beside that. `supports(model)` says whether a model has
this layout; other models use `batch_decode`'s transformers path."""

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from eaglenest.decoding.kv_cache import cache_kwarg

ARCHITECTURES = {"llama", "mistral", "qwen2"}  # pre-norm, RoPE, GQA, no q/k norm
CHUNK_TOKENS = 1 << 18  # prompt tokens per prefill forward
# A prefill chunk's attention scores (rows x heads x L x L) also bound it: under a padding mask SDPA
# may take its math kernel, which holds the scores and their softmax. Bounded by tokens alone, an
# H100 ran out at 256 rows of 1,023 tokens (~33 GB beside a 46 GB cache): ~14 bytes per score.
SCORE_ELEMS = 1 << 28
SCORE_BYTES = 16


def supports(model) -> bool:
    cfg = model.config
    sliding = getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True)
    if cfg.model_type not in ARCHITECTURES or sliding:  # a sliding window would need its own mask
        return False
    attn = model.model.layers[0].self_attn
    return not hasattr(attn, "q_norm") and all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))


def kv_bytes_per_token(model) -> int:
    """Bytes of this cache per row and column: every layer's key and value."""
    cfg, p = model.config, next(model.parameters())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return len(model.model.layers) * cfg.num_key_value_heads * head_dim * 2 * p.element_size()


def fitting_batch_tokens(batch_tokens: int, per_token: int, free: int) -> int:
    """batch_tokens (rows x width of one cache), or as many as `free` bytes hold beside the prefill:
    its largest chunk's scores and transformers' own cache of the chunk, and 1 GiB for the rest."""
    reserve = SCORE_ELEMS * SCORE_BYTES + CHUNK_TOKENS * per_token + (1 << 30)
    return max(1, min(batch_tokens, (free - reserve) // per_token))


def free_bytes(device) -> int:
    """What the next allocations can have: the GPU's free memory and the allocator's idle blocks."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class StaticDecoder:
    """A cache of rows x width tokens: `prefill` the left-padded prompts [rows, L], then each `step`
    writes the next column (L, L+1, ...); `select` keeps some rows (a smaller graph is captured)."""

    ALIGN = 16  # cache columns, rounded up: SDPA's fused kernels want an aligned mask

    def __init__(self, model, rows: int, width: int, graph: bool | None = None):
        cfg, self.model = model.config, model
        p = next(model.parameters())
        width = -(-width // self.ALIGN) * self.ALIGN
        self.dev, self.rows, self.width, self.next_col = p.device, rows, width, 0
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (len(model.model.layers), rows, self.kv_heads, width, self.head_dim)
        self.k = torch.zeros(shape, dtype=p.dtype, device=self.dev)
        self.v = torch.zeros(shape, dtype=p.dtype, device=self.dev)
        self.valid = torch.zeros(rows, width, dtype=torch.bool, device=self.dev)
        self.tok = torch.zeros(rows, dtype=torch.long, device=self.dev)
        self.pos = torch.zeros(rows, dtype=torch.long, device=self.dev)
        self.col = torch.zeros(1, dtype=torch.long, device=self.dev)
        self.use_graph = self.dev.type == "cuda" if graph is None else graph
        self.graph = self.logits = None

    @torch.inference_mode()
    def prefill(
        self,
        ids: torch.Tensor,
        attn: torch.Tensor,
        pos: torch.Tensor,
        chunk_tokens: int = CHUNK_TOKENS,
        score_elems: int = SCORE_ELEMS,
    ) -> torch.Tensor:
        """Run the prompts ([rows, L], left-padded) through the model; returns the last position's logits."""
        L = self.next_col = ids.shape[1]
        self.valid[:, :L] = attn.bool()
        step = max(1, min(chunk_tokens // L, score_elems // (self.heads * L * L)))
        logits = []
        for r in range(0, self.rows, step):
            s = slice(r, r + step)
            cache = DynamicCache()
            out = self.model(
                input_ids=ids[s],
                attention_mask=attn[s],
                position_ids=pos[s],
                use_cache=True,
                logits_to_keep=1,
                **{cache_kwarg(self.model): cache},
            )
            for i, layer in enumerate(cache.layers):
                self.k[i, s, :, :L] = layer.keys
                self.v[i, s, :, :L] = layer.values
            logits.append(out.logits[:, -1].float())
        return torch.cat(logits)

    def _step(self) -> torch.Tensor:
        m, B, d = self.model.model, self.rows, self.head_dim
        g = self.heads // self.kv_heads
        x = m.embed_tokens(self.tok[:, None])  # [B, 1, H]
        cos, sin = m.rotary_emb(x, self.pos[:, None])  # [B, 1, d]
        cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)  # [B, 1, 1, d]
        self.valid.index_fill_(1, self.col, True)
        mask = self.valid[:, None, None, :]
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = _rotate(a.q_proj(h).view(B, self.kv_heads, g, d), cos, sin)  # a KV head's queries as its "rows"
            k = _rotate(a.k_proj(h).view(B, self.kv_heads, 1, d), cos, sin)
            v = a.v_proj(h).view(B, self.kv_heads, 1, d)
            self.k[i].index_copy_(2, self.col, k)
            self.v[i].index_copy_(2, self.col, v)
            o = F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=mask, scale=a.scaling)
            x = x + a.o_proj(o.reshape(B, 1, self.heads * d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(m.norm(x[:, 0])).float()

    def select(self, keep: torch.Tensor) -> None:
        """Keep rows `keep` (one copy of their cache; the next step captures a graph for fewer rows)."""
        self.k, self.v, self.valid = self.k[:, keep], self.v[:, keep], self.valid[keep]
        self.rows = len(keep)
        self.tok, self.pos = self.tok[keep], self.pos[keep]
        self.graph = self.logits = None

    @torch.inference_mode()
    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Feed token `tok[r]` at position `pos[r]` into the next cache column; logits [rows, vocab] (float32)."""
        if self.next_col >= self.width:
            raise ValueError(f"static KV cache full ({self.width} columns)")
        self.tok.copy_(tok)
        self.pos.copy_(pos)
        self.col.fill_(self.next_col)
        self.next_col += 1
        if not self.use_graph:
            return self._step()
        if self.graph is None:
            # warm up on a side stream (lazy cuBLAS/SDPA init must not happen during capture), then
            # capture; the warm-up's writes to column `col` are redone by the replay below
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                self._step()
            torch.cuda.current_stream().wait_stream(s)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self._step()
        self.graph.replay()
        return self.logits
