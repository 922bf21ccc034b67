"""Self-distillation on the real target: every assistant turn regenerated given the regenerated
conversation so far, batched decoding equal to transformers' own greedy `generate`, and every turn
accounted for (regenerated, cut, skipped)."""

import json

import pytest
import torch

from eaglenest.decoding import batch_decode, static_decode
from eaglenest.decoding.batch_decode import HFStepper, decode_all, decode_batch, left_pad, plan_batches
from eaglenest.decoding.static_decode import StaticDecoder, supports
from eaglenest.generate import regenerate
from eaglenest.target.loading import load_model, stop_ids

from .conftest import generate_params, run_py, stage_workspace

CONVS = [
    {
        "id": "a",
        "messages": [
            {"role": "user", "content": "Name a fruit."},
            {"role": "assistant", "content": "old 1"},
            {"role": "user", "content": "And a vegetable?"},
            {"role": "assistant", "content": "old 2"},
        ],
    },
    {
        "id": "b",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "old"},
        ],
    },
    {
        "id": "c",
        "messages": [
            {"role": "user", "content": "Write a long story about a dragon. " * 8},
            {"role": "assistant", "content": "old"},
            {"role": "user", "content": "Shorter, please."},
            {"role": "assistant", "content": "old"},
        ],
    },
]


@pytest.fixture(scope="module")
def fp32(smollm2):
    return load_model(smollm2, dtype="float32", device="cpu")


def hf_greedy(model, tok, messages, max_new):
    ids = tok(
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
        return_tensors="pt",
    )["input_ids"]
    out = model.generate(
        ids, max_new_tokens=max_new, do_sample=False, eos_token_id=sorted(stop_ids(model, tok)), pad_token_id=0
    )[0, ids.shape[1] :].tolist()
    return tok.decode([t for t in out if t not in stop_ids(model, tok)], skip_special_tokens=True)


def test_every_turn_regenerated_on_the_regenerated_history(fp32, smollm2_tokenizer):
    tok = smollm2_tokenizer
    out, st = regenerate(
        fp32, tok, CONVS, max_new_tokens=10, max_seq_len=120, batch_tokens=2000, max_rows=2, progress=False
    )
    assert st["assistant_turns"] == 5
    assert st["regenerated"] + st.get("skipped_context", 0) + st.get("skipped_empty", 0) == 5
    assert st["skipped_context"] >= 1  # conversation c's second turn no longer fits in 120 tokens
    assert st["cut_at_max_tokens"] + st.get("cut_at_context", 0) >= 1 and st["generated_tokens"] > 0
    for c in out:
        msgs = c["messages"]
        assert msgs[-1]["role"] == "assistant"  # cut before a skipped turn, never after a user turn
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                assert not m["content"].startswith("old")
                # transformers' own greedy decoding of the history as regenerated so far
                assert m["content"] == hf_greedy(fp32, tok, msgs[:i], 10), (c["id"], i)
    a = next(c for c in out if c["id"] == "a")
    assert len(a["messages"]) == 4 and a["messages"][2]["content"] == "And a vegetable?"
    one, st1 = regenerate(fp32, tok, CONVS, max_new_tokens=10, max_turns=1, progress=False)
    assert st1["skipped_max_turns"] == 2 and all(
        len([m for m in c["messages"] if m["role"] == "assistant"]) == 1 for c in one
    )


