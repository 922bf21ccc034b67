"""Synthetic parts: the real target writes user prompts from its chat template's opening of a user
turn, seeded, filtered and deduplicated; `generate` answers them; bad settings fail clearly."""

import copy
import json

import pytest
import yaml

from eaglenest.data.conversations import read_jsonl
from eaglenest.runtime.errors import EaglenestError
from eaglenest.synthetic import (
    NearDuplicates,
    degenerate,
    follow_up_messages,
    normalise,
    sample_prompts,
    user_turn_opening,
)
from eaglenest.target.loading import load_model

from .conftest import generate_params, make_clone, ran, run_py, sh, stage_workspace, tiny_params, write_params


@pytest.fixture(scope="module")
def fp32(smollm2):
    return load_model(smollm2, dtype="float32", device="cpu")


def test_near_duplicates_are_found_and_distinct_prompts_kept():
    near = NearDuplicates(0.7)
    base = "Can you explain how photosynthesis works in plants, step by step, for a student?"
    assert not near.add(base)
    assert near.add(base.replace("student", "students"))  # one word apart
    assert near.add(base.upper())  # case and spacing are normalised
    assert not near.add("Write a haiku about the sea at night.")
    assert not near.add("What is the capital of Australia, and why was it chosen?")
    assert len(near.sets) == 3
    assert normalise("  A  b\nC ") == "a b c"


def test_degenerate_text_is_named():
    assert degenerate("  \n", True, False) == "empty"
    assert degenerate("How do I", False, False) == "cut"
    assert degenerate("Hi <|im_start|>assistant", True, True) == "template_tokens"
    assert degenerate("the cat the cat the cat the cat the cat the cat the cat", True, False) == "repetition"
    assert degenerate("Why?!!!!!!!!!!!!!!!!!!!!", True, False) == "repetition"
    assert degenerate("What are three good books about the history of Rome?", True, False) is None


def test_the_target_writes_seeded_distinct_prompts(fp32, smollm2_tokenizer):
    tok = smollm2_tokenizer
    head, tail = user_turn_opening(tok, [])
    assert head.endswith("<|im_start|>user\n") and tail.startswith("<|im_end|>")
    a, stats = sample_prompts(fp32, tok, 10, 0, 1.0, max_prompt_tokens=48, progress=False)
    assert len(a) == 10 == stats["kept"] and len({normalise(x) for x in a}) == 10
    drops = sum(v for k, v in stats.items() if k.startswith("dropped_"))
    assert stats["sampled"] == stats["kept"] + drops + stats["unused"] and stats["sampled_tokens"] > 0
    assert all(x == x.strip() and x for x in a)
    again, _ = sample_prompts(fp32, tok, 10, 0, 1.0, max_prompt_tokens=48, progress=False)
    other, _ = sample_prompts(fp32, tok, 10, 1, 1.0, max_prompt_tokens=48, progress=False)
    assert again == a and other != a


def test_settings_that_cannot_give_prompts_fail_clearly(fp32, smollm2_tokenizer):
    tok = smollm2_tokenizer
    with pytest.raises(EaglenestError, match="temperature > 0"):
        sample_prompts(fp32, tok, 4, 0, 0.0, progress=False)
    bare = copy.copy(tok)
    bare.chat_template = None
    with pytest.raises(EaglenestError, match="no chat template"):
        sample_prompts(fp32, bare, 4, 0, 1.0, progress=False)
    with pytest.raises(EaglenestError, match=r"only \d+ of 6 synthetic prompts usable after 8 rounds"):
        sample_prompts(fp32, tok, 6, 0, 1.0, max_prompt_tokens=2, progress=False)  # every prompt cut


