"""stages/_paths.py and dvc.yaml describe the same layout: every file a stage writes is one of its
declared outs or metrics, every file it reads one of its deps."""

from pathlib import Path

import pytest
import yaml

from stages import _paths as paths

REPO = Path(__file__).resolve().parents[1]
P = "PART"  # stands for ${item} / ${key} of a foreach stage


def declared(stage: dict) -> tuple[set, set]:
    body = stage.get("do", stage)
    entries = {"outs": set(), "deps": set()}
    for kind, into in (("outs", "outs"), ("metrics", "outs"), ("plots", "outs"), ("deps", "deps")):
        for e in body.get(kind, []):
            name = next(iter(e)) if isinstance(e, dict) else e
            entries[into].add(Path(name.replace("${item}", P).replace("${key}", P)))
    return entries["outs"], entries["deps"]


def test_what_each_stage_reads_and_writes_is_what_dvc_yaml_declares():
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    m, r = paths.metrics, paths.report
    writes = {
        "target": {paths.TARGET, r("target")},
        "sharegpt": {paths.part(P), r("sharegpt", P)},
        "synthetic": {paths.part(P), r("synthetic", P)},
        "generate": {paths.generated(P), r("generate", P)},
        "tokenize": {paths.tokenized(P), r("tokenize", P)},
        "extract": {paths.hidden(P), r("extract", P)},
        "teacher": {paths.teacher(P)},
        "pack": {paths.PACKED, m("data"), r("pack")},
        "train": {paths.DRAFTER, m("train"), r("train")},
        "evaluate": {m("evaluate"), m("evaluate_positions", ext="csv"), r("evaluate"), r("evaluate_questions")},
    }
    reads = {
        "synthetic": {paths.TARGET},
        "generate": {paths.part(P), paths.TARGET},
        "tokenize": {paths.generated(P), paths.TARGET},
        "extract": {paths.tokenized(P), paths.TARGET},
        "teacher": {paths.hidden(P), paths.tokenized(P), paths.TARGET},
        "pack": {
            paths.HIDDEN,
            paths.TOKENIZED,
            paths.TEACHER,
            paths.TARGET,
            *(Path("reports", s) for s in ("tokenize", "generate", "extract")),
        },
        "train": {paths.PACKED, paths.TARGET},
        "evaluate": {paths.DRAFTER, paths.TARGET},
    }
    assert set(stages) == set(writes)
    for name, stage in stages.items():
        outs, deps = declared(stage)
        assert writes[name] <= outs, (name, writes[name] - outs)
        assert reads.get(name, set()) <= deps, (name, reads[name] - deps)


def test_every_profile_gives_valid_params(tmp_path):
    """A profile applied to params.yaml passes the params schema (no key missing, none unknown)."""
    import shutil

    from eaglenest.profile import apply
    from stages import _params

    profiles = sorted((REPO / "profiles").glob("*.yaml"))
    assert profiles
    for profile in profiles:
        shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
        apply(profile, tmp_path / "params.yaml")
        _params.validate(yaml.safe_load((tmp_path / "params.yaml").read_text()))


def test_profiles_applied_one_after_another_write_the_values_they_set(tmp_path, monkeypatch):
    """The GPU profile, then overrides of its keys (`-S`: `profile.apply_sets`): each value reads back,
    comments stay; a rendering that would not read back (the list-of-lists one that once joined the
    next key onto its line) is refused and leaves the file as it was."""
    import shutil

    from eaglenest import profile as prof
    from eaglenest.runtime.errors import EaglenestError

    params, over = tmp_path / "params.yaml", tmp_path / "over.yaml"
    shutil.copy(REPO / "params.yaml", params)
    prof.apply(REPO / "profiles" / "gpu.yaml", params)
    sets = {"evaluate": {"trees": [], "max_new_tokens": 6, "k": [3]}, "data": {"synthetic": {"s": {"count": 2}}}}
    over.write_text(yaml.safe_dump(sets))
    prof.apply(over, params)
    got = yaml.safe_load(params.read_text())
    assert {k: got["evaluate"][k] for k in sets["evaluate"]} == sets["evaluate"]
    assert got["data"]["synthetic"] == sets["data"]["synthetic"] and got["evaluate"]["dtype"] == "float32"
    assert "# target precision for decoding" in params.read_text()

    def block_lists(value):  # the old styling: a list of lists as a block
        out = prof.CommentedSeq(block_lists(v) for v in value) if isinstance(value, list) else value
        if isinstance(value, list) and not any(isinstance(v, list) for v in value):
            out.fa.set_flow_style()
        return out

    monkeypatch.setattr(prof, "_styled", block_lists)
    over.write_text(yaml.safe_dump({"evaluate": {"trees": [[5, 4, 8], [3, 4, 8]]}}))
    prof.apply(over, params)
    before = params.read_text()
    over.write_text(yaml.safe_dump({"evaluate": {"trees": []}}))
    with pytest.raises(EaglenestError, match="would not write the values it sets"):
        prof.apply(over, params)
    assert params.read_text() == before and set(tmp_path.iterdir()) == {params, over}  # no temporary left


def test_metrics_are_git_tracked_and_timings_are_nothing_dvc_tracks():
    """`dvc metrics show` / `diff` read only git-tracked files (a clone without the DVC cache reads them
    all), and no output DVC hashes holds a timing (timings differ every run: `dvc.lock` would too)."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        body = stage.get("do", stage)
        for e in body.get("metrics", []):
            ((path, opts),) = e.items()
            assert opts.get("cache") is False and not any(k in path for k in ("${item}", "${key}")), (name, path)
        for kind in ("outs", "metrics", "plots"):
            for e in body.get(kind, []):
                path = next(iter(e)) if isinstance(e, dict) else e
                assert not path.startswith(str(paths.timing("x").parent)), (name, path)


def test_a_profile_extends_another_and_a_loop_of_them_is_named(tmp_path):
    """`extends: <name>` takes the other profile's keys, then the profile's own over them; profiles that
    extend each other in a loop, an `extends` that names no profile, and a file that is no mapping of
    sections fail naming the file."""
    from eaglenest.profile import overrides
    from eaglenest.runtime.errors import EaglenestError

    d = tmp_path / "profiles"
    d.mkdir()
    (d / "base.yaml").write_text("train: {epochs: 13, lr: 0.001}\ndata: {parts: [a, b]}\n")
    (d / "big.yaml").write_text("extends: base\ndata: {parts: [a, b, c]}\n")
    assert overrides(d / "big.yaml") == {"train.epochs": 13, "train.lr": 0.001, "data.parts": ["a", "b", "c"]}
    (d / "base.yaml").write_text("extends: big\ntrain: {epochs: 13}\n")
    bad = {
        "extends: base\n": r"big.yaml: profiles extend each other in a loop: big -> base -> big",
        "extends: nope\ndata: {parts: [a]}\n": r"nope.yaml: no such profile \(known: base, big\)",
        "extends: [base]\n": r"big.yaml: `extends` names a profile",
        "extends: base\ndata: {parts: [a\n": r"big.yaml: not valid YAML",
        "- extends: base\n": r"big.yaml: must map params sections to keys",
    }
    for text, message in bad.items():
        (d / "big.yaml").write_text(text)
        with pytest.raises(EaglenestError, match=message):
            overrides(d / "big.yaml")
