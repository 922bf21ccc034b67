"""Offline speculative decoding with a draft tree (docs/design.md: Evaluate), as engines serve EAGLE-3:
`steps` drafter steps, each expanding the `topk` best frontier nodes by `topk` children; the
`tokens - 1` nodes of highest cumulative log-probability (with the last verified token as the root:
SGLang's `--speculative-num-draft-tokens` counts it) are verified in one target forward under a tree
attention mask, and the longest path that greedy decoding agrees with is accepted, plus the
target's own next token. Lossless: the output is the target's greedy decoding. With topk 1 this is
the chain of `speculative.ChainDrafter` (tested)."""

import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from eaglenest.decoding.speculative import ChainDrafter, Decoded, TargetRunner, cut_at_eos


@dataclass(frozen=True)
class TreeShape:
    steps: int  # drafter steps (tree depth)
    topk: int  # children per expanded node, and nodes expanded per step
    tokens: int  # tokens verified per round, the root included

    def __post_init__(self):
        if self.steps < 1 or self.topk < 1 or self.tokens < 2:
            raise ValueError(f"tree {self}: steps and topk must be >= 1 and tokens >= 2")
        if self.tokens - 1 > self.topk + (self.steps - 1) * self.topk**2:  # depth 1: topk nodes; later: topk^2
            raise ValueError(f"{self.name} verifies more tokens than its steps and topk draft")

    @property
    def name(self) -> str:
        return f"tree-{self.steps}x{self.topk}x{self.tokens}"


@dataclass
class Tree:
    tokens: list[int]  # node i's token (nodes in depth order: a parent before its children)
    parents: list[int]  # node i's parent node, -1 for the root's children
    depths: list[int]  # 1 for the root's children


