import copy

import pytest

from eaglenest.data.chat import require_template, tokenize_conversation, tokenize_part
from eaglenest.runtime.errors import EaglenestError

CONV = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "Six, of course."},
]


def test_loss_mask_covers_exactly_the_assistant_turns(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids, mask = tokenize_conversation(tok, CONV)
    assert len(ids) == len(mask)
    masked = tok.decode(ids[mask == 1])
    assert masked == "It is 4.<|im_end|>\nSix, of course.<|im_end|>\n"
    # the user turns, the default system prompt and the role headers stay unmasked
    unmasked = tok.decode(ids[mask == 0])
    assert "What is 2+2?" in unmasked and "SmolLM" in unmasked and "It is 4" not in unmasked
    # the full rendering is what the template produces
    assert tok.decode(ids) == tok.apply_chat_template(CONV, tokenize=False)


def test_truncation_and_skips_are_counted(smollm2_tokenizer):
    convs = [
        {"id": "short", "messages": CONV},
        {
            "id": "long",
            "messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}],
        },
    ]
    table, stats = tokenize_part(smollm2_tokenizer, convs, max_seq_len=100, source="x")
    assert stats["truncated"] == 1  # "long" is cut, and its only assistant turn with it
    assert stats["skipped_reasons"] == {"no loss tokens after truncation": 1}
    assert table.column("id").to_pylist() == ["short"]
    assert max(table.column("n_tokens").to_pylist()) <= 100


def test_bad_max_seq_len(smollm2_tokenizer):
    with pytest.raises(EaglenestError, match="max_seq_len"):
        tokenize_part(smollm2_tokenizer, [], max_seq_len=0, source="x")


def test_unrenderable_conversation_names_sample(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('system role not supported') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    convs = [
        {"id": "ok", "messages": CONV[:2]},
        {"id": "sys-7", "messages": [{"role": "system", "content": "s"}] + CONV[:2]},
    ]
    for workers in (1, 2):  # rendered in this process, or in worker processes
        with pytest.raises(EaglenestError, match=r"sample 'sys-7'.*system role not supported"):
            tokenize_part(tok, convs, 128, source="part.jsonl", workers=workers)
        table, stats = tokenize_part(tok, convs, 128, source="part.jsonl", on_error="skip", workers=workers)
        assert table.num_rows == 1 and stats["skipped_reasons"] == {"unrenderable": 1}


def test_worker_processes_give_the_same_table(smollm2_tokenizer):
    convs = [
        {"id": f"c{i}", "messages": [{"role": "user", "content": f"q{i} " * (i % 7 + 1)}, CONV[1]] + CONV[2:][: i % 3]}
        for i in range(150)
    ]
    one, s1 = tokenize_part(smollm2_tokenizer, convs, 40, source="x")
    three, s3 = tokenize_part(smollm2_tokenizer, convs, 40, source="x", workers=3)
    assert one.equals(three) and s1 == s3 and s1["samples"] + s1["skipped"] == 150 and s1["truncated"] > 0


def test_missing_chat_template_is_an_error(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = None
    with pytest.raises(EaglenestError, match="no chat template"):
        require_template(tok, "some/model")
