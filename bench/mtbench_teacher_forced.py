"""Where does the gap between the trainer's validation figure and MT-bench tau come from?

The trainer reports, on held-out ShareGPT samples, each TTT step's top-1 agreement with the target
under teacher forcing, and a "simulated tau" 1 + sum_k prod_{i<=k} acc_i. This bench computes the same
figures on MT-bench itself: the target's own greedy answers to the 80 first turns, their hidden
states taken in bf16 as extraction takes them, scored by the same `ttt_loss` statistics. Then:
- MT-bench teacher-forced ~ ShareGPT val  -> the data match; the gap is the simulated-tau formula
  (acceptance is decided per verification, not per token, and errors cluster).
- MT-bench teacher-forced << ShareGPT val -> the drafter knows ShareGPT-like text better than MT-bench's.

    python -m bench.mtbench_teacher_forced [--repo .] [--max-new-tokens 256] [--out FILE]
(run in a repository where data/target, data/drafter and data/packed exist, e.g. after the GPU profile)."""

import argparse
import json
from pathlib import Path

import torch

from eaglenest.data.packed import load_vocab
from eaglenest.decoding import batched_speculative
from eaglenest.drafter.acceptance import simulated_acceptance, summarize
from eaglenest.drafter.model import Eagle3Drafter, FrozenEmbedding
from eaglenest.drafter.ttt import ttt_loss
from eaglenest.evaluate import mtbench_prompts
from eaglenest.target import load_heads, load_model, load_target, load_tokenizer, stop_ids


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", type=Path, default=Path("."))
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--questions", type=int, default=80)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    target = load_target(a.repo / "data/target")
    tok = load_tokenizer(target)
    drafter = Eagle3Drafter.from_pretrained(a.repo / "data/drafter").to(dev).eval()
    taps = drafter.config.taps
    prompts = []
    for p in mtbench_prompts(a.questions):
        x = tok.apply_chat_template(
            [{"role": "user", "content": p["text"]}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        prompts.append(list(x["input_ids"] if isinstance(x, dict) else x))
    # the answers evaluate verifies against: greedy, fp32 target
    fp32 = load_model(target, dtype="float32", device=dev)
    eos = stop_ids(fp32, tok) | {tok.eos_token_id}
    rows = batched_speculative.decode(fp32, taps, prompts, a.max_new_tokens, eos, k=0)
    del fp32
    # their states as extraction takes them: the bf16 target
    model = load_model(target, dtype="bfloat16", device=dev)
    heads = load_heads(target)
    vocab = load_vocab(a.repo / "data/packed")
    embed = FrozenEmbedding(heads["embed"]).to(dev)
    head_sel = heads["lm_head"][vocab["selected"]].to(dev)
    t2d = vocab["t2d"].to(dev)
    stats = torch.zeros(a.steps, 3, device=dev)
    for p, r in zip(prompts, rows):
        ids = torch.tensor([p + r.out], device=dev)
        out = model(input_ids=ids, output_hidden_states=True)
        aux = torch.stack([out.hidden_states[j] for j in taps], 2)
        final = out.hidden_states[-1]
        mask = torch.zeros_like(ids)
        mask[0, len(p) :] = 1
        batch = {
            "aux": aux,
            "final": final,
            "input_ids": ids,
            "loss_mask": mask,
            "in_vocab": t2d[(final @ heads["lm_head"].to(dev).T).argmax(-1)].long(),
        }
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            _, st = ttt_loss(drafter, batch, embed, head_sel, a.steps, [1.0] * a.steps)
        stats += st.float()
    s = summarize(stats)
    train = json.loads((a.repo / "metrics/train.json").read_text()) if (a.repo / "metrics/train.json").exists() else {}
    ev = (
        json.loads((a.repo / "metrics/evaluate.json").read_text())
        if (a.repo / "metrics/evaluate.json").exists()
        else {}
    )
    res = {
        "mtbench_teacher_forced_acc_per_step": s["acc_per_step"],
        "mtbench_teacher_forced_sim_tau_k3": simulated_acceptance(s["acc_per_step"][:3]),
        "mtbench_answer_tokens": s["tokens"],
        "sharegpt_val_acc_per_step": train.get("val_acc_per_step"),
        "sharegpt_val_sim_tau_k3": simulated_acceptance(train["val_acc_per_step"][:3]) if train else None,
        "mtbench_tau_k3": ev.get("tau", {}).get("3"),
        "mtbench_accept_per_position_k3": ev.get("accept_rate_per_position", {}).get("3"),
    }
    print(json.dumps(res, indent=1))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
