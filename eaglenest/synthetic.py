"""Prompts the target writes itself (docs/design.md: Synthetic parts): given its chat template's
opening of a user turn (after an optional system prompt), the target samples a user message; the
`generate` stage then answers it by self-distillation. More on-policy data where the human prompts
run out. A part of several turns carries `follow_ups` on each conversation: after each answer,
`generate` has the target write the next user message the same way (`follow_up_messages`).

Samples are seeded per round, then filtered in order: degenerate text (empty, cut at
`max_prompt_tokens`, repetition, template tokens inside the message) and duplicates (exact after
normalising case and spacing, and near: Jaccard similarity of character 5-gram sets >= the
threshold, found with MinHash banding and then checked exactly). Rounds continue until `count`
prompts are kept; every drop is counted by reason."""

import logging
import re
from collections import Counter

import numpy as np
import xxhash
from tqdm import tqdm

from eaglenest.decoding.batch_decode import decode_all
from eaglenest.runtime.errors import EaglenestError
from eaglenest.target.loading import stop_ids

log = logging.getLogger(__name__)
SENTINEL = "EaglenestUserTurnSentinel"
PERMS, BANDS = 64, 16  # MinHash: 16 bands of 4 rows: pairs above ~0.5 Jaccard meet in a band
MAX_ROUNDS = 8


def user_turn_opening(tok, before: list[dict]) -> tuple[str, str]:
    """(the text before a user message's content, the text right after it) in the chat template, the
    user turn coming after the messages `before` (none, a system prompt, or a conversation so far)."""
    if not getattr(tok, "chat_template", None):
        raise EaglenestError(f"{tok.name_or_path}: the tokenizer has no chat template to open a user turn with")
    text = tok.apply_chat_template([*before, {"role": "user", "content": SENTINEL}], tokenize=False)
    if text.count(SENTINEL) != 1:
        raise EaglenestError(f"{tok.name_or_path}: the chat template does not render a user message's text once")
    head, tail = text.split(SENTINEL)
    return head, tail


def end_of_turn_ids(model, tok, tail: str) -> set[int]:
    """The model's stop ids, plus the special token that closes a user turn in the template."""
    ids = set(stop_ids(model, tok))
    first = tok(tail, add_special_tokens=False)["input_ids"][:1]
    if first and first[0] in set(tok.all_special_ids):
        ids.add(first[0])
    return ids


def normalise(text: str) -> str:
    return " ".join(text.lower().split())


def shingles(text: str, n: int = 5) -> set[str]:
    t = normalise(text)
    return {t[i : i + n] for i in range(max(1, len(t) - n + 1))}


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


