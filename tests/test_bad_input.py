"""Bad input as classes (docs/design.md: Failure rules): every command given a missing, empty or
wrong-kind path fails naming it; a JSONL line JSON cannot read, for any reason, is `file:line`; a
missing shard file is named with the samples it held; a failed stage leaves no temporary file."""

import json
import shutil

import pyarrow as pa
import pytest

from eaglenest.data.conversations import read_jsonl
from eaglenest.runtime.errors import EaglenestError
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


def stage(args, cwd):
    return run_py(["-m", *args], cwd=cwd, check=False)


def test_a_params_file_that_sets_a_key_twice_is_refused_naming_the_key_and_lines(tmp_path):
    """YAML loaders keep a duplicated key's last value silently (DVC refuses the file): every
    reader of params.yaml and of a profile refuses it, naming the key and both lines."""
    text = (REPO / "params.yaml").read_text().replace("  lr: 0.004\n", "  lr: 0.004\n  lr: 0.04\n", 1)
    (tmp_path / "params.yaml").write_text(text)
    line = text.splitlines().index("  lr: 0.04") + 1
    for args in (["stages.train"], ["stages.evaluate"], ["eaglenest.cli", "plan"]):
        assert_fails_naming(
            stage(args, tmp_path), f"params.yaml:{line}: key `lr` is set twice (first on line {line - 1})"
        )
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "twice.yaml").write_text("train:\n  epochs: 3\n  lr: 0.1\n  epochs: 5\n")
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    p = cli(["profile", "twice", "--dir", "profiles"], tmp_path)
    assert_fails_naming(p, "twice.yaml:4: key `epochs` is set twice (first on line 2)")
    assert (tmp_path / "params.yaml").read_text() == (REPO / "params.yaml").read_text()  # untouched


def test_a_top_k_term_wider_than_the_draft_vocabulary_is_refused_before_training(tmp_path):
    """train.topk takes the teacher's K likeliest draft tokens: more than the draft vocabulary holds
    fails at the params check, naming both keys, before any stage's work."""
    text = (REPO / "params.yaml").read_text().replace("  topk: 0 ", "  topk: 9000 ", 1)
    assert "topk: 9000" in text
    (tmp_path / "params.yaml").write_text(text)
    for args in (["stages.train"], ["stages.pack"]):
        assert_fails_naming(
            stage(args, tmp_path), "`train.topk` is 9000; it must be at most `pack.draft_vocab_size` (8192)"
        )


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "x..y", "", "/abs"])
def test_a_name_that_becomes_a_path_is_a_plain_name(tmp_path, name):
    """Parts (listed, declared as ShareGPT or synthetic parts, or given to a stage), and profiles:
    a name that is not a plain file name is refused before it is joined to a path."""
    import yaml

    base = yaml.safe_load((REPO / "params.yaml").read_text())
    for where in ("parts", "sharegpt", "synthetic"):
        params = json.loads(json.dumps(base))
        if where == "parts":
            params["data"]["parts"] = ["sharegpt-000", name]
        elif where == "sharegpt":
            params["data"]["sharegpt"][name] = {"start": 0, "count": 1, "turns": 0}
        else:
            params["data"]["synthetic"][name] = {"count": 1, "seed": 0, "temperature": 1.0}
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
        assert_fails_naming(stage(["stages.pack"], tmp_path), "plain name")
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    if name:  # argparse takes "" as a part too
        for s in ("stages.tokenize", "stages.extract", "stages.teacher", "stages.generate"):
            assert_fails_naming(stage([s, name], tmp_path), f"part {name!r} is not a plain name")
        (tmp_path / "profiles").mkdir(exist_ok=True)
        shutil.copy(REPO / "profiles" / "gpu.yaml", tmp_path / "profiles")
        assert_fails_naming(cli(["profile", name, "--dir", "profiles"], tmp_path), "is not a plain name")


def test_weights_that_cannot_be_what_their_header_says_fail_the_target_stage(tiny_target, tmp_path):
    """A truncated or padded safetensors file, or one whose header describes other tensors, fails at
    the target stage naming the file, before it is fingerprinted; nothing is written."""
    src = tiny_target.model_dir
    data = (src / "model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["dtype"] = "F32" if header[name]["dtype"] != "F32" else "F16"  # its bytes no longer fit
    fields = json.dumps(header).encode()
    bad_header = len(fields).to_bytes(8, "little") + fields + data[8 + n :]
    for case, content in (("truncated", data[: len(data) // 3]), ("padded", data + b"\0" * 64),
                          ("header", bad_header), ("tiny", data[:5])):  # fmt: skip
        model = tmp_path / case / "model"
        shutil.copytree(src, model)
        (model / "model.safetensors").write_bytes(content)
        ws = tmp_path / case
        (ws / "params.yaml").write_text(f"target: {{path: {model}, dtype: bfloat16}}\n")
        p = stage(["stages.target"], ws)
        assert_fails_naming(p, f"{model / 'model.safetensors'}: ")
        assert not (ws / "data" / "target" / "target.json").exists()


def test_a_target_whose_directory_has_gone_is_named_not_looked_up_on_a_hub(tiny_target, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_target.model_dir, model)
    (tmp_path / "params.yaml").write_text(f"target: {{path: {model}, dtype: bfloat16}}\n")
    assert stage(["stages.target"], tmp_path).returncode == 0
    shutil.rmtree(model)
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    for s in (["stages.evaluate"], ["stages.extract", "a"]):
        p = stage(s, tmp_path)
        assert_fails_naming(p, f"the target's directory {model} is gone")
        assert "repo id" not in (p.stdout + p.stderr).lower()


@pytest.mark.parametrize("missing", ["index.parquet", "checksums.json", "zarr.json", "aux/zarr.json"])
def test_every_missing_file_of_a_store_is_named_as_missing(store, tmp_path, missing):
    copy = tmp_path / store.name
    shutil.copytree(store, copy)
    (copy / missing).unlink()
    if missing == "zarr.json":  # not a store at all, for every command
        assert_fails_naming(cli(["info", str(copy)], tmp_path), f"{copy / missing}: missing")
    else:  # verify names the bad store and goes on to the next: exit 1
        assert_fails_naming(cli(["verify", "-q", str(copy)], tmp_path), f"{copy / missing}: missing", code=1)
