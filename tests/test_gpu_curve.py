"""bench/gpu_carry.py and bench/gpu_curve.py's own bookkeeping: what `prepare` clears, which synthetic
parts a curve point declares, what `plan` takes its rates from, and `table`'s per-category τ. The
curve's save / collect / load over machines is in tests/test_runcache_carry.py."""

import json
from pathlib import Path

import pytest


def test_preparing_the_carried_packages_again_keeps_the_saved_runs(tmp_path):
    """bench.gpu_carry prepare clears only its own chunks and download: .carry/curve (the curve's saved
    runs, which no machine makes again) is kept; an earlier prepare once deleted it with all of .carry."""
    from bench import gpu_carry

    out = tmp_path / ".carry"
    for d in ("1", "2", "12", "download", "curve/1", "curve/2"):
        (out / d).mkdir(parents=True)
        (out / d / "f").write_bytes(b"x")
    gpu_carry.clear_chunks(out)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("f")) == ["curve/1/f", "curve/2/f"]


@pytest.mark.parametrize(("point", "declared"), [("sharegpt", []), ("syn2x", ["synth-000", "synth-001"])])
def test_a_curve_point_declares_only_the_synthetic_parts_it_trains_on(point, declared):
    """dvc repro makes every declared part: a point declaring all four decoded prompts it never used."""
    import yaml

    from bench import gpu_curve as gc

    sets = dict(s.split("=", 1) for s in gc.point_sets(point, 3, 1))
    synthetic = yaml.safe_load(sets["data.synthetic"])
    assert sorted(synthetic) == declared
    assert [synthetic[p]["seed"] for p in declared] == [int(p[-3:]) for p in declared]


def test_plan_takes_one_part_s_prompt_time_from_the_parts_the_run_decoded(tmp_path):
    """A run declaring two synthetic parts spent its prompt time on two, not on four."""
    from bench import gpu_curve as gc

    report = json.loads((Path(__file__).parents[1] / "bench/results/gpu_curve/syn2x/gpu_profile.json").read_text())
    four = report["wall_s"]["synthetic"]
    report["wall_s_per_stage"] = {
        k: v for k, v in report["wall_s_per_stage"].items() if k not in ("synthetic@synth-002", "synthetic@synth-003")
    }
    report["wall_s"]["synthetic"] = two = four / 2
    (tmp_path / "gpu_curve" / "syn2x").mkdir(parents=True)
    (tmp_path / "gpu_curve" / "syn2x" / "gpu_profile.json").write_text(json.dumps(report))
    assert gc.rates(tmp_path)["prompts_s"] == pytest.approx(two / 2)
    assert gc.rates(Path(__file__).parents[1] / "bench/results")["prompts_s"] == pytest.approx(four / 4)


def test_tau_per_category_weights_each_question_by_its_verifications(tmp_path):
    """A question of 200 tokens at τ 2 (100 verifications) outweighs one of 30 at τ 3 (10): 230 / 110."""
    from bench import gpu_curve as gc

    questions = [
        {"category": "math", "tokens": 200, "tau_k3": 2.0},
        {"category": "math", "tokens": 30, "tau_k3": 3.0},
        {"category": "stem", "tokens": 64, "tau_k3": 1.6},
    ]
    (tmp_path / "evaluate_questions.json").write_text(json.dumps(questions))
    assert gc.by_category(tmp_path / "evaluate_questions.json") == {"math": round(230 / 110, 3), "stem": 1.6}
    assert gc.by_category(tmp_path / "missing.json") is None