def test_batched_decoding_equals_one_by_one_and_plans_within_budget(fp32, smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompts = [
        tok(t, add_special_tokens=False)["input_ids"]
        for t in ["Hello", "The capital of France is", "1, 2, 3, 4,", "Once upon a time there was a very old"]
    ]
    eos = stop_ids(fp32, tok)
    limits = [9, 4, 12, 7]
    batched = decode_all(fp32, prompts, limits, eos, 0, batch_tokens=4096, max_rows=4)
    single = [decode_all(fp32, [p], [n], eos, 0)[0] for p, n in zip(prompts, limits)]
    assert [d.tokens for d in batched] == [d.tokens for d in single]
    assert all(len(d.tokens) <= n and (d.ended or len(d.tokens) == n) for d, n in zip(batched, limits))
    lengths = [5, 50, 7, 30, 2]
    plan = plan_batches(lengths, [10] * 5, batch_tokens=100, max_rows=3)
    assert sorted(i for b in plan for i in b) == [0, 1, 2, 3, 4] and plan[0] == [1]  # longest first, alone
    for b in plan:
        assert len(b) <= 3 and len(b) * (max(lengths[i] for i in b) + 10) <= 100
    sampled = [decode_all(fp32, prompts, limits, eos, 0, temperature=1.0, seed=s) for s in (1, 1, 2)]
    assert [d.tokens for d in sampled[0]] == [d.tokens for d in sampled[1]]  # seeded
    assert [d.tokens for d in sampled[0]] != [d.tokens for d in sampled[2]]


def test_static_decoder_steps_equal_the_transformers_forward(fp32, smollm2_tokenizer, monkeypatch):
    """The CUDA-graphed path's step (run eagerly here: same tensors, no graph) against the model's own
    forward: logits of prefill and every step, and whole batches with rows dropped as they finish."""
    tok = smollm2_tokenizer
    assert supports(fp32)
    prompts = [
        tok(t, add_special_tokens=False)["input_ids"]
        for t in ["Hello", "The capital of France is", "1, 2, 3, 4,", "Once upon a time there was a very old"]
    ]
    ids, attn = left_pad(prompts, 0, "cpu")
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    hf, st = HFStepper(fp32, ids.shape[1] + 6), StaticDecoder(fp32, len(prompts), ids.shape[1] + 6)
    a, b = hf.prefill(ids, attn, pos), st.prefill(ids, attn, pos, chunk_tokens=16)  # rows in chunks
    last = pos[:, -1]
    for _ in range(5):
        assert (a - b).abs().max() < 1e-3
        nxt, last = a.argmax(-1), last + 1
        a, b = hf.step(nxt, last), st.step(nxt, last)
    keep = torch.tensor([0, 3])
    hf.select(keep), st.select(keep)
    assert (hf.step(nxt[keep], last[keep] + 1) - st.step(nxt[keep], last[keep] + 1)).abs().max() < 1e-3
    eos, limits = stop_ids(fp32, tok), [9, 4, 12, 7]
    ref = decode_batch(fp32, prompts, limits, eos, 0)
    monkeypatch.setattr(batch_decode, "SHRINK", 1)  # drop rows at every look, as the HF path does
    monkeypatch.setattr(batch_decode, "CHECK_EVERY", 2)
    static = decode_batch(
        fp32, prompts, limits, eos, 0, stepper=StaticDecoder(fp32, len(prompts), ids.shape[1] + max(limits))
    )
    assert [d.tokens for d in static] == [d.tokens for d in ref]


def test_prefill_chunks_are_bounded_by_their_attention_scores(fp32, smollm2_tokenizer):
    """Long prompts prefill fewer rows at once (the scores grow as L x L), with the same logits and cache."""
    texts = ["Hello", "The capital of France is", "1, 2, 3, 4,", "Once upon a time there was a very old"]
    ids, attn = left_pad([smollm2_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], 0, "cpu")
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    L, heads = ids.shape[1], fp32.config.num_attention_heads
    rows = []
    hook = fp32.register_forward_pre_hook(lambda m, a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True)
    try:
        whole, split = StaticDecoder(fp32, 4, L + 2), StaticDecoder(fp32, 4, L + 2)
        a = whole.prefill(ids, attn, pos)
        b = split.prefill(ids, attn, pos, score_elems=heads * L * L * 2 + 1)  # two rows' scores
    finally:
        hook.remove()
    assert rows == [4, 2, 2]
    assert (a - b).abs().max() < 1e-4 and (whole.k - split.k).abs().max() < 1e-4
    # the cache's bytes are what fitting a batch to the GPU counts
    assert whole.k.nbytes + whole.v.nbytes == 4 * whole.width * static_decode.kv_bytes_per_token(fp32)


def test_a_batch_cache_is_fitted_to_the_free_memory_beside_the_prefill():
    per = 23_040  # SmolLM2-135M in bf16
    reserve = static_decode.SCORE_ELEMS * static_decode.SCORE_BYTES + static_decode.CHUNK_TOKENS * per + (1 << 30)
    assert static_decode.fitting_batch_tokens(2_000_000, per, 80 << 30) == 2_000_000  # an H100 holds it
    assert static_decode.fitting_batch_tokens(2_000_000, per, reserve + 1000 * per + 7) == 1000
    assert static_decode.fitting_batch_tokens(2_000_000, per, reserve // 2) == 1  # one row at a time, never 0


def test_generate_stage_writes_the_turn_accounting(smollm2, tmp_path):
    ws = stage_workspace(tmp_path / "ws", smollm2, generate_params())
    (ws / "data/parts").mkdir(parents=True)
    (ws / "data/parts/p.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CONVS))
    run_py(["-m", "stages.generate", "p", "--no-progress"], cwd=ws)
    m = json.loads((ws / "reports/generate/p.json").read_text())
    assert m["enabled"] and m["assistant_turns"] == 5 and m["regenerated"] == 5 and "tokens_per_s" not in m
    assert json.loads((ws / "reports/timing/generate/p.json").read_text())["tokens_per_s"] > 0
    rows = [json.loads(line) for line in (ws / "data/generated/p.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "b", "c"]
    assert m["cut_at_max_tokens"] + m.get("cut_at_context", 0) <= 5 and m["generated_tokens"] <= 5 * 6
