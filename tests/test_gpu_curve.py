"""bench/gpu_carry.py and bench/gpu_curve.py's own bookkeeping: what `prepare` clears, which synthetic
parts a curve point declares, what `plan` takes its rates from and counts, and `table`'s per-category τ. The
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


def test_plan_takes_each_stage_s_rate_from_the_runs_that_ran_it(tmp_path):
    """+ 4x restored four parts' prompts and answers and two parts' tokens from the saved run-cache, and
    ran its two new parts' generate and tokenize: per-token rates over all six parts' tokens came out a
    third of what those stages cost. + 4x at 13 epochs, the most trained point, ran no tokenize: the rate
    comes from + 4x, the next. Its prompt time is + 2x's, the most trained point that decoded prompts: one
    part's is the mean of its synthetic@ runs, not its total over 4."""
    from bench import gpu_curve as gc

    results = Path(__file__).parents[1] / "bench/results"
    four = json.loads((results / "gpu_curve/syn4x/gpu_profile.json").read_text())
    runs, toks = four["wall_s_per_stage"], {k: v["tokens"] for k, v in four["pack"]["parts"].items()}
    new = ["synth-002", "synth-003"]
    assert [k for k in runs if k.startswith("tokenize@")] == [f"tokenize@{p}" for p in new]
    rt = gc.rates(results)
    assert rt["source"].endswith("syn4x-13ep/gpu_profile.json")
    assert rt["tokenize_s_tok"] == pytest.approx(sum(runs[f"tokenize@{p}"] for p in new) / sum(toks[p] for p in new))
    assert rt["tokenize_s_tok"] > 2.5 * four["wall_s"]["tokenize"] / four["tokenized_tokens"]
    two = json.loads((results / "gpu_curve/syn2x/gpu_profile.json").read_text())["wall_s_per_stage"]
    assert rt["prompts_s"] == pytest.approx(sum(two[f"synthetic@synth-00{i}"] for i in range(4)) / 4)

    (tmp_path / "gpu_curve" / "syn2x").mkdir(parents=True)  # a run that decoded two parts' prompts
    two = {k: v for k, v in two.items() if k not in ("synthetic@synth-002", "synthetic@synth-003")}
    report = json.loads((results / "gpu_curve/syn2x/gpu_profile.json").read_text()) | {"wall_s_per_stage": two}
    (tmp_path / "gpu_curve" / "syn2x" / "gpu_profile.json").write_text(json.dumps(report))
    decoded = two["synthetic@synth-000"] + two["synthetic@synth-001"]
    assert gc.rates(tmp_path)["prompts_s"] == pytest.approx(decoded / 2)


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


def test_plan_leaves_out_the_training_a_saved_checkpoint_holds(tmp_path, capsys):
    """A point stopped inside training goes on from its checkpoint on the next machine: plan counts its
    training less the time it had (the saved set's stage times), plus loading the checkpoint."""
    import shutil

    from bench import gpu_curve as gc
    from bench import gpu_profile as gp
    from bench import runcache_carry as rc

    results = tmp_path / "results"  # the results before + 4x at 13 epochs finished
    shutil.copytree(Path(__file__).parents[1] / "bench/results/gpu_curve", results / "gpu_curve")
    shutil.rmtree(results / "gpu_curve" / "syn4x-13ep")

    def planned(saved: Path) -> tuple[float, str]:
        gc.plan(13, ["syn4x"], saved, 1e6, results)
        line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("syn4x-13ep"))
        return float(line.split("epochs")[1].split("min")[0].strip(" ~")), line

    fresh, line = planned(tmp_path / "nothing-saved")
    assert "goes on" not in line and "stores ~62 GB of the ~68 GB" in line
    work, files = tmp_path / "work", {gc.RUNNING: "syn4x-13ep", gp.TIMES: '{"train": 600.0}'}
    for rel, text in files.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(text)
    (work / ".dvc" / "cache").mkdir(parents=True)
    rc.pack(work / ".dvc" / "cache", gc.SAVED_STAGES, tmp_path / "staging", {rel: work / rel for rel in files})
    (tmp_path / "out").mkdir()
    assert rc.send(tmp_path / "staging", tmp_path / "out", gc.CALL_BYTES) == []
    rc.collect(tmp_path / "out", tmp_path / "saved", gc.CARRY_BYTES)
    going, line = planned(tmp_path / "saved")
    assert going == pytest.approx(fresh - (600 - gc.CKPT_S) / 60, abs=0.1)
    assert line.endswith("goes on from its saved checkpoint, 10.0 min trained")


def test_the_larger_gpu_profile_trains_what_the_curve_measured(tmp_path):
    """profiles/gpu-large.yaml reports the curve's + 4x at 13 epochs as its figure: applied to params.yaml
    it must give what that point ran (the GPU profile, then the point's -S overrides), every stage's
    params alike but evaluate's trees, speed questions and min_tau, which leave the chain τ as it is."""
    import shutil

    import yaml

    from bench import gpu_curve as gc
    from bench import gpu_profile as gp
    from eaglenest import profile as prof

    repo = Path(__file__).resolve().parents[1]
    large, point = tmp_path / "large.yaml", tmp_path / "point.yaml"
    for p in (large, point):
        shutil.copy(repo / "params.yaml", p)
    prof.apply(repo / "profiles" / "gpu-large.yaml", large)
    prof.apply(repo / "profiles" / "gpu.yaml", point)
    gp.apply_sets(gc.point_sets("syn4x", 13, 1), point, tmp_path / "sets.yaml")
    got, ran = yaml.safe_load(large.read_text()), yaml.safe_load(point.read_text())
    for key in ("trees", "speed_questions", "min_tau"):
        got["evaluate"].pop(key), ran["evaluate"].pop(key)
    assert got == ran
    assert got["data"]["parts"] == gc.POINTS["syn4x"] and got["train"]["epochs"] == 13


def test_plan_says_when_a_point_s_stores_outgrow_a_machine_s_disk(tmp_path, capsys):
    """+ 8x's stores, at the last run's bytes a token, exceed the free disk a GPU host had: plan says
    the point cannot run on one machine's disk, which + 4x (62 GB of 68) could."""
    from bench import gpu_curve as gc

    results = Path(__file__).parents[1] / "bench/results"
    gc.plan(13, ["syn8x"], tmp_path / "nothing-saved", 1e6, results)
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("syn8x-13ep"))
    rt = gc.rates(results)
    gb = float(line.split("stores ~")[1].split(" GB")[0])
    assert gb > rt["disk_free_gb"] and line.endswith("(over it: the point cannot run on one machine's disk)")
    new = 4 * gc.SYNTH_PART_TOKENS  # four parts not made yet, nothing saved
    assert gb == pytest.approx(rt["store_b_tok"] * (sum(rt["part_tokens"].values()) + new) / 1e9, rel=0.01)


def test_plan_of_points_all_done_counts_no_machine(tmp_path, capsys):
    from bench import gpu_curve as gc

    gc.plan(13, ["syn4x"], tmp_path / "nothing-saved", 1e6, Path(__file__).parents[1] / "bench/results")
    out = capsys.readouterr().out.splitlines()
    assert out[-2:] == ["syn4x-13ep   done", "every point asked for is done: no machine needed"]
