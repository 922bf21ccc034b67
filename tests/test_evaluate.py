"""Batched speculative decoding (the GPU evaluation path) against the batch-1 decoder, and the
evaluate stage's quality gate on the real target."""

import json

import pytest
import torch

from eaglenest.decoding import batched_speculative as bs
from eaglenest.decoding.speculative import (
    ChainDrafter,
    TargetRunner,
    draft_chain,
    greedy_decode,
    speculative_decode,
)
from eaglenest.target.loading import load_model

from .conftest import random_samples, run_py, stage_workspace
from .test_train import tiny_drafter

TAPS = [2, 4, 5]


@pytest.fixture(scope="module")
def tiny_fp32(tiny_target):
    return load_model(tiny_target, dtype="float32", device="cpu")


def prompts(seed, n=5):
    return [p.tolist() for p in random_samples(n, 200, 3, 40, seed=seed)]


def oracle(truth: dict, k: int, vocab: int = 200):
    """Drafts right up to a cut that depends only on (prompt, position): the batch-1 and batched
    decoders see the same drafts, so their accepted counts must agree exactly."""

    def cut(key, n):
        return (hash((key, n)) & 0xFFFF) % (k + 1)

    def one(prompt_key, out_len):
        t = (truth[prompt_key] + [0] * (k + 1))[out_len : out_len + k]
        c = cut(prompt_key, out_len)
        return t[:c] + [(x + 1) % vocab for x in t[c:]]

    return one


def test_batched_drafts_equal_batch1_drafts(tiny_target, tiny_fp32):
    drafter = tiny_drafter(tiny_target, TAPS, 0)
    runner, embed = TargetRunner(tiny_fp32, TAPS), tiny_fp32.get_input_embeddings()
    rows = []
    for p in prompts(3):
        _, feats = runner.forward(p, bs.growing_cache(), 0)
        rows.append((p, feats))
    got = bs.draft_chains(drafter, embed, [bs.Row(seq=list(p), out=[], feats=[f[:-1]]) for p, f in rows], 4).tolist()
    for (p, f), g in zip(rows, got):  # the features cover seq[:-1]: drafts continue from the last prompt token
        assert g == draft_chain(drafter, embed, f[:-1], torch.tensor(p), 4)


@pytest.mark.parametrize("seed", [0, 1])
def test_chain_drafter_with_its_cache_drafts_what_a_full_recompute_drafts(tiny_target, tiny_fp32, seed):
    """The cached drafter (step 0 only over the cells verified since its last round, 1..k+1 of them)
    makes the very decisions of `draft_chain`, which reruns step 0 over every cell each round."""
    runner, embed = TargetRunner(tiny_fp32, TAPS), tiny_fp32.get_input_embeddings()
    drafter = tiny_drafter(tiny_target, TAPS, seed)
    seq = prompts(seed + 7, n=1)[0] + prompts(seed + 8, n=1)[0] + prompts(seed + 9, n=1)[0]
    _, feats = runner.forward(seq, bs.growing_cache(), 0)
    chain, n, rng = ChainDrafter(drafter, embed), 3, torch.Generator().manual_seed(seed)
    rounds = 0
    while n < len(seq):
        tokens = torch.tensor(seq[: n + 1])
        assert chain(feats[:n], tokens, 3) == draft_chain(drafter, embed, feats[:n], tokens, 3), n
        n += int(torch.randint(1, 5, (1,), generator=rng))  # a verification accepts 0..3 drafts + the bonus
        rounds += 1
    assert rounds > 10
    s = speculative_decode(runner, drafter, embed, seq[:10], 12, {2}, 3)
    assert s.draft_seconds > 0 and len(s.accepted) > 1