class NearDuplicates:
    """Texts seen so far, indexed by MinHash bands; `add` says whether a text is near one of them."""

    def __init__(self, threshold: float, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.a = rng.integers(1, 2**63, PERMS, dtype=np.uint64) | np.uint64(1)
        self.b = rng.integers(0, 2**63, PERMS, dtype=np.uint64)
        self.threshold, self.buckets, self.sets = threshold, {}, []

    def signature(self, grams: set[str]) -> np.ndarray:
        x = np.fromiter((xxhash.xxh32_intdigest(g.encode()) for g in grams), np.uint64, len(grams))
        with np.errstate(over="ignore"):  # multiply-shift hashing wraps by design
            return ((x[:, None] * self.a + self.b) >> np.uint64(32)).min(0)

    def add(self, text: str) -> bool:
        """True (not added) when `text` is near a text added before; else add it."""
        grams = shingles(text)
        rows = self.signature(grams).reshape(BANDS, -1)
        keys = [(band, r.tobytes()) for band, r in enumerate(rows)]
        seen = {j for k in keys for j in self.buckets.get(k, ())}
        if any(jaccard(grams, self.sets[j]) >= self.threshold for j in sorted(seen)):
            return True
        for k in keys:
            self.buckets.setdefault(k, []).append(len(self.sets))
        self.sets.append(grams)
        return False


def degenerate(text: str, ended: bool, special: bool) -> str | None:
    """Why a sampled message is unusable, or None."""
    if not text.strip():
        return "empty"
    if not ended:
        return "cut"
    if special:
        return "template_tokens"
    words = text.split()
    grams = list(zip(words, words[1:], words[2:]))
    if re.search(r"(.)\1{15,}", text) or (len(grams) >= 6 and len(set(grams)) < 0.5 * len(grams)):
        return "repetition"
    return None


def sample_prompts(
    model,
    tok,
    count: int,
    seed: int,
    temperature: float,
    system: str | None = None,
    max_prompt_tokens: int = 128,
    near_duplicate: float = 0.7,
    batch_tokens: int = 65536,
    max_rows: int = 256,
    progress: bool = True,
) -> tuple[list[str], dict]:
    """`count` user messages the target wrote, in sampling order, and the accounting: sampled, kept,
    dropped by reason, rounds, tokens."""
    if temperature <= 0:
        raise EaglenestError("synthetic prompts need a temperature > 0: greedy decoding writes one prompt")
    if count <= 0:
        raise EaglenestError(f"synthetic count must be > 0, got {count}")
    head, tail = user_turn_opening(tok, system_messages(system))
    prompt = tok(head, add_special_tokens=False)["input_ids"]
    eos, pad = end_of_turn_ids(model, tok, tail), tok.pad_token_id if tok.pad_token_id is not None else 0
    special = set(tok.all_special_ids) - eos
    kept, stats, seen, near = [], Counter(), set(), NearDuplicates(near_duplicate, seed)
    bar = tqdm(total=count, desc="synthetic prompts", unit="prompt", disable=not progress)
    for r in range(MAX_ROUNDS):
        n = -(-(count - len(kept)) * 5 // 4) + 8  # a quarter more than missing: some are dropped
        done = decode_all(
            model, [prompt] * n, [max_prompt_tokens] * n, eos, pad, temperature, seed * 1_000_003 + r,
            batch_tokens, max_rows,
        )  # fmt: skip
        texts = tok.batch_decode([d.tokens for d in done], skip_special_tokens=True)
        stats["rounds"], stats["sampled"] = r + 1, stats["sampled"] + n
        for j, (d, text) in enumerate(zip(done, texts)):
            stats["sampled_tokens"] += len(d.tokens)
            why = degenerate(text, d.ended, any(t in special for t in d.tokens))
            if why is None:
                key = normalise(text)
                why = "duplicate" if key in seen else ("near_duplicate" if near.add(text) else None)
                seen.add(key)
            if why is not None:
                stats[f"dropped_{why}"] += 1
                continue
            kept.append(text.strip())
            bar.update(1)
            if len(kept) == count:
                stats["unused"] = n - j - 1  # sampled past the count: neither kept nor judged
                break
        if len(kept) == count:
            break
    bar.close()
    stats["kept"] = len(kept)
    if len(kept) < count:
        drops = {k: v for k, v in stats.items() if k.startswith("dropped_")}
        raise EaglenestError(
            f"only {len(kept)} of {count} synthetic prompts usable after {MAX_ROUNDS} rounds "
            f"({stats['sampled']} sampled; dropped: {drops}): raise the temperature or max_prompt_tokens"
        )
    return kept, dict(stats)


def system_messages(system: str | None) -> list[dict]:
    return [{"role": "system", "content": system}] if system else []


def conversations(name: str, prompts: list[str], system: str | None, follow_ups: dict | None = None) -> list[dict]:
    """Prompt-only conversations (`generate` answers them), ids <name>-000000...; `follow_ups`
    (`{turns, temperature, seed, max_tokens, near_duplicate}`) asks generate for more user turns."""
    extra = {"follow_ups": follow_ups} if follow_ups else {}
    return [
        {"id": f"{name}-{i:06d}", "messages": [*system_messages(system), {"role": "user", "content": p}], **extra}
        for i, p in enumerate(prompts)
    ]


def follow_up_messages(
    model,
    tok,
    convs: list[dict],
    spec: dict,
    turn: int,
    max_seq_len: int | None = None,
    batch_tokens: int = 65536,
    max_rows: int = 256,
    on_tokens=None,
) -> list[tuple[str | None, str | None, int]]:
    """The next user message the target writes after each conversation (each ends in an answer):
    (text, None, tokens) or (None, why it is unusable, tokens). Sampled at `spec`'s temperature,
    seeded by (seed, turn); filtered as opening prompts, and a message near an earlier user turn of
    its own conversation (`spec["near_duplicate"]`) is dropped as `repeats_earlier_turn`."""
    heads, tails = zip(*(user_turn_opening(tok, c["messages"]) for c in convs))
    prompts = tok(list(heads), add_special_tokens=False)["input_ids"]
    eos, pad = end_of_turn_ids(model, tok, tails[0]), tok.pad_token_id if tok.pad_token_id is not None else 0
    special = set(tok.all_special_ids) - eos
    limit = max_seq_len if max_seq_len is not None else float("inf")
    room = [min(spec["max_tokens"], limit - len(p)) for p in prompts]
    fits = [i for i, r in enumerate(room) if r > 0]
    done = dict(zip(fits, decode_all(
        model, [prompts[i] for i in fits], [room[i] for i in fits], eos, pad, spec["temperature"],
        spec["seed"] * 1_000_003 + 1000 + turn, batch_tokens, max_rows, on_tokens,
    )))  # fmt: skip
    out = []
    for i, c in enumerate(convs):
        if i not in done:
            out.append((None, "no_room", 0))
            continue
        d = done[i]
        text = tok.decode(d.tokens, skip_special_tokens=True)
        why = degenerate(text, d.ended, any(t in special for t in d.tokens))
        if why is None:
            grams = shingles(text)
            earlier = (shingles(m["content"]) for m in c["messages"] if m["role"] == "user")
            if any(jaccard(grams, g) >= spec["near_duplicate"] for g in earlier):
                why = "repeats_earlier_turn"
        out.append((None, why, len(d.tokens)) if why else (text.strip(), None, len(d.tokens)))
    return out