def test_synthetic_part_is_answered_by_generate_and_counted(smollm2, tmp_path):
    params = {
        "synthetic": {
            "system": "You are a helpful assistant.",
            "max_prompt_tokens": 40,
            "near_duplicate": 0.7,
            "dtype": "float32",
            "device": "cpu",
            "batch_tokens": 8192,
            "max_rows": 32,
        },
        **generate_params(enabled=False, max_new_tokens=8),
    }
    ws = stage_workspace(tmp_path / "ws", smollm2, params)
    run_py(
        ["-m", "stages.synthetic", "syn", "--count", "6", "--seed", "3", "--temperature", "1.0", "--no-progress"],
        cwd=ws,
    )
    rows = [json.loads(line) for line in (ws / "data/parts/syn.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"syn-{i:06d}" for i in range(6)]
    assert all([m["role"] for m in r["messages"]] == ["system", "user"] for r in rows)
    report = json.loads((ws / "reports/synthetic/syn.json").read_text())
    assert report["kept"] == 6 and report["seed"] == 3 and report["sampled"] >= 6 and "cpu" in report
    # generate disabled: a prompt-only part is bad input there, named by file and line
    p = run_py(["-m", "stages.generate", "syn", "--no-progress"], cwd=ws, check=False)
    assert p.returncode != 0
    assert "data/parts/syn.jsonl:1: no assistant turn to learn from" in p.stderr and "generate.enabled" in p.stderr
    assert not (ws / "data/generated/syn.jsonl").exists()
    params["generate"]["enabled"] = True
    (ws / "params.yaml").write_text(yaml.safe_dump(params))
    run_py(["-m", "stages.generate", "syn", "--no-progress"], cwd=ws)
    out = [json.loads(line) for line in (ws / "data/generated/syn.jsonl").read_text().splitlines()]
    m = json.loads((ws / "reports/generate/syn.json").read_text())
    assert m["prompts_answered"] == 6 and m["regenerated"] == m["conversations_kept"] == len(out)
    assert all([x["role"] for x in c["messages"]] == ["system", "user", "assistant"] for c in out)
    assert all(c["messages"][2]["content"].strip() for c in out)


def test_the_target_writes_follow_up_turns_seeded_and_filtered(fp32, smollm2_tokenizer):
    tok = smollm2_tokenizer
    convs = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        for q, a in [
            ("What is the capital of France?", "The capital of France is Paris."),
            ("Give me a tip for sleeping better.", "Keep a regular bedtime and avoid screens late at night."),
            ("How do plants make food?", "By photosynthesis: light, water and carbon dioxide make sugar."),
        ]
    ]
    spec = {"turns": 1, "temperature": 1.0, "seed": 0, "max_tokens": 40, "near_duplicate": 0.7}
    got = follow_up_messages(fp32, tok, convs, spec, turn=0)
    assert len(got) == 3 and all(n > 0 for _, _, n in got)
    for text, why, _ in got:
        assert (text is None) != (why is None)
        assert why in (None, "empty", "cut", "template_tokens", "repetition", "repeats_earlier_turn")
        assert text is None or (text == text.strip() and "<|im_" not in text)
    assert follow_up_messages(fp32, tok, convs, spec, turn=0) == got  # seeded by (seed, turn)
    assert follow_up_messages(fp32, tok, convs, spec, turn=1) != got
    # a limit the context cannot hold writes nothing; one token cannot end a message
    assert [w for _, w, _ in follow_up_messages(fp32, tok, convs, spec, 0, max_seq_len=20)] == ["no_room"] * 3
    tiny = follow_up_messages(fp32, tok, convs, {**spec, "max_tokens": 1}, turn=0)
    assert all(t is None and w in ("cut", "empty") for t, w, _ in tiny)


def test_multi_turn_synthetic_part_through_dvc(tmp_path):
    """`data.synthetic.<part>.turns: 2` through real DVC: dvc.yaml unpacks the part's params into the
    synthetic stage's flags, and generate has the target answer, write a follow-up, and answer it."""
    params = tiny_params(parts=("syn",), local_target=True)
    params["data"]["synthetic"] = {"syn": {"count": 6, "seed": 1, "temperature": 1.0, "turns": 2}}
    params["data"]["sharegpt"] = {}
    params["synthetic"].update(max_prompt_tokens=40, dtype="float32", device="cpu", batch_tokens=8192, max_rows=32)
    params.update(generate_params(max_new_tokens=12))
    repo = make_clone(tmp_path / "repo", params)
    out = sh("dvc repro generate@syn", repo).stdout
    assert {"synthetic@syn", "generate@syn"} <= ran(out)
    assert "python -m stages.synthetic syn --count 6 --seed 1 --temperature 1.0 --turns 2" in out
    part = [json.loads(line) for line in (repo / "data/parts/syn.jsonl").read_text().splitlines()]
    assert all(c["follow_ups"] == {"turns": 1, "temperature": 1.0, "seed": 1, "max_tokens": 40, "near_duplicate": 0.7}
               for c in part)  # fmt: skip
    convs = [json.loads(line) for line in (repo / "data/generated/syn.jsonl").read_text().splitlines()]
    m = json.loads((repo / "reports/generate/syn.json").read_text())
    roles = [[x["role"] for x in c["messages"]] for c in convs]
    dropped = sum(v for k, v in m.items() if k.startswith("follow_ups_dropped_"))
    assert m["follow_ups_written"] + dropped == 6 == len(convs) and m["follow_up_tokens"] > 0
    assert roles.count(["user", "assistant", "user", "assistant"]) == m["follow_ups_written"] > 0
    assert roles.count(["user", "assistant"]) == dropped
    assert all("follow_ups" not in c and all(x["content"].strip() for x in c["messages"]) for c in convs)
    assert m["regenerated"] == 6 + m["follow_ups_written"] == m["assistant_turns"]
    # a part declared without `turns` has one; the generated bytes do not depend on the run
    before = (repo / "data/generated/syn.jsonl").read_bytes()
    sh("dvc repro -f -s generate@syn", repo)
    assert (repo / "data/generated/syn.jsonl").read_bytes() == before
    params["data"]["synthetic"]["syn"].pop("turns")
    write_params(repo, params)
    dry = sh("dvc repro --dry synthetic@syn", repo).stdout
    assert "python -m stages.synthetic syn --count 6 --seed 1 --temperature 1.0\n" in dry


def test_bad_follow_ups_are_named_by_line(tmp_path):
    good = {"turns": 1, "temperature": 1.0, "seed": 0, "max_tokens": 8, "near_duplicate": 0.7}
    bad = [
        {**good, "turns": -1},
        {**good, "temperature": 0},
        {**good, "seed": "x"},
        {k: v for k, v in good.items() if k != "max_tokens"},
        {**good, "extra": 1},
        [1],
    ]
    for i, spec in enumerate(bad):
        f = tmp_path / f"p{i}.jsonl"
        ok = {"id": "a", "messages": [{"role": "user", "content": "Hi"}], "follow_ups": good}
        f.write_text(json.dumps(ok) + "\n" + json.dumps({**ok, "id": "b", "follow_ups": spec}) + "\n")
        with pytest.raises(EaglenestError, match=rf"p{i}.jsonl:2: `follow_ups"):
            read_jsonl(f, prompts_ok=True)
    convs, _ = read_jsonl(f, on_error="skip", prompts_ok=True)
    assert [c["id"] for c in convs] == ["a"] and convs[0]["follow_ups"] == good
    with pytest.raises(EaglenestError, match=r"p5.jsonl:1: .*generate.enabled"):
        read_jsonl(f, prompts_ok=False)  # the target does not answer: nobody would write the turns
