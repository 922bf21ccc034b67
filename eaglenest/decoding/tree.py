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
from eaglenest.drafter.model import StepCache


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
    `ChainDrafter`); `grow` drafts each round's tree."""

    @torch.inference_mode()
    def tree(self, feats: torch.Tensor, tokens: torch.Tensor, shape: TreeShape) -> Tree:
        h = self.step0(feats, tokens)
        n = torch.tensor([feats.shape[0]], device=feats.device)
        return grow(self.drafter, self.embed, h, self.cache, n, shape)[0]


@torch.inference_mode()
def grow(drafter, embed, h: torch.Tensor, step0: StepCache, n: torch.Tensor, shape: TreeShape) -> list[Tree]:
    """Each row's tree from its last cell: h [B, 1, H] that cell's step-0 output, step0 the cache of
    the rows' step-0 keys (row b's cells 0..n[b]-1), n [B]. The frontier's nodes are rows of one
    batch (`topk` per row): each attends to its row's step-0 cells and to its own ancestors' keys
    (the cache's diagonal, regathered by parent every step)."""
    d, B, k, dev = drafter, h.shape[0], shape.topk, h.device
    dtype = d.fc.weight.dtype
    # the expansion's cache: every frontier row with its row's step-0 keys (one row's broadcast, uncopied)
    cache = StepCache()
    step0_kv = (step0.k0, step0.v0)
    cache.k0, cache.v0 = step0_kv if B == 1 else (x.repeat_interleave(k, 0) for x in step0_kv)
    cache._extend = False
    q_offset = (n - 1).repeat_interleave(k)
    # candidates per depth, [B, f*k] each: score, token, parent (a candidate index of the row, -1: the root)
    scores_at, toks_at, parents_at = [], [], []
    base, frontier, count = torch.zeros(B, 1, device=dev), torch.full((B, 1), -1, device=dev, dtype=torch.long), 0
    for depth in range(1, shape.steps + 1):
        logp = torch.log_softmax(d.logits(h)[:, -1].float(), -1)  # [B * f, Vd]
        top_lp, top_i = logp.topk(k, -1)
        f = frontier.shape[1]
        scores = (base.reshape(B * f, 1) + top_lp).reshape(B, f * k)
        toks = (top_i + d.d2t[top_i]).reshape(B, f * k)
        scores_at.append(scores)
        toks_at.append(toks)
        parents_at.append(frontier.repeat_interleave(k, 1))
        first, count = count, count + f * k
        if depth == shape.steps:
            break
        best = scores.topk(k, -1).indices  # [B, k]: the next frontier
        rows = (torch.arange(B, device=dev)[:, None] * f + torch.div(best, k, rounding_mode="floor")).flatten()
        cache.diag_k = [x[rows] for x in cache.diag_k]
        cache.diag_v = [x[rows] for x in cache.diag_v]
        emb = embed(toks.gather(1, best).reshape(B * k, 1)).to(dtype)
        pos = (n + depth - 1).repeat_interleave(k)[:, None]
        h = d.step(h[rows], emb, pos, cache, q_offset=q_offset)
        frontier, base = first + best, scores.gather(1, best)
    depths = [i + 1 for i, s in enumerate(scores_at) for _ in range(s.shape[1])]
    S, T = torch.cat(scores_at, 1).tolist(), torch.cat(toks_at, 1).tolist()
    P = torch.cat(parents_at, 1).tolist()
    return [_best_nodes(S[b], T[b], P[b], depths, shape.tokens - 1) for b in range(B)]


def _best_nodes(scores: list, toks: list, parents: list, depths: list, m: int) -> Tree:
    """The m candidates of highest score: a child scores no higher than its parent and sorts after
    it at a tie, so they form a tree."""
    keep = sorted(range(len(scores)), key=lambda i: (-scores[i], depths[i], i))[:m]
    keep.sort(key=lambda i: (depths[i], i))
    where = {c: j for j, c in enumerate(keep)}
    return Tree([toks[i] for i in keep], [where[parents[i]] if parents[i] >= 0 else -1 for i in keep],
                [depths[i] for i in keep])  # fmt: skip


def visibility(tree: Tree) -> torch.Tensor:
    """[1 + m, 1 + m] bool over the root and the nodes: each sees the root, its ancestors and itself."""
    m = len(tree.tokens)
    see = torch.zeros(1 + m, 1 + m, dtype=torch.bool)
    see[:, 0] = True
    for i in range(m):
        j = i
        while j >= 0:
            see[1 + i, 1 + j] = True
            j = tree.parents[j]
    return see


def tree_mask(tree: Tree, past: int, dtype, device) -> torch.Tensor:
    """Additive [1, 1, 1 + m, past + 1 + m] mask: every row sees the past and the root; a node also
    its ancestors and itself."""
    return additive(torch.cat([torch.ones(1 + len(tree.tokens), past, dtype=torch.bool), visibility(tree)], 1), dtype)[
        None, None
    ].to(device)


def additive(see: torch.Tensor, dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as transformers' additive float mask."""
    return torch.zeros(see.shape, dtype=dtype, device=see.device).masked_fill(~see, torch.finfo(dtype).min)


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
