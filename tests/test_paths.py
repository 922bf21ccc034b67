"""stages/_paths.py and dvc.yaml describe the same layout: every file a stage writes is one of its
declared outs or metrics, every file it reads one of its deps."""

from pathlib import Path

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
    m = paths.metrics
    writes = {
        "target": {paths.TARGET, m("target")},
        "sharegpt": {paths.part(P), m("sharegpt", P)},
        "generate": {paths.generated(P), m("generate", P)},
        "tokenize": {paths.tokenized(P), m("tokenize", P)},
        "extract": {paths.hidden(P), m("extract", P), paths.report("extract", P)},
        "pack": {paths.PACKED, m("pack")},
        "train": {paths.DRAFTER, m("train")},
        "evaluate": {m("evaluate"), m("evaluate_positions", ext="csv"), m("evaluate_questions")},
    }
    reads = {
        "generate": {paths.part(P), paths.TARGET},
        "tokenize": {paths.generated(P), paths.TARGET},
        "extract": {paths.tokenized(P), paths.TARGET},
        "pack": {paths.HIDDEN, paths.TOKENIZED, paths.TARGET},
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
