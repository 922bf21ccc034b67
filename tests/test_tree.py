"""Tree drafts: lossless against greedy decoding, every accept length through the tree mask and the
cache's kept path, and a tree of one branch drafting what the chain drafts."""

import pytest
import torch

from eaglenest.decoding import batched_speculative as bs
from eaglenest.decoding.speculative import ChainDrafter, TargetRunner, greedy_decode, speculative_decode
from eaglenest.decoding.tree import Tree, TreeDrafter, TreeShape, accept, tree_decode, tree_mask

from .test_evaluate import TAPS, prompts, tiny_fp32  # noqa: F401 (a fixture)
from .test_train import tiny_drafter


def oracle_tree(truth: list[int], prompt_len: int, seed: int, vocab: int = 200):
    """Trees of `topk` branches per level; one branch at each level (at a random place) follows the
    greedy continuation up to a random depth, every other token is wrong. The draws depend on (seed,
    prompt, position) alone, so batched and batch-1 decoding see the same trees."""

    def tree(feats, tokens, shape):
        done = len(tokens) - prompt_len  # output tokens so far: truth[done] comes next
        rng = torch.Generator().manual_seed(hash((seed, prompt_len, *truth[:4], done)) & 0xFFFF_FFFF)
        right = truth[done : done + shape.steps] + [0] * shape.steps
        cut = int(torch.randint(0, shape.steps + 1, (1,), generator=rng))
        toks, parents, depths, on_path = [], [], [], -1
        for depth in range(1, shape.steps + 1):
            good = int(torch.randint(0, shape.topk, (1,), generator=rng))
            parent, on_path_next = on_path, None
            for b in range(shape.topk):
                ok = b == good and depth <= cut and (depth == 1 or on_path >= 0)
                toks.append(right[depth - 1] if ok else (right[depth - 1] + 1 + b) % vocab)
                parents.append(parent)
                depths.append(depth)
                if ok:
                    on_path_next = len(toks) - 1
            on_path = on_path_next if on_path_next is not None else len(toks) - 1
            if on_path_next is None:
                cut = 0  # the path has left the truth: nothing deeper is right
        return Tree(toks[: shape.tokens - 1], parents[: shape.tokens - 1], depths[: shape.tokens - 1])

    return tree


@pytest.mark.parametrize("seed", [0, 1])
def test_tree_decoding_is_lossless_and_accepts_every_path_length(tiny_target, tiny_fp32, seed):  # noqa: F811
    runner, embed = TargetRunner(tiny_fp32, TAPS), tiny_fp32.get_input_embeddings()
    drafter = tiny_drafter(tiny_target, TAPS, seed)
    shape = TreeShape(steps=4, topk=3, tokens=13)
    accepted = []
    for p in prompts(seed + 3, n=5):
        g = greedy_decode(runner, p, 40, eos={2}).tokens
        assert tree_decode(runner, drafter, embed, p, 40, {2}, shape).tokens == g  # the real drafter
        s = tree_decode(runner, drafter, embed, p, 40, {2}, shape, tree_fn=oracle_tree(g, len(p), seed))
        assert s.tokens == g
        assert s.target_forwards == 1 + len(s.accepted) < len(g)
        accepted += s.accepted
    assert set(accepted) >= {0, 1, 2, 3, 4}


def test_batched_trees_decide_as_batch1(smollm2):
    """The GPU evaluation path: every row's tree drafted in one drafter batch, verified in one target
    forward under per-row 4-D masks. On the real target (its greedy text varies, unlike the tiny
    one's), rows of different lengths give batch 1's tokens and accepted counts: with a random
    drafter, and with oracle trees that accept every path length, so rows advance unevenly and
    rejected nodes must stay out of later rounds' attention."""
    from eaglenest.decoding import batched_tree as bt
    from eaglenest.target.loading import load_model

    model = load_model(smollm2, dtype="float32", device="cpu")
    runner, embed, taps = TargetRunner(model, [1, 14, 27]), model.get_input_embeddings(), [1, 14, 27]
    drafter = tiny_drafter(smollm2, taps, 0)
    ps = [p for p in prompts(5, n=4)]
    shape, eos = TreeShape(3, 3, 10), {2}
    ref = [greedy_decode(runner, p, 24, eos).tokens for p in ps]
    assert len({t for g in ref for t in g}) > 20  # varied text: a wrong oracle offset cannot pass
    one = [tree_decode(runner, drafter, embed, p, 24, eos, shape) for p in ps]
    rows = bt.decode(model, taps, ps, 24, eos, shape, drafter, embed)
    assert [r.out for r in rows] == ref == [d.tokens for d in one]
    assert [r.accepted for r in rows] == [d.accepted for d in one]
    trees = {tuple(p): oracle_tree(g, len(p), 5) for p, g in zip(ps, ref)}
    one = [tree_decode(runner, drafter, embed, p, 24, eos, shape, tree_fn=trees[tuple(p)]) for p in ps]
    rows = bt.decode(model, taps, ps, 24, eos, shape, tree_fn=lambda _d, _e, rs, sh: [
        trees[tuple(r.seq[: len(r.seq) - len(r.out)])](None, r.seq, sh) for r in rs])  # fmt: skip
    assert [r.out for r in rows] == ref == [d.tokens for d in one]
    assert [r.accepted for r in rows] == [d.accepted for d in one]
    assert {a for r in rows for a in r.accepted} == {0, 1, 2, 3}
    # the batched drafter grows the trees batch 1 grows
    _, feats = runner.forward(ps[0], __import__("transformers").DynamicCache(), 0)
    r = bs.Row(seq=list(ps[0]), out=[], feats=[feats[:-1]])
    got = bt.draft_trees(drafter, embed, [r, r], shape)
    want = TreeDrafter(drafter, embed).tree(r.feats[0], torch.tensor(ps[0]), shape)
    assert got[0] == got[1] == want


