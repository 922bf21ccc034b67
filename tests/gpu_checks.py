"""The CPU test suite's key properties, checked once on CUDA (a GPU host; not collected by pytest here).

    python -m tests.gpu_checks

1. Padded batch == samples one by one (hf backend, bf16 and fp32, a random 8-layer Llama on CUDA).
2. TTT unroll == naive recomputation (float64, eager attention, on CUDA), and the flex (fused)
   TTT attention == eager, forward and gradients, with the fused loss == the plain loss.
3. Speculative decoding is lossless on CUDA (random and oracle drafters = greedy output).
4. The own layers' Triton kernels (`llama_kernels`, `extract.hf.compile: kernels`) against the own
   eager layers, on two layers of the Llama-3.1-8B shape and a Qwen3-like GQA shape with q/k norms:
   float32 within summation order; bfloat16 no farther from the float32 states than eager's.
Prints one JSON with every figure and `all_passed`; exits 1 when a check fails.
"""

import json
import sys
import tempfile
from pathlib import Path

import torch

from eaglenest.extraction.backends.hf import HFBackend
from eaglenest.extraction.gate import token_stats
from eaglenest.target.taps import resolve_taps


def padded_vs_one_by_one(target) -> dict:
    from tests.conftest import random_samples

    out = {}
    # fp32 on CUDA: cuBLAS / SDPA pick other kernels for other batch shapes, so fp32 differs by
    # ~1e-3 relative at worst (CPU: 2e-5); bf16 keeps the CPU suite's tolerance.
    for dtype, min_cos, max_rel in (("float32", 0.99999, 2e-3), ("bfloat16", 0.999, 0.03)):
        be = HFBackend(target, resolve_taps("auto", target.num_layers), dtype=dtype, device="cuda")
        seqs = random_samples(5, target.vocab_size, 3, 90, seed=1)
        worst_cos, worst_rel = 1.0, 0.0
        for s, (a, f) in zip(seqs, be.extract(seqs)):
            a1, f1 = be.extract([s])[0]
            cos, rel = token_stats(torch.cat([a.flatten(0, 1), f]).float(), torch.cat([a1.flatten(0, 1), f1]).float())
            worst_cos, worst_rel = min(worst_cos, cos.min().item()), max(worst_rel, rel.max().item())
        out[dtype] = {"min_cos": worst_cos, "max_rel": worst_rel, "ok": worst_cos >= min_cos and worst_rel <= max_rel}
    return out


def ttt_checks() -> dict:
    from eaglenest.drafter.ttt import ttt_loss
    from tests.test_drafter import make_drafter, naive_layer

    torch.manual_seed(1)
    d = make_drafter().double().cuda()
    emb = torch.nn.Embedding(300, 64).double().cuda()
    T, K = 9, 4
    aux, ids = torch.randn(1, T, 3, 64, dtype=torch.double, device="cuda"), torch.randint(0, 300, (1, T), device="cuda")
    ttt = d(aux, ids, emb, K)
    g = d.project(aux)[0]
    worst = 0.0
    for t in range(T - K):
        xs, es, pos = list(g[: t + 1]), [emb(ids[0, s + 1]) for s in range(t + 1)], list(range(t + 1))
        for k in range(K):
            h = naive_layer(d, torch.stack(xs), torch.stack(es), pos)[-1]
            worst = max(worst, (d.logits(h) - ttt[k][0, t]).abs().max().item())
            xs.append(h)
            es.append(emb(ids[0, t + 2 + k]) if t + 2 + k < T else emb(torch.tensor(0, device="cuda")))
            pos.append(t + 1 + k)
    out = {"unroll_vs_naive_max_abs": worst, "unroll_ok": worst < 1e-5}

    # flex attention + fused loss vs eager attention + plain loss: fp32, a batch with masks
    d = make_drafter(vd=40).float().cuda()
    emb = torch.nn.Embedding(300, 64).cuda()
    B, T, K = 2, 200, 5
    batch = {
        "aux": torch.randn(B, T, 3, 64, device="cuda"),
        "final": torch.randn(B, T, 64, device="cuda"),
        "input_ids": torch.randint(0, 300, (B, T), device="cuda"),
        "loss_mask": (torch.rand(B, T, device="cuda") < 0.8).long(),
        "in_vocab": (torch.rand(B, T, device="cuda") < 0.9).long(),
    }
    head = torch.randn(40, 64, device="cuda")
    res = {}
    for attention, fused in (("eager", False), ("flex", True)):
        d.set_attention(attention)
        d.zero_grad()
        loss, stats = ttt_loss(d, batch, emb, head, K, [100.0] * K, fused=fused)
        loss.backward()
        res[attention] = (loss.item(), stats, {n: p.grad.clone() for n, p in d.named_parameters()})
    (l0, s0, g0), (l1, s1, g1) = res["eager"], res["flex"]
    grad_rel = max(((g0[n] - g1[n]).abs().max() / g0[n].abs().max().clamp_min(1e-12)).item() for n in g0)
    out.update(
        {
            "flex_fused_loss_rel_diff": abs(l0 - l1) / abs(l0),
            "flex_fused_grad_max_rel_diff": grad_rel,
            "flex_fused_stats_equal": bool(torch.allclose(s0, s1, rtol=1e-4)),
            "flex_fused_ok": abs(l0 - l1) / abs(l0) < 1e-4 and grad_rel < 1e-3,
        }
    )
    return out


