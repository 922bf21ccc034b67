"""SpecForge 0.2.0's EAGLE-3 training step beside eaglenest's, same shapes, same GPU, same weights
and batch (issue: GPU performance). SpecForge is installed `--no-deps` for this benchmark only.

    python -m bench.specforge_step [--reps 6]

Shapes: H 4096, 32/8 heads, I 14336, target vocab 128256, draft vocab 32000 (t2d = the first 32000
ids), TTT 7, one 2048-token sequence. SpecForge: `LlamaForCausalLMEagle3` (flex attention) in bf16
under `OnlineEagle3Model`, its Triton loss, its `BF16Optimizer` (fp32 master + AdamW, clip 0.5),
loss = sum_k 0.8^k ploss_k; its inputs shifted by one as its `TargetHead.preprocess` does.
eaglenest: the same weights in fp32 master, bf16 autocast, flex TTT attention, the layer compiled
around it, fused loss, fused AdamW, clip 0.5, denominators T (so both losses are sum_k 0.8^k sum_t mask CE / T).
Before timing, both losses and their gradients are compared on the shared batch.
"""

import argparse
import json
import os

import torch

from .gpu import cuda_time

T, H, V, VD, K = 2048, 4096, 128256, 32000, 7


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=6)
    args = ap.parse_args()
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.optimizer import BF16Optimizer
    from specforge.utils import padding
    from transformers import LlamaConfig

    from eaglenest.drafter.config import DrafterConfig
    from eaglenest.drafter.model import Eagle3Drafter, FrozenEmbedding
    from eaglenest.drafter.ttt import ttt_loss

    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=14336,
        num_hidden_layers=1,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        pad_token_id=0,
    )
    cfg.draft_vocab_size = VD
    cfg.target_hidden_size = H
    torch.manual_seed(0)
    sf = LlamaForCausalLMEagle3(cfg, attention_backend="flex_attention").cuda().to(torch.bfloat16)
    with torch.no_grad():
        sf.embed_tokens.weight.normal_(0, 0.02)
        sf.t2d.zero_()
        sf.t2d[:VD] = True
        sf.d2t.zero_()
    sf.embed_tokens.weight.requires_grad_(False)
    sf_model = OnlineEagle3Model(sf, length=K, attention_backend="flex_attention")

    dcfg = DrafterConfig.from_target({**cfg.to_dict(), "num_hidden_layers": 32}, VD, [2, 16, 29])
    ours = Eagle3Drafter(dcfg).cuda()
    missing, unexpected = ours.load_state_dict(
        {k: v.float() for k, v in sf.state_dict().items() if not k.startswith("embed_tokens")}, strict=False
    )
    res["weights_not_shared"] = {
        "missing": [m for m in missing if not m.startswith("rotary")],
        "unexpected": unexpected,
    }
    ours.set_vocab(torch.arange(VD, device="cuda"))
    ours.set_attention("flex")
    ours.compile_blocks()  # as the trainer does on CUDA (train.compile: auto)
    embed = FrozenEmbedding(sf.embed_tokens.weight.detach())

    g = torch.Generator(device="cuda").manual_seed(1)
    aux = torch.randn(1, T, 3, H, device="cuda", generator=g).to(torch.bfloat16)
    final = torch.randn(1, T, H, device="cuda", generator=g).to(torch.bfloat16)
    lm_head = (torch.randn(V, H, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    ids = torch.randint(0, V, (1, T), device="cuda", generator=g)
    target = final @ lm_head.T  # the target's logits [1, T, V]
    in_vocab = (target.argmax(-1) < VD).long()
    batch = {
        "aux": aux.float(),
        "final": final.float(),
        "input_ids": ids,
        "loss_mask": torch.ones(1, T, dtype=torch.long, device="cuda"),
        "in_vocab": in_vocab,
    }
    head_sel = lm_head[:VD].clone()
    del lm_head

    def sf_loss():
        plosses = sf_model(
            input_ids=padding(ids, left=False),
            attention_mask=torch.ones_like(ids),
            target=padding(target, left=False),
            loss_mask=torch.ones(1, T, 1, device="cuda"),
            hidden_states=aux.flatten(-2),
        )[0]
        return sum(0.8**k * p for k, p in enumerate(plosses)), plosses

    def our_loss():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return ttt_loss(ours, batch, embed, head_sel, K, [float(T)] * K)

    # 1. the same loss on the same inputs
    la, plosses = sf_loss()
    la.backward()
    lb, stats = our_loss()
    lb.backward()
    cos = {}
    for name in ("fc.weight", "lm_head.weight", "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight"):
        a = dict(sf.named_parameters())[name].grad.float().flatten()
        b = dict(ours.named_parameters())[name].grad.float().flatten()
        cos[name] = round(torch.nn.functional.cosine_similarity(a, b, 0).item(), 5)
    res["agreement"] = {
        "specforge_loss": la.item(),
        "eaglenest_loss": lb.item(),
        "rel_diff": abs(la.item() - lb.item()) / abs(la.item()),
        "per_step_specforge": [round(p.item(), 5) for p in plosses],
        "per_step_eaglenest": [round(x, 5) for x in (stats[:, 0] / T).tolist()],
        "grad_cosine": cos,
    }
    print(json.dumps(res), flush=True)
    sf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)

    # 2. timing, each on its own (memory peaks measured apart)
    opt = BF16Optimizer(sf, lr=1e-4, max_grad_norm=0.5, total_steps=1000)

    def sf_step():
        loss, _ = sf_loss()
        loss.backward()
        opt.step()
        sf.zero_grad(set_to_none=True)

    ours.cpu()
    embed.cpu()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    dt = cuda_time(sf_step, reps=args.reps)
    res["specforge"] = {
        "step_ms": round(dt * 1e3, 1),
        "tok_s": round(T / dt, 1),
        "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }
    print(json.dumps(res), flush=True)
    opt = None  # `sf_step` holds it
    sf.cpu()
    torch.cuda.empty_cache()

    ours.cuda()
    embed.cuda()
    target = None  # noqa: F841 - SpecForge's input only
    torch.cuda.empty_cache()
    o2 = torch.optim.AdamW(ours.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=True)

    def our_step():
        o2.zero_grad(set_to_none=True)
        loss, _ = our_loss()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ours.parameters(), 0.5)
        o2.step()

    torch.cuda.reset_peak_memory_stats()
    dt = cuda_time(our_step, reps=args.reps)
    res["eaglenest"] = {
        "step_ms": round(dt * 1e3, 1),
        "tok_s": round(T / dt, 1),
        "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }
    res["speedup"] = round(res["eaglenest"]["tok_s"] / res["specforge"]["tok_s"], 3)
    print(json.dumps(res, indent=2), flush=True)
    out = os.environ.get("BENCH_OUT", "bench/out/gpu")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "specforge.json"), "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
