"""Draft trees for many prompts at once (docs/design.md: Evaluate): the batched form of
`tree.tree_decode`, as `batched_speculative` is of the chain. Every row drafts its own tree (one
drafter batch: the rows' step 0, then `tree.grow` with `topk` frontier rows per row); one target
forward verifies every row's root and nodes under a 4-D mask built from `valid` (the row's past,
holes included) and the row's tree visibility. A row keeps all of a round's KV slots; those off its
accepted path become holes in `valid`, so later rounds never see them."""

import torch

from eaglenest.decoding.batched_speculative import BatchTarget, Row, advance, finish, step0_rows
from eaglenest.decoding.tree import Tree, TreeShape, accept, additive, grow, visibility
from eaglenest.drafter.model import Eagle3Drafter


@torch.inference_mode()
def draft_trees(drafter: Eagle3Drafter, embed, rows: list[Row], shape: TreeShape) -> list[Tree]:
    h, cache, n = step0_rows(drafter, embed, rows)
    return grow(drafter, embed, h, cache, n, shape)


@torch.inference_mode()
def decode(
    model,
    taps: list[int],
    prompts: list[list[int]],
    max_new: int,
    eos: set,
    shape: TreeShape,
    drafter: Eagle3Drafter | None = None,
    embed=None,
    tree_fn=draft_trees,
) -> list[Row]:
    """Speculative decoding of every prompt with draft trees; rows in prompt order, `Row.accepted`
    counting accepted nodes. tree_fn(drafter, embed, live rows, shape) -> a Tree per row (tests
    pass oracles)."""
    target = BatchTarget(model, taps, prompts, aux=True)
    dev, dtype = target.dev, next(model.parameters()).dtype
    rows = target.start(prompts)
    live = target.keep(list(range(len(rows))), rows, max_new, eos)
    m = shape.tokens - 1
    while live:
        lr = [rows[r] for r in live]
        trees = tree_fn(drafter, embed, lr, shape)
        x = torch.tensor([[r.seq[-1], *t.tokens] for r, t in zip(lr, trees)], device=dev)  # [b, 1+m]
        pos = torch.tensor([[len(r.seq) - 1, *(len(r.seq) - 1 + d for d in t.depths)] for r, t in zip(lr, trees)])
        past = target.valid.bool()[:, None].expand(-1, 1 + m, -1)
        see = torch.cat([past, torch.stack([visibility(t) for t in trees]).to(dev)], 2)
        target.valid = torch.cat([target.valid, torch.zeros_like(x)], 1)
        greedy, aux = target.forward(x, pos.to(dev), mask=additive(see, dtype)[:, None])
        g_all = greedy.tolist()
        for b, (row, t) in enumerate(zip(lr, trees)):
            path, bonus = accept(t, g_all[b])
            kept = torch.tensor([0, *(1 + i for i in path)], device=dev)
            target.valid[b, target.valid.shape[1] - 1 - m + kept] = 1  # off the path: holes
            advance(row, [t.tokens[i] for i in path] + [bonus], aux[b, kept], len(path))
        live = target.keep(live, rows, max_new, eos)
    return finish(rows, max_new, eos)