def speculative_lossless(target) -> dict:
    import numpy as np

    from eaglenest.decoding.speculative import TargetRunner, greedy_decode, speculative_decode
    from eaglenest.drafter.config import DrafterConfig
    from eaglenest.drafter.model import Eagle3Drafter
    from eaglenest.target.loading import load_model
    from tests.conftest import random_samples
    from tests.test_train import oracle_drafter

    taps = [2, 4, 5]
    model = load_model(target, dtype="float32", device="cuda")
    runner, embed = TargetRunner(model, taps), model.get_input_embeddings()
    cfg = json.loads((target.model_dir / "config.json").read_text())
    out, ok = {"prompts": 0, "random_identical": 0, "oracle_identical": 0}, True
    for seed in range(3):
        torch.manual_seed(seed)
        drafter = Eagle3Drafter(DrafterConfig.from_target(cfg, 64, taps))
        drafter.set_vocab(torch.arange(3, 67))
        drafter = drafter.eval().cuda()
        rng = np.random.default_rng(seed)
        for prompt in random_samples(3, 200, 3, 40, seed=seed):
            prompt = prompt.tolist()
            g = greedy_decode(runner, prompt, 24, eos={2})
            s = speculative_decode(runner, drafter, embed, prompt, 24, eos={2}, k=3)
            s2 = speculative_decode(
                runner, drafter, embed, prompt, 24, eos={2}, k=3, draft_fn=oracle_drafter(g.tokens, len(prompt), rng)
            )
            out["prompts"] += 1
            out["random_identical"] += s.tokens == g.tokens
            out["oracle_identical"] += s2.tokens == g.tokens
            ok &= s.tokens == g.tokens and s2.tokens == g.tokens
    out["ok"] = ok
    return out


def kernels_vs_eager() -> dict:
    """Per shape: float32 kernels against float32 eager (summation order only), and bfloat16 kernels
    against bfloat16 eager, each measured from the float32 eager states: the kernels round once per
    step, so they should sit no farther from float32 than eager does."""
    import dataclasses

    from eaglenest.extraction.backends import llama, llama_kernels

    base = llama.Spec(layers=2, hidden=4096, intermediate=14336, vocab=1000, heads=32, kv_heads=8, head_dim=128,
                      eps=1e-5, rope=(5e5, (8.0, 1.0, 4.0, 8192.0)), optional=())  # fmt: skip
    qwen3 = dataclasses.replace(base, hidden=2048, intermediate=6144, heads=16, kv_heads=4, rope=(1e6, None),
                                optional=("self_attn.q_norm.weight", "self_attn.k_norm.weight"))  # fmt: skip

    def states(spec, w, ids, kernels):
        dec = llama.Decoder(spec, w, llama_kernels.OPS if kernels else llama.EAGER)
        with torch.inference_mode():
            a, f = dec.run(ids, (True,) * spec.layers)
        return torch.cat([*a, f]).flatten(0, 1).float()

    out, ok = {}, True
    for name, spec in (("llama8b", base), ("qwen3", qwen3)):
        g = torch.Generator(device="cuda").manual_seed(0)
        w = {k: torch.randn(s, device="cuda", generator=g).mul_(0.02 if len(s) == 2 else 1).to(torch.bfloat16)
             for k, s in llama.shapes(spec).items()}  # fmt: skip
        w32 = {k: v.float() for k, v in w.items()}
        ids = torch.randint(0, spec.vocab, (3, 517), device="cuda", generator=g)
        ref = states(spec, w32, ids, False)
        k32, e16, k16 = states(spec, w32, ids, True), states(spec, w, ids, False), states(spec, w, ids, True)
        rel32 = token_stats(ref, k32)[1].max().item()
        e_rel, k_rel = token_stats(ref, e16)[1].mean().item(), token_stats(ref, k16)[1].mean().item()
        r = {"float32_max_rel": rel32, "bf16_eager_rel_mean": e_rel, "bf16_kernels_rel_mean": k_rel,
             "bf16_bit_equal_eager": round((e16 == k16).float().mean().item(), 4),
             "ok": rel32 <= 1e-5 and k_rel <= e_rel * 1.02}  # fmt: skip
        out[name], ok = r, ok and r["ok"]
    out["ok"] = ok
    return out


def main():
    res = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }
    with tempfile.TemporaryDirectory() as tmp:
        from tests.conftest import make_tiny_target

        target = make_tiny_target(Path(tmp))
        for name, fn in (
            ("padded_vs_one_by_one", lambda: padded_vs_one_by_one(target)),
            ("ttt", ttt_checks),
            ("speculative_lossless", lambda: speculative_lossless(target)),
            ("kernels_vs_eager", kernels_vs_eager),
        ):
            try:
                res[name] = fn()
            except Exception as e:  # noqa: BLE001 - report every check, then fail
                res[name] = {"error": f"{type(e).__name__}: {e}"}
            print(json.dumps({name: res[name]}, default=str), flush=True)
    oks = [res["padded_vs_one_by_one"].get(k, {}).get("ok") for k in ("float32", "bfloat16")]
    oks += [res["ttt"].get("unroll_ok"), res["ttt"].get("flex_fused_ok"), res["speculative_lossless"].get("ok")]
    oks += [res["kernels_vs_eager"].get("ok")]
    res["all_passed"] = all(bool(x) for x in oks)
    print(json.dumps(res, indent=2, default=str))
    sys.exit(0 if res["all_passed"] else 1)


if __name__ == "__main__":
    main()
