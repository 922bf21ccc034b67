"""Self-distillation (DESIGN §7): replace assistant turns with the target's own answers, so the
drafter learns the distribution it will be asked to predict. User turns are kept; turn j is
regenerated conditioned on the regenerated turns before it."""
import logging

import torch
from tqdm import tqdm

log = logging.getLogger(__name__)


def regenerate(model, tok, convs: list[dict], max_new_tokens: int, temperature: float, batch_size: int,
               max_turns: int, seed: int, progress: bool = True) -> list[dict]:
    torch.manual_seed(seed)
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out = [{"id": c["id"], "messages": [dict(m) for m in c["messages"]]} for c in convs]
    # conversations are cut after their last regenerated assistant turn
    for c in out:
        seen, cut = 0, len(c["messages"])
        for i, m in enumerate(c["messages"]):
            if m["role"] == "assistant":
                seen += 1
                if seen == max_turns:
                    cut = i + 1
                    break
        c["messages"] = c["messages"][:cut]
    total = sum(sum(m["role"] == "assistant" for m in c["messages"]) for c in out)
    bar = tqdm(total=total, desc="generate", unit="turn", disable=not progress)
    for turn in range(max_turns):
        jobs = []  # (conversation, message index) of this turn's assistant message
        for c in out:
            idx = [i for i, m in enumerate(c["messages"]) if m["role"] == "assistant"]
            if turn < len(idx):
                jobs.append((c, idx[turn]))
        for b in range(0, len(jobs), batch_size):
            batch = jobs[b:b + batch_size]
            texts = [tok.apply_chat_template(c["messages"][:i], tokenize=False, add_generation_prompt=True)
                     for c, i in batch]
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            with torch.inference_mode():
                gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                                     temperature=temperature if temperature > 0 else None, top_p=None, top_k=None,
                                     pad_token_id=pad)
            for (c, i), row in zip(batch, gen[:, enc["input_ids"].shape[1]:]):
                c["messages"][i]["content"] = tok.decode(row, skip_special_tokens=True).strip() or "..."
            bar.update(len(batch))
    bar.close()
    return out