def test_a_one_branch_tree_is_the_chain(tiny_target, tiny_fp32):  # noqa: F811
    runner, embed = TargetRunner(tiny_fp32, TAPS), tiny_fp32.get_input_embeddings()
    drafter = tiny_drafter(tiny_target, TAPS, 2)
    seq = prompts(11, n=1)[0] + prompts(12, n=1)[0]
    _, feats = runner.forward(seq, __import__("transformers").DynamicCache(), 0)
    chain, tree = ChainDrafter(drafter, embed), TreeDrafter(drafter, embed)
    for n in (5, 9, 10, 17, len(seq) - 1):
        tokens = torch.tensor(seq[: n + 1])
        t = tree.tree(feats[:n], tokens, TreeShape(4, 1, 5))
        assert t.tokens == chain(feats[:n], tokens, 4) and t.parents == [-1, 0, 1, 2] and t.depths == [1, 2, 3, 4]
    # wider trees still hold the chain's first two drafts as a path (its best child is expanded)
    wide = TreeDrafter(drafter, embed).tree(feats[:9], torch.tensor(seq[:10]), TreeShape(3, 4, 1 + 4 + 16 + 16))
    first = ChainDrafter(drafter, embed)(feats[:9], torch.tensor(seq[:10]), 2)
    i = wide.tokens.index(first[0])
    assert wide.parents[i] == -1 and any(
        wide.parents[j] == i and wide.tokens[j] == first[1] for j in range(len(wide.tokens))
    )
    p = seq[:12]
    one = tree_decode(runner, drafter, embed, p, 20, {2}, TreeShape(3, 1, 4))
    ref = speculative_decode(runner, drafter, embed, p, 20, {2}, 3)
    assert one.tokens == ref.tokens and one.accepted == ref.accepted


def test_the_mask_sees_ancestors_only_and_accept_walks_greedy():
    t = Tree(tokens=[5, 6, 7, 8], parents=[-1, -1, 0, 2], depths=[1, 1, 2, 3])
    see = tree_mask(t, 2, torch.float32, "cpu")[0, 0] == 0
    assert see.shape == (5, 7) and see[:, :3].all()
    assert see[4].tolist() == [True, True, True, True, False, True, True]  # node 3: root, 0, 2, itself
    assert see[2].tolist() == [True, True, True, False, True, False, False]  # node 1: root and itself
    assert accept(t, [5, 7, 0, 8, 9]) == ([0, 2, 3], 9)
    assert accept(t, [6, 0, 3, 0, 0]) == ([1], 3)
    assert accept(t, [4, 0, 0, 0, 0]) == ([], 4)
    with pytest.raises(ValueError):
        TreeShape(0, 4, 8)


def test_serving_flags_name_the_fastest_chain_and_tree(tmp_path):
    from eaglenest.cli.main import main
    from eaglenest.serving.flags import flags

    timing = {
        "target_step_ms": 10.0,
        "k": {"3": {"tau": 2.5, "speedup": 2.0}, "7": {"tau": 2.9, "speedup": 1.8}},
        "tree": {"tree-5x4x8": {"tau": 3.1, "speedup": 2.2}},
        "best_k": 3,
        "best_tree": "tree-5x4x8",
    }
    out = dict(flags(timing, "T", "D"))
    sg = out["SGLang, tree-5x4x8: tau 3.10, 2.20x"]
    assert "--speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 8" in sg
    chain = out["SGLang, chain k=3: tau 2.50, 2.00x"]
    assert "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4" in chain
    assert '"num_speculative_tokens": 3' in out["vLLM, chain k=3: tau 2.50, 2.00x"]
    with pytest.raises(SystemExit) as e:  # no timing yet: one line naming the file, exit 2
        main(["serve-flags", "--timing", str(tmp_path / "none.json")])
    assert e.value.code == 2
