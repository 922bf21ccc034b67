"""Bad input as classes (docs/design.md: Failure rules): every command given a missing, empty or
wrong-kind path fails naming it; a JSONL line JSON cannot read, for any reason, is `file:line`; a
missing shard file is named with the samples it held; a failed stage leaves no temporary file."""

import json
import shutil

import pyarrow as pa
import pytest

from eaglenest.data.conversations import read_jsonl
from eaglenest.errors import EaglenestError
from eaglenest.store.hidden_store import HiddenStore, verify_store

from .conftest import REPO, pack_workspace, run_py
from .test_store import extract_tiny


def cli(args, cwd, **kw):
    return run_py(["-m", "eaglenest.cli", *args], cwd=cwd, check=False, **kw)


def assert_fails_naming(p, name: str, code: int = 2):
    out = p.stdout + p.stderr
    assert p.returncode == code and name in out and "Traceback" not in out, (p.returncode, out[-2000:])


@pytest.fixture(scope="module")
def store(tiny_target, tmp_path_factory):
    out, *_ = extract_tiny(tiny_target, tmp_path_factory.mktemp("store"), n=24)
    return out


def test_every_command_names_a_missing_empty_or_wrong_kind_path(store, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("not a store")
    commands = (["verify"], ["info"], ["stores"], ["invalidate", "--root"])
    for c in commands:
        assert_fails_naming(cli([*c, "nowhere"], tmp_path), "nowhere: no such")
        assert_fails_naming(cli([*c, "a-file"], tmp_path), "a-file: a file, not a")
        expected = "no hidden-state stores in it" if c[0] in ("stores", "invalidate") else "not a hidden-state store"
        assert_fails_naming(cli([*c, "empty"], tmp_path), f"empty: {expected}")
    # a directory of stores where one store is expected: says so, and how to list them
    p = cli(["verify", str(store.parent)], tmp_path)
    assert_fails_naming(p, "eaglenest stores")
    # verify checks every path before the long work: a good store first does not hide a bad second
    assert_fails_naming(cli(["verify", "-q", str(store), "nowhere"], tmp_path), "nowhere: no such")
    assert_fails_naming(cli(["profile", "--dir", "nowhere"], tmp_path), "nowhere: no such profiles directory")
    (tmp_path / "profiles").mkdir()
    assert_fails_naming(cli(["profile", "--dir", "profiles"], tmp_path), "no profiles (*.yaml)")
    shutil.copy(REPO / "profiles" / "gpu.yaml", tmp_path / "profiles")
    assert_fails_naming(cli(["profile", "gpu", "--dir", "profiles", "--params", "nope.yaml"], tmp_path), "nope.yaml")
    assert_fails_naming(cli(["profile", "nope", "--dir", "profiles", "--params", str(REPO / "params.yaml")], tmp_path),
                        "no such profile (known: gpu)")  # fmt: skip


def test_a_prefix_that_matches_no_extractor_says_so(store, tmp_path):
    fp = HiddenStore(store).attrs["extractor_fingerprint"]
    p = cli(["invalidate", "ffff" if not fp.startswith("ffff") else "0000", "--root", str(store.parent)], tmp_path)
    assert_fails_naming(p, "matches none of the 1 extractor(s)")
    assert fp[:16] in p.stderr and "longer prefix" not in p.stderr
    ok = cli(["invalidate", fp[:8], "--root", str(store.parent)], tmp_path)
    assert ok.returncode == 0 and "would run: dvc repro --force --single-item extract@" in ok.stdout


def test_a_missing_shard_file_is_named_with_the_samples_it_held(store, tmp_path):
    copy = tmp_path / "p"
    shutil.copytree(store, copy)
    s = HiddenStore(copy)
    piece = s.index[len(s.index) // 2]["piece"]
    held = s.samples_of_piece(piece)
    gone = s.shard_file("final", piece)
    gone.unlink()
    bad = verify_store(copy, progress=False)
    assert len(bad) == 1 and str(gone) in bad[0] and "missing" in bad[0] and "corrupt" not in bad[0], bad
    assert all(repr(i) in bad[0] for i in held[:8])
    victim = next(i for i, r in enumerate(s.index) if r["piece"] == piece)
    with pytest.raises(EaglenestError, match=f"{gone}.* missing: it held samples"):
        HiddenStore(copy).read(victim)
    p = cli(["verify", "-q", str(copy)], tmp_path)
    assert p.returncode == 1 and str(gone) in p.stdout and "1 bad" in p.stderr


def test_a_failed_teacher_leaves_no_temporary_directory(tiny_packed, tmp_path):
    ws = pack_workspace(tiny_packed, tmp_path / "ws")
    before = (ws / "data/teacher/b/argmax.npy").read_bytes()
    s = HiddenStore(ws / "data/hidden/b")
    s.shard_file("aux", s.index[-1]["piece"]).unlink()
    p = run_py(["-m", "stages.teacher", "b", "--no-progress"], cwd=ws, check=False)
    assert_fails_naming(p, "data/hidden/b")
    assert "missing: it held samples" in p.stderr
    assert not (ws / "data/teacher/b.tmp").exists() and not list(ws.rglob("*.tmp"))
    assert (ws / "data/teacher/b/argmax.npy").read_bytes() == before  # the old output stays


@pytest.mark.parametrize("case", ["missing", "other store", "other tokens"])
def test_pack_refuses_a_teacher_output_that_does_not_match_its_part(tiny_packed, tmp_path, case):
    """pack reads no state: it trusts a part's teacher argmax only when it was computed for the store
    and the token ids there now; otherwise one line naming the part and the command that fixes it,
    and the old pack stays."""
    import pyarrow.parquet as pq

    ws = pack_workspace(tiny_packed, tmp_path / "ws")
    before = sorted((str(p.relative_to(ws)), p.read_bytes()) for p in (ws / "data/packed").rglob("*") if p.is_file())
    if case == "missing":
        shutil.rmtree(ws / "data/teacher/a")
        want = "part a: data/teacher/a is missing or unreadable"
    elif case == "other store":  # another part's teacher output where part a's was
        shutil.rmtree(ws / "data/teacher/a")
        shutil.copytree(ws / "data/teacher/b", ws / "data/teacher/a")
        want = "part a: data/teacher/a was computed for another store"
    else:  # the tokenized part changed under an unchanged store: a token id differs
        t = pq.read_table(ws / "data/tokenized/a.parquet").to_pylist()
        t[0]["input_ids"][1] = (t[0]["input_ids"][1] + 1) % 64
        pq.write_table(pa.Table.from_pylist(t, schema=pq.read_schema(ws / "data/tokenized/a.parquet")),
                       ws / "data/tokenized/a.parquet")  # fmt: skip
        want = "part a: the tokenized part's token ids differ"
    p = run_py(["-m", "stages.pack", "--no-progress"], cwd=ws, check=False)
    assert_fails_naming(p, want)
    assert "dvc repro" in p.stderr.strip().splitlines()[-1]
    after = sorted((str(p.relative_to(ws)), p.read_bytes()) for p in (ws / "data/packed").rglob("*") if p.is_file())
    assert after == before and not list(ws.rglob("*.tmp"))


GOOD = {"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
UNREADABLE = {
    "nested too deeply": b'{"id": "x", "messages": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
    "deep value in a checked field": b'{"id": ' + b"[" * 900 + b"]" * 900 + b', "messages": []}',
    "deep role": b'{"messages": [{"role": ' + b"[" * 900 + b"]" * 900 + b', "content": "x"}]}',
    "an integer of 5000 digits": b'{"id": ' + b"9" * 5000 + b', "messages": []}',
    "a lone surrogate": b'{"id": "s", "messages": [{"role": "user", "content": "\\ud800"}, '
    b'{"role": "assistant", "content": "x"}]}',
    "not UTF-8": b'{"id": "u", "messages": "\xff"}',
    "not an object": b"[1, 2]",
    "NaN as content": b'{"id": "n", "messages": [{"role": "user", "content": NaN}]}',
    "cut off": b'{"id": "c", "messages": [',
}


@pytest.mark.parametrize("case", list(UNREADABLE))
def test_any_line_json_cannot_read_is_file_and_line(tmp_path, case):
    f = tmp_path / "part.jsonl"
    lines = [json.dumps(GOOD).encode(), UNREADABLE[case], json.dumps({**GOOD, "id": "b"}).encode()]
    f.write_bytes(b"\n".join(lines))
    with pytest.raises(EaglenestError, match=rf"^{f}:2: "):
        read_jsonl(f)
    convs, report = read_jsonl(f, on_error="skip")
    assert [c["id"] for c in convs] == ["a", "b"] and sum(report.skipped.values()) == 1 and report.lines == 3