@pytest.mark.parametrize("seed", [0, 1])
def test_batched_greedy_and_speculative_equal_batch1(tiny_target, tiny_fp32, seed):
    runner, embed = TargetRunner(tiny_fp32, TAPS), tiny_fp32.get_input_embeddings()
    drafter = tiny_drafter(tiny_target, TAPS, seed)
    ps = prompts(seed)
    ref = [greedy_decode(runner, p, 20, eos={2}).tokens for p in ps]
    assert [r.out for r in bs.decode(tiny_fp32, TAPS, ps, 20, {2})] == ref
    # the real drafter: same output, same acceptance as batch 1
    rows = bs.decode(tiny_fp32, TAPS, ps, 20, {2}, k=3, drafter=drafter, embed=embed)
    one = [speculative_decode(runner, drafter, embed, p, 20, {2}, 3) for p in ps]
    assert [r.out for r in rows] == ref == [s.tokens for s in one]
    assert [r.accepted for r in rows] == [s.accepted for s in one]
    # an oracle that accepts every length 0..k: rows advance by different amounts each step
    truth = {tuple(p): t for p, t in zip(ps, ref)}
    o = oracle(truth, 3)
    rows = bs.decode(
        tiny_fp32,
        TAPS,
        ps,
        20,
        {2},
        k=3,
        drafter=drafter,
        embed=embed,
        draft_fn=lambda d, e, rs, k: torch.tensor([o(tuple(r.seq[: len(r.seq) - len(r.out)]), len(r.out)) for r in rs]),
    )
    one = [
        speculative_decode(
            runner,
            drafter,
            embed,
            p,
            20,
            {2},
            3,
            draft_fn=lambda d, e, f, toks, k, p=p: o(tuple(p), len(toks) - len(p)),
        )
        for p in ps
    ]
    assert [r.out for r in rows] == ref
    assert [r.accepted for r in rows] == [s.accepted for s in one]
    assert len({a for r in rows for a in r.accepted}) == 4  # 0..3 all happened


def test_evaluate_stage_gate_fails_below_min_tau_and_keeps_metrics(smollm2, tmp_path):
    from eaglenest.drafter.config import DrafterConfig
    from eaglenest.drafter.model import Eagle3Drafter

    ws = stage_workspace(
        tmp_path / "ws",
        smollm2,
        {
            "evaluate": {
                "questions": 3,
                "k": [2, 3],
                "trees": [[2, 2, 4]],
                "max_new_tokens": 8,
                "dtype": "float32",
                "device": "cpu",
                "batch_size": 3,
                "speed_questions": 1,
                "min_tau": 1.5,
            }
        },
    )
    cfg = json.loads((smollm2.model_dir / "config.json").read_text())
    torch.manual_seed(0)
    d = Eagle3Drafter(DrafterConfig.from_target(cfg, 256, [2, 15, 27]))
    d.set_vocab(torch.arange(256))
    d.save_pretrained(ws / "data/drafter")
    p = run_py(["-m", "stages.evaluate", "--no-progress"], cwd=ws, check=False)
    assert p.returncode == 2 and "below evaluate.min_tau 1.5" in p.stderr
    m = json.loads((ws / "reports/evaluate.json").read_text())
    assert m["gate_passed"] is False and set(m["tau"]) == {"2", "3", "tree-2x2x4"} and m["questions"] == 3
    assert all(1.0 <= t < 1.5 for t in m["tau"].values())
    assert m["identical_to_greedy"] == m["lossless"] == {"2": 3, "3": 3, "tree-2x2x4": 3}
    assert m["trees"] == ["tree-2x2x4"]
    headline = json.loads((ws / "metrics/evaluate.json").read_text())
    assert headline["tau"] == m["tau"] and headline["lossless"] is True and headline["cpu"] == m["cpu"]
    # the break-even analysis: a round = its draft steps + a verification, against a target step
    t = json.loads((ws / "reports/timing/evaluate.json").read_text())
    assert m["speed_questions"] == 1 and t["target_step_ms"] > 0 and t["best_k"] in (2, 3)
    assert t["best_tree"] == "tree-2x2x4" and set(t["tree"]) == {"tree-2x2x4"}
    for k, f in [*t["k"].items(), *t["tree"].items()]:
        steps = 2 if k.startswith("tree") else int(k)
        assert f["speedup"] > 0 and f["draft_step_ms"] > 0 and f["verify_ms"] > 0, (k, f)
        assert abs(f["round_ms"] - steps * f["draft_step_ms"] - f["verify_ms"]) < 0.05
        assert abs(f["break_even_tau"] - f["round_ms"] / t["target_step_ms"]) < 0.01
    rows = (ws / "metrics/evaluate_positions.csv").read_text().splitlines()
    assert rows[0] == "k,position,acceptance" and len(rows) == 1 + 2 + 3 + 2