class TreeDrafter(ChainDrafter):
    """Draft trees round after round for one decode, keeping step 0's keys of verified cells (as
    `ChainDrafter`). The frontier's nodes are rows of one batch: each row attends to the shared step-0
    cells and to its own ancestors' keys (the cache's diagonal, regathered by parent every step)."""

    @torch.inference_mode()
    def tree(self, feats: torch.Tensor, tokens: torch.Tensor, shape: TreeShape) -> Tree:
        d, n, dev = self.drafter, feats.shape[0], feats.device
        dtype = d.fc.weight.dtype
        h = self.step0(feats, tokens)
        # candidates: (score, token, parent node, depth); the frontier: (node, its row in h)
        cand_score, cand_tok, cand_parent, cand_depth = [], [], [], []
        frontier_nodes, base = [-1], torch.zeros(1, device=dev)
        for depth in range(1, shape.steps + 1):
            logp = torch.log_softmax(d.logits(h)[:, -1].float(), -1)  # [rows, Vd]
            top_lp, top_i = logp.topk(shape.topk, -1)
            scores = (base[:, None] + top_lp).flatten()
            toks = (top_i + d.d2t[top_i]).flatten()
            first = len(cand_score)
            for j in range(scores.numel()):
                cand_score.append(float(scores[j]))
                cand_tok.append(int(toks[j]))
                cand_parent.append(frontier_nodes[j // shape.topk])
                cand_depth.append(depth)
            if depth == shape.steps:
                break
            best = scores.topk(min(shape.topk, scores.numel())).indices  # the next frontier
            rows = torch.div(best, shape.topk, rounding_mode="floor")
            self.cache.diag_k = [x[rows] for x in self.cache.diag_k]
            self.cache.diag_v = [x[rows] for x in self.cache.diag_v]
            emb = self.embed(toks[best][:, None]).to(dtype)
            pos = torch.full((len(best), 1), n + depth - 1, device=dev)
            h = d.step(h[rows], emb, pos, self.cache, q_offset=n - 1)
            frontier_nodes = [first + int(b) for b in best]
            base = scores[best]
        # the best tokens-1 nodes: a child scores no higher than its parent and sorts after it at a tie
        keep = sorted(range(len(cand_score)), key=lambda i: (-cand_score[i], cand_depth[i], i))[: shape.tokens - 1]
        keep.sort(key=lambda i: (cand_depth[i], i))
        where = {c: j for j, c in enumerate(keep)}
        return Tree(
            [cand_tok[i] for i in keep],
            [where[cand_parent[i]] if cand_parent[i] >= 0 else -1 for i in keep],
            [cand_depth[i] for i in keep],
        )


def tree_mask(tree: Tree, past: int, dtype, device) -> torch.Tensor:
    """Additive [1, 1, 1 + m, past + 1 + m] mask: every row sees the past and the root; a node also
    its ancestors and itself."""
    m = len(tree.tokens)
    see = torch.zeros(1 + m, past + 1 + m, dtype=torch.bool)
    see[:, : past + 1] = True
    see[0, past] = True
    for i in range(m):
        j = i
        while j >= 0:
            see[1 + i, past + 1 + j] = True
            j = tree.parents[j]
    mask = torch.zeros(see.shape, dtype=dtype).masked_fill(~see, torch.finfo(dtype).min)
    return mask[None, None].to(device)


def accept(tree: Tree, greedy: list[int]) -> tuple[list[int], int]:
    """(accepted node indices along the path greedy decoding takes, the target's next token after them).
    greedy[0] is the target's choice after the root, greedy[1 + i] after node i."""
    path, cur, pred = [], -1, greedy[0]
    while True:
        child = next((i for i, p in enumerate(tree.parents) if p == cur and tree.tokens[i] == pred), None)
        if child is None:
            return path, pred
        path.append(child)
        cur, pred = child, greedy[1 + child]


def keep_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep the cache entries at positions `rows` (a verified path), in order."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(2, rows)
        layer.values = layer.values.index_select(2, rows)


@torch.inference_mode()
def tree_decode(
    runner: TargetRunner,
    drafter,
    embed,
    prompt: list[int],
    max_new: int,
    eos: set,
    shape: TreeShape,
    tree_fn=None,
) -> Decoded:
    """As `speculative_decode`, with a draft tree per round; `Decoded.accepted` counts accepted nodes.
    tree_fn(feats, tokens, shape) -> Tree (tests pass oracles); by default a `TreeDrafter`'s."""
    tree_fn = tree_fn or TreeDrafter(drafter, embed).tree
    t0 = time.perf_counter()
    cache = DynamicCache()
    nxt, feats = runner.forward(prompt, cache, 0)
    prefill = time.perf_counter() - t0
    out = [nxt[-1]]
    seq = list(prompt) + out
    forwards, accepted, drafting = 1, [], 0.0
    dtype = next(runner.model.parameters()).dtype
    while len(out) < max_new and out[-1] not in eos:
        t_draft = time.perf_counter()
        tree = tree_fn(feats, torch.tensor(seq, device=feats.device), shape)
        drafting += time.perf_counter() - t_draft
        n = len(seq) - 1  # KV cache holds positions 0..n-1
        ids = torch.tensor([[seq[-1], *tree.tokens]], device=runner.device)
        pos = torch.tensor([[n, *(n + dd for dd in tree.depths)]], device=runner.device)
        res = runner.model(
            input_ids=ids,
            position_ids=pos,
            attention_mask=tree_mask(tree, n, dtype, runner.device),
            use_cache=True,
            output_hidden_states=True,
            **{runner.cache_kw: cache},
        )
        forwards += 1
        greedy = res.logits[0].argmax(-1).tolist()
        path, bonus = accept(tree, greedy)
        accepted.append(len(path))
        rows = torch.tensor([0, *(1 + i for i in path)], device=runner.device)
        keep_rows(cache, torch.cat([torch.arange(n, device=runner.device), n + rows]))
        new_feats = torch.stack([res.hidden_states[j][0] for j in runner.taps], 1)
        feats = torch.cat([feats, new_feats[rows]])
        new = [tree.tokens[i] for i in path] + [bonus]
        seq += new
        out = cut_at_eos(out + new, eos)
    return Decoded(
        out[:max_new],
        time.perf_counter() - t0,
        target_forwards=forwards,
        accepted=accepted,
        draft_seconds=drafting,
        prefill_seconds=prefill,
    )
