"""Render conversations with the target's chat template and derive the loss mask from the
rendering itself: an assistant turn's span is what rendering the conversation up to and including
that turn adds to the rendering up to its generation prompt. No model-specific regex."""

import logging
import multiprocessing
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from eaglenest.files.atomic import replaced_file
from eaglenest.runtime import children
from eaglenest.runtime.errors import EaglenestError

log = logging.getLogger(__name__)

SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("n_tokens", pa.int32()),
    ]
)


def token_table(seqs, ids=None, loss_masks=None) -> pa.Table:
    """Token sequences as a tokenized part (SCHEMA); the loss over every token unless masks are given.
    For tests and benches that make parts without a chat template."""
    seqs = [np.asarray(s).tolist() for s in seqs]
    return pa.table(
        {
            "id": ids or [f"s{i}" for i in range(len(seqs))],
            "input_ids": seqs,
            "loss_mask": [np.asarray(m).tolist() for m in loss_masks] if loss_masks else [[1] * len(s) for s in seqs],
            "n_tokens": [len(s) for s in seqs],
        },
        schema=SCHEMA,
    )


def write_tokenized(table: pa.Table, path: Path) -> Path:
    """Write a tokenized part all or nothing (temp file, rename): a half-written Parquet is never read."""
    with replaced_file(path) as tmp:
        pq.write_table(table, tmp)
    return Path(path)


def require_template(tokenizer, name: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise EaglenestError(
            f"target tokenizer {name} has no chat template; give a chat model or add "
            f"a chat_template.jinja to its directory"
        )


def _render(tokenizer, messages, gen_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)


def assistant_char_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Full rendering and the [start, end) character spans of every assistant turn."""
    full = _render(tokenizer, messages, False)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:k], True)
        upto = _render(tokenizer, messages[: k + 1], False)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise ValueError(
                f"chat template is not prefix-stable at turn {k}: rendering a prefix of the "
                f"conversation is not a prefix of the full rendering"
            )
        spans.append((len(before), len(upto)))
    return full, spans


def tokenize_conversation(tokenizer, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """input_ids and loss_mask (1 on tokens inside assistant spans, template end-of-turn included)."""
    text, spans = assistant_char_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int32)
    mask = np.zeros(len(ids), dtype=np.uint8)
    starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
    for a, b in spans:
        mask[(starts >= a) & (starts < b)] = 1
    return ids, mask


_TOKENIZER = None  # a worker's tokenizer: inherited through fork, never pickled


def _encode(messages: list[dict]):
    """(ids, mask, None), or (None, None, the error) where the template cannot render them."""
    try:
        return (*tokenize_conversation(_TOKENIZER, messages), None)
    except Exception as e:  # jinja raises its own types for unrenderable role sequences
        return None, None, str(e)


def _encoded(tokenizer, convs: list[dict], workers: int):
    """_encode over convs, in order; with workers > 1 in forked processes (Jinja renderings and an
    encoding per conversation ran at ~400 conversations/s in one process: ~35 s for each 15k-sample
    part of the GPU profile). The same results for any worker count."""
    global _TOKENIZER
    _TOKENIZER = tokenizer
    if workers <= 1 or len(convs) < 2 or "fork" not in multiprocessing.get_all_start_methods():
        yield from map(_encode, (c["messages"] for c in convs))
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per process; quiet after fork
    with multiprocessing.get_context("fork").Pool(min(workers, len(convs)), children.worker_init) as pool:
        yield from pool.imap(_encode, (c["messages"] for c in convs), chunksize=64)


def tokenize_part(
    tokenizer, convs: list[dict], max_seq_len: int, source: str, on_error: str = "fail", workers: int = 1
):
    """Tokenize a part. Returns (pyarrow Table, stats). Truncation at max_seq_len is counted;
    conversations the template cannot render are an error naming the sample (or counted, on skip).
    `workers` processes render and encode (the same table for any count)."""
    if max_seq_len <= 0:
        raise EaglenestError(f"tokenize.max_seq_len must be > 0, got {max_seq_len}")
    rows = {"id": [], "input_ids": [], "loss_mask": [], "n_tokens": []}
    stats = {"samples": 0, "tokens": 0, "loss_tokens": 0, "truncated": 0, "skipped": 0, "skipped_reasons": {}}
    for c, (ids, mask, error) in zip(convs, _encoded(tokenizer, convs, workers)):
        if error is not None:
            if on_error == "fail":
                raise EaglenestError(f"{source}: sample {c['id']!r}: cannot render with the chat template: {error}")
            stats["skipped"] += 1
            stats["skipped_reasons"]["unrenderable"] = stats["skipped_reasons"].get("unrenderable", 0) + 1
            continue
        if len(ids) > max_seq_len:
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
            stats["truncated"] += 1
        if mask.sum() == 0:  # truncation cut every assistant token: nothing to learn from
            stats["skipped"] += 1
            stats["skipped_reasons"]["no loss tokens after truncation"] = (
                stats["skipped_reasons"].get("no loss tokens after truncation", 0) + 1
            )
            continue
        rows["id"].append(c["id"])
        rows["input_ids"].append(ids)
        rows["loss_mask"].append(mask)
        rows["n_tokens"].append(len(ids))
        stats["samples"] += 1
        stats["tokens"] += len(ids)
        stats["loss_tokens"] += int(mask.sum())
    lengths = np.asarray(rows["n_tokens"] or [0])
    stats["length_p50"], stats["length_p90"], stats["length_p99"] = (
        float(np.percentile(lengths, q)) for q in (50, 90, 99)
    )
    stats["length_max"] = int(lengths.max())
    table = pa.table(rows, schema=SCHEMA)
    return table, stats