def test_a_tree_that_cannot_be_drafted_or_held_fails_before_any_work(smollm2, tmp_path):
    from eaglenest.evaluate import mtbench_prompts, prompt_ids
    from eaglenest.target.loading import load_tokenizer

    base = {"questions": 1, "k": 2, "max_new_tokens": 4, "dtype": "float32", "device": "cpu", "batch_size": 1,
            "speed_questions": 1, "min_tau": None}  # fmt: skip
    first = len(prompt_ids(load_tokenizer(smollm2), mtbench_prompts(1))[0])
    for i, (sets, says) in enumerate(
        [
            ({"trees": [[2, 2, 8]]}, "tree-2x2x8 verifies more tokens"),
            ({"trees": [[3, 2, 1]]}, "tokens >= 2"),
            ({"trees": [[0, 2, 4]]}, "`evaluate.trees` is [[0, 2, 4]]"),
            # the chain's 2 draft steps fit the context (8192), the tree's 5 do not
            ({"trees": [[5, 2, 4]], "max_new_tokens": 8192 - first - 3}, "evaluate tree-5x2x4: positions reach 8194"),
            # 2 questions at once, each round keeping 1,600 slots: ~1 TB of KV cache at worst, refused
            ({"trees": [[2, 40, 1600]], "max_new_tokens": 4000, "questions": 2, "batch_size": 2},
             "evaluate tree-2x40x1600: 2 questions at once may need"),
        ]
    ):  # fmt: skip
        ws = stage_workspace(tmp_path / str(i), smollm2, {"evaluate": {**base, **sets}})
        p = run_py(["-m", "stages.evaluate", "--no-progress"], cwd=ws, check=False)
        assert p.returncode == 2 and says in p.stderr.strip().splitlines()[-1], p.stderr[-600:]
        assert not (ws / "metrics").exists()


def test_a_divergence_is_judged_by_the_targets_own_forward(tiny_target, tiny_fp32):
    """Where a speculative output leaves greedy decoding, the report gives the position and the
    target's logit margin of greedy's token over the other, and judges the output by the target's
    own uncached forward over it: lossless where each token from there on is that forward's top
    logit (plain decoding broke a near-tie), not where one is below it by more than two shapes of
    the forward disagree (a wrong acceptance), naming those positions."""
    from eaglenest.decoding.lossless import divergence

    p = prompts(7, n=1)[0]
    greedy = greedy_decode(TargetRunner(tiny_fp32, TAPS), p, 12, eos=set()).tokens
    j = 5
    with torch.no_grad():
        logits = tiny_fp32(input_ids=torch.tensor([p + greedy[:j]])).logits[0, -1]
    top2 = logits.topk(2)
    assert top2.indices[0].item() == greedy[j]
    runner_up = top2.indices[1].item()
    wrong = greedy[:j] + [runner_up] + greedy[j + 1 :]
    d = divergence(tiny_fp32, p, greedy, wrong)
    gap = (top2.values[0] - top2.values[1]).item()
    assert d["position"] == j and d["logit_margin"] == pytest.approx(gap, abs=1e-5) and d["logit_margin"] > 0
    assert d["relative_to_top"] == pytest.approx(gap / abs(top2.values[0].item()), rel=1e-3)
    assert 0 <= d["shape_noise"] < 1e-3 * abs(top2.values[0].item())  # float32 noise, not another function
    # the runner-up is below the top by its gap, beyond the noise: not the target's greedy choice
    assert gap > d["shape_noise"] and d["follows_target"] is False
    assert d["off_target"][0] == (j, pytest.approx(gap, abs=1e-5))
    # the other way round: plain decoding took the runner-up, the speculative output is the target's
    d = divergence(tiny_fp32, p, wrong, greedy)
    assert d["logit_margin"] < 0 and d["follows_target"] is True and d["off_target"] == []
    # one output stopped where the other went on: a position, no margin, not lossless
    assert divergence(tiny_fp32, p, greedy, greedy[:j]) == {"position": j, "follows_target": False}
