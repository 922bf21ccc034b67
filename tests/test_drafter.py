"""Drafter: shapes, serving format, TTT against a naive recomputation, vocab mapping."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from eaglenest.data.vocab import build_vocab
from eaglenest.drafter.config import DrafterConfig
from eaglenest.drafter.model import Eagle3Drafter

TARGET_CFG = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "max_position_embeddings": 256,
    "vocab_size": 300,
    "num_hidden_layers": 8,
}


def make_drafter(vd=40, taps=(2, 4, 5), seed=0):
    torch.manual_seed(seed)
    d = Eagle3Drafter(DrafterConfig.from_target(TARGET_CFG, vd, list(taps)))
    for p in d.parameters():  # non-trivial norms too
        torch.nn.init.normal_(p, std=0.2) if p.dim() > 1 else torch.nn.init.uniform_(p, 0.5, 1.5)
    d.set_vocab(torch.arange(0, 300, 300 // vd)[:vd])
    return d


def test_forward_shapes():
    d = make_drafter()
    aux, ids = torch.randn(2, 11, 3, 64), torch.randint(0, 300, (2, 11))
    out = d(aux, ids, torch.nn.Embedding(300, 64), 3)
    assert len(out) == 3 and all(o.shape == (2, 11, 40) for o in out)


@pytest.mark.parametrize("name", ["default_taps", "custom_taps"])
def test_export_is_byte_for_byte_the_recorded_serving_format(tmp_path, name):
    """tests/data/drafter_export holds exports written by the drafter code of 2026-12 (the format
    SGLang and vLLM were checked against): loading one and saving it again gives the same bytes."""
    from pathlib import Path

    golden = Path(__file__).parent / "data" / "drafter_export" / name
    Eagle3Drafter.from_pretrained(golden).save_pretrained(tmp_path)
    for f in ("config.json", "model.safetensors"):
        assert (tmp_path / f).read_bytes() == (golden / f).read_bytes(), f


def test_a_wider_mlp_is_served_by_its_config(tmp_path):
    d = Eagle3Drafter(DrafterConfig.from_target(TARGET_CFG, 40, [2, 4, 5], intermediate_size=256))
    d.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["intermediate_size"] == 256
    assert load_file(str(tmp_path / "model.safetensors"))["midlayer.mlp.up_proj.weight"].shape == (256, 64)
    assert Eagle3Drafter.from_pretrained(tmp_path).midlayer.mlp.down_proj.weight.shape == (64, 256)


def test_export_format_and_bit_exact_round_trip(tmp_path):
    d = make_drafter().to(torch.bfloat16)
    d.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["vocab_size"] == 300 and cfg["draft_vocab_size"] == 40 and cfg["tie_word_embeddings"] is False
    assert cfg["rope_theta"] == 10000.0 and cfg["head_dim"] == 16 and cfg["num_key_value_heads"] == 2
    # default taps [2, L//2, L-3] = [2, 4, 5] for L=8: no layer ids written
    assert "eagle_config" not in cfg and "eagle_aux_hidden_state_layer_ids" not in cfg
    w = load_file(str(tmp_path / "model.safetensors"))
    expect = {
        "fc.weight": (64, 192),
        "midlayer.self_attn.q_proj.weight": (64, 128),
        "midlayer.self_attn.k_proj.weight": (32, 128),
        "midlayer.self_attn.v_proj.weight": (32, 128),
        "midlayer.self_attn.o_proj.weight": (64, 64),
        "midlayer.mlp.gate_proj.weight": (96, 64),
        "midlayer.mlp.up_proj.weight": (96, 64),
        "midlayer.mlp.down_proj.weight": (64, 96),
        "midlayer.hidden_norm.weight": (64,),
        "midlayer.input_layernorm.weight": (64,),
        "midlayer.post_attention_layernorm.weight": (64,),
        "norm.weight": (64,),
        "lm_head.weight": (40, 64),
        "d2t": (40,),
        "t2d": (300,),
    }
    assert {k: tuple(v.shape) for k, v in w.items()} == expect
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    assert not any("embed" in k for k in w)
    back = Eagle3Drafter.from_pretrained(tmp_path, dtype=torch.bfloat16)
    for k, v in d.state_dict().items():
        if not k.startswith("rotary."):
            assert torch.equal(v, back.state_dict()[k]), k


def test_custom_taps_written_per_engine_convention(tmp_path):
    make_drafter(taps=(1, 3, 6)).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]  # SGLang: output of layer v
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]  # vLLM: input of layer v


def naive_layer(d: Eagle3Drafter, xs, embs, positions):
    """The drafter's layer over an explicit sequence with plain causal attention."""
    L = d.midlayer
    u = torch.cat([L.input_layernorm(embs), L.hidden_norm(xs)], -1)[None]
    a = L.self_attn
    T = u.shape[1]
    q = a.q_proj(u).view(1, T, a.nh, a.d).transpose(1, 2)
    k = a.k_proj(u).view(1, T, a.kvh, a.d).transpose(1, 2)
    v = a.v_proj(u).view(1, T, a.kvh, a.d).transpose(1, 2)
    cos, sin = d.rotary(u, torch.tensor(positions, device=u.device)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    rep = a.nh // a.kvh
    o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
    h = xs[None] + a.o_proj(o.transpose(1, 2).reshape(1, T, -1))
    return (h + L.mlp(L.post_attention_layernorm(h)))[0]


def test_ttt_unroll_equals_naive_recomputation():
    torch.manual_seed(1)
    d = make_drafter().double()
    emb = torch.nn.Embedding(300, 64).double()
    T, K = 9, 4
    aux, ids = torch.randn(1, T, 3, 64, dtype=torch.double), torch.randint(0, 300, (1, T))
    ttt = d(aux, ids, emb, K)
    g = d.project(aux)[0]
    for t in range(T - K):
        # step-0 cells 0..t, then cell t's chain: each entry feeds the previous entry's output
        xs, es, pos = list(g[: t + 1]), [emb(ids[0, s + 1]) for s in range(t + 1)], list(range(t + 1))
        for k in range(K):
            h = naive_layer(d, torch.stack(xs), torch.stack(es), pos)[-1]
            # RoPE tables are float32 inside transformers: 1e-5, not 1e-12; a mask or position bug is O(1)
            assert torch.allclose(d.logits(h), ttt[k][0, t], atol=1e-5), (
                t,
                k,
                (d.logits(h) - ttt[k][0, t]).abs().max(),
            )
            xs.append(h)
            es.append(emb(ids[0, t + 2 + k]) if t + 2 + k < T else emb(torch.tensor(0)))
            pos.append(t + 1 + k)


def test_vocab_mapping():
    counts = np.zeros(50, dtype=np.int64)
    counts[[7, 3, 40, 11]] = [5, 9, 1, 2]
    sel, d2t, t2d = build_vocab(counts, 3)
    assert sel.tolist() == [3, 7, 11] and all(sel[i] == i + d2t[i] for i in range(3))
    assert t2d.sum() == 3 and t2d[[3, 7, 11]].all()
    # more slots than distinct tokens: padded with the smallest unused ids, still consistent
    sel, d2t, t2d = build_vocab(counts, 6)
    assert sel.tolist() == [0, 1, 3, 7, 11, 40] and (np.arange(6) + d2t == sel).all() and t2d.sum() == 6
    with pytest.raises(ValueError):
        build_vocab(counts, 51)


def _loss_batch(B=2, T=24, seed=3):
    g = torch.Generator().manual_seed(seed)
    return {
        "aux": torch.randn(B, T, 3, 64, generator=g),
        "final": torch.randn(B, T, 64, generator=g),
        "input_ids": torch.randint(0, 300, (B, T), generator=g),
        "loss_mask": (torch.rand(B, T, generator=g) > 0.2).long(),
        "in_vocab": (torch.rand(B, T, generator=g) > 0.1).long(),
    }


@pytest.mark.parametrize("autocast", [False, True])
def test_fused_loss_head_equals_plain_loss(autocast):
    """The fused head (gradients formed in the forward, chunked, teacher in one padded buffer) gives
    the plain loss, stats and gradients: fp32 exactly up to summation order; bf16 autocast within bf16."""
    from eaglenest.drafter.ttt import ttt_loss

    batch, emb = _loss_batch(), torch.nn.Embedding(300, 64)
    head = torch.randn(40, 64) * 0.3
    results = []
    for fused in (False, True):
        d = make_drafter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, stats = ttt_loss(d, batch, emb, head, 4, [30.0, 29.0, 28.0, 27.0], fused=fused)
        loss.backward()
        results.append((loss.detach(), stats, {n: p.grad.clone() for n, p in d.named_parameters()}))
    (l0, s0, g0), (l1, s1, g1) = results
    tol = 2e-2 if autocast else 1e-5
    assert torch.allclose(l0, l1, rtol=tol), (l0, l1)
    assert torch.allclose(s0[:, 2], s1[:, 2]) and torch.allclose(s0[:, 0], s1[:, 0], rtol=tol)
    assert (s0[:, 1] - s1[:, 1]).abs().max() <= (2 if autocast else 0)  # argmax ties may flip in bf16
    for n in g0:
        rel = (g0[n] - g1[n]).norm() / g0[n].norm()
        assert rel < (3e-2 if autocast else 1e-5), (n, rel)


@pytest.mark.parametrize("recipe", [(10, 1.0, 0), (0, 0.0, 1), (5, 0.5, 3)])
def test_fused_loss_head_equals_plain_loss_under_each_recipe_option(recipe):
    """HASS's top-K term and token alignment: the fused head's hand-formed gradient (q s - p') and its
    chunk-by-chunk alignment give the autograd reference's loss, stats and gradients."""
    from eaglenest.drafter.ttt import Recipe, ttt_loss

    batch, emb = _loss_batch(), torch.nn.Embedding(300, 64)
    head = torch.randn(40, 64) * 0.3
    results = []
    for fused in (False, True):
        d = make_drafter().float()
        loss, stats = ttt_loss(d, batch, emb, head, 4, [30.0, 29.0, 28.0, 27.0], fused=fused, recipe=Recipe(*recipe))
        loss.backward()
        results.append((loss.detach(), stats, {n: p.grad.clone() for n, p in d.named_parameters()}))
    (l0, s0, g0), (l1, s1, g1) = results
    assert torch.allclose(l0, l1, rtol=1e-5), (l0, l1)
    assert torch.allclose(s0, s1, rtol=1e-5)
    for n in g0:
        assert (g0[n] - g1[n]).norm() / g0[n].norm() < 1e-5, n


def test_recipe_options_change_the_loss_as_their_sources_define():
    """The top-K term adds weight to the teacher's likeliest tokens only; token alignment at the whole
    draft vocabulary keeps every cell, and at top-1 keeps step 0 whole and drops most later cells of an
    untrained drafter (whose argmax rarely matches); the stats stay the plain CE and top-1 throughout."""
    from eaglenest.drafter.ttt import Recipe, ttt_loss

    batch, emb = _loss_batch(), torch.nn.Embedding(300, 64)
    head = torch.randn(40, 64) * 0.3
    denominators = [30.0, 29.0, 28.0, 27.0]

    def run(recipe=Recipe(0, 0.0, 0), K=4):  # noqa: B008 (a NamedTuple: immutable)
        with torch.no_grad():
            return ttt_loss(make_drafter().float(), batch, emb, head, K, denominators[:K], recipe=recipe)

    plain, stats = run()
    top1, _ = run(Recipe(topk=1, topk_weight=1.0))
    top40, _ = run(Recipe(topk=40, topk_weight=1.0))  # every draft token: the soft CE counted twice
    assert torch.allclose(top40, 2 * plain, rtol=1e-5)
    assert plain < top1 < top40
    everyone, st_all = run(Recipe(align_topk=40))
    assert torch.allclose(everyone, plain) and torch.equal(st_all, stats)
    aligned, st_aligned = run(Recipe(align_topk=1))
    step0, _ = run(K=1)
    assert step0 <= aligned < plain and torch.equal(st_aligned, stats)


def test_flex_ttt_attention_forward_equals_eager():
    """The FlexAttention TTT mask (CPU: the unfused reference path) attends exactly where the eager
    step does: causal step-0 keys plus each cell's own diagonal keys."""
    d = make_drafter().float()
    aux, ids = torch.randn(2, 16, 3, 64), torch.randint(0, 300, (2, 16))
    emb = torch.nn.Embedding(300, 64)
    with torch.no_grad():
        eager = d(aux, ids, emb, 4)
        d.set_attention("flex")
        flex = d(aux, ids, emb, 4)
    for k, (a, b) in enumerate(zip(eager, flex)):
        assert torch.allclose(a, b, atol=1e-4), (k, (a - b).abs().max())


@pytest.mark.parametrize("attention", ["eager", "flex"])
def test_padding_a_batch_to_a_fixed_shape_leaves_the_loss_and_gradients_unchanged(attention):
    """Bucketed batches (data/packed.py) pad rows and columns with loss_mask 0: the loss, stats and
    gradients equal those of the batch at its own shape (right padding is causal-invisible). The
    flex kernel has no backward on the CPU: its forward only."""
    from eaglenest.drafter.ttt import ttt_loss

    batch, emb = _loss_batch(B=2, T=20), torch.nn.Embedding(300, 64)
    padded = {k: torch.zeros((3, 32, *v.shape[2:]), dtype=v.dtype) for k, v in batch.items()}
    for k, v in batch.items():
        padded[k][:2, :20] = v
    head = torch.randn(40, 64) * 0.3
    results = []
    for b in (batch, padded):
        d = make_drafter().float()
        d.set_attention(attention)
        with torch.set_grad_enabled(attention == "eager"):
            loss, stats = ttt_loss(d, b, emb, head, 3, [30.0, 29.0, 28.0], fused=False)
        if attention == "eager":
            loss.backward()
        results.append((loss.detach(), stats, {n: p.grad for n, p in d.named_parameters() if p.grad is not None}))
    (l0, s0, g0), (l1, s1, g1) = results
    assert bool(g0) == (attention == "eager")
    assert torch.allclose(l0, l1, rtol=1e-5) and torch.allclose(s0, s1, rtol=1e-5)
    for n in g0:
        assert torch.allclose(g0[n], g1[n], rtol=1e-4, atol=1e-6), n
