"""The real DVC pipeline end to end (target -> evaluate) on the real SmolLM2 target with a tiny
params profile, in a fresh clone of this repository."""

import json
import shutil

import pytest
import yaml

from eaglenest.store.hidden_store import HiddenStore, verify_store

from .conftest import make_clone, sh, tiny_params

pytestmark = pytest.mark.slow


@pytest.fixture
def clone(built, tmp_path):
    """A private copy of the built clone (workspace, DVC cache, git): what one test edits, no other sees."""
    dst = tmp_path / "repo"
    shutil.copytree(built[0], dst, symlinks=True)
    return dst


def test_repro_to_validated_stores_then_noop(built):
    clone, stdout = built
    for stage in (
        "target",
        "sharegpt@tiny-a",
        "generate@tiny-a",
        "tokenize@tiny-b",
        "extract@tiny-a",
        "extract@tiny-b",
        "teacher@tiny-a",
        "teacher@tiny-b",
        "pack",
        "train",
        "evaluate",
    ):
        assert f"Running stage '{stage}'" in stdout
    packed = json.loads((clone / "reports/pack.json").read_text())
    for part in ("tiny-a", "tiny-b"):
        store = HiddenStore(clone / "data" / "hidden" / part)
        report = json.loads((clone / "reports" / "extract" / f"{part}.json").read_text())
        tm = json.loads((clone / "reports" / "tokenize" / f"{part}.json").read_text())
        assert report["committed"] and report["validation"]["passed"] and report["samples"] == len(store)
        assert set(report["validation"]["taps"]) == {"aux_2", "aux_15", "aux_27", "final"}
        assert "wall_s" not in report and "seconds_by_step" not in report["validation"]  # timings: elsewhere
        timing = json.loads((clone / "reports" / "timing" / "extract" / f"{part}.json").read_text())
        assert timing["wall_s"] > timing["forward_s"] > 0 and timing["fixed_cost"]["total_s"] > 0
        assert packed["parts"][part]["samples"] == len(store) == tm["samples"]
        assert packed["parts"][part]["gate_passed"] and packed["parts"][part]["gate_worst_cosine"] > 0.98
        assert store.attrs["taps"] == [2, 15, 27] and store.attrs["hidden_size"] == 576
        assert (
            store.attrs["target_fingerprint"] == json.loads((clone / "reports/target.json").read_text())["fingerprint"]
        )
        assert verify_store(store.path, progress=False) == []
    assert (clone / "data/hidden/tiny-a/aux/c.0.0.0").stat().st_nlink == 2  # hardlinked into the DVC cache
    again = sh("dvc repro", clone)
    assert "Running stage" not in again.stdout and "up to date" in again.stdout
    assert sh("dvc status", clone).stdout.strip().endswith("Data and pipelines are up to date.")
    v = sh("eaglenest verify -q data/hidden/tiny-a data/hidden/tiny-b", clone)
    assert v.stdout.count("OK") == 2
    ev = json.loads((clone / "reports/evaluate.json").read_text())
    assert ev["questions"] == 2 and ev["mismatches"] == {"2": 0} and ev["tau"]["2"] >= 1.0 and ev["gate_passed"]
    gen = json.loads((clone / "reports/generate/tiny-a.json").read_text())
    assert gen == {"enabled": False, "conversations": 4}
    # the headline figures: only git-tracked files, few columns, every one loaded (no "failed to load")
    show = sh("dvc metrics show", clone)
    assert "failed to load" not in show.stdout + show.stderr
    assert max(map(len, show.stdout.splitlines())) <= 120, show.stdout
    assert set(json.loads(sh("dvc metrics show --json", clone).stdout)[""]["data"]) == {
        "metrics/data.json", "metrics/train.json", "metrics/evaluate.json"}  # fmt: skip
    assert json.loads((clone / "data/drafter/config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]


@pytest.mark.parametrize("arch, reference", [("deepseek-v3", "streamed"), ("qwen3-moe", "auto")])
def test_moe_targets_run_to_an_evaluated_drafter(arch, reference, smollm2, tmp_path):
    """Random mixture-of-experts targets from transformers' configs with the built-in tokenizer and
    chat template (DeepSeek-V3: MLA, a shared and routed experts, a dense first layer; Qwen3-MoE):
    `dvc repro` to an evaluated drafter, the gate passing their honest states (its reference replaying
    the bf16 forward's experts; token_quantile auto: the 98th-percentile token), streamed a layer at a
    time where asked."""
    from eaglenest.target.random_weights import build

    model = build(arch, tmp_path / "model", smollm2.model_dir)
    params = tiny_params(parts=("tiny-a",), per_part=6)
    params["target"]["path"] = str(model)
    params["extract"]["taps"] = [1, 3, 4]
    params["validate"]["reference"] = reference
    repo = make_clone(tmp_path / "repo", params)
    sh("dvc repro", repo)
    report = json.loads((repo / "reports" / "extract" / "tiny-a.json").read_text())
    timing = json.loads((repo / "reports" / "timing" / "extract" / "tiny-a.json").read_text())
    assert report["validation"]["passed"] and report["validation"]["thresholds"]["token_quantile"] == 0.98
    assert timing["forward_path"] == "transformers' forward"
    assert timing["validation"]["reference"]["mode"] == ("streamed" if reference == "streamed" else "whole")
    assert timing["validation"]["reference"]["routing"]["routers"] > 0  # replayed
    ev = json.loads((repo / "reports/evaluate.json").read_text())
    assert ev["questions"] == 2 and ev["mismatches"] == {"2": 0} and ev["tau"]["2"] >= 1.0
    config = json.loads((repo / "data/drafter/config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["hidden_size"] == 64


def test_every_stage_run_by_hand_leaves_the_dvc_cache_intact(clone):
    """Each stage run by hand, as its dvc.lock command (`python -m stages.<stage> ...`, as root where
    the suite runs as root), in a clone whose outputs are hard links into the DVC cache: no write
    goes through a link, so every cache object still hashes to its name (`eaglenest verify --cache`),
    and `dvc status` is clean (the same bytes came out)."""
    lock = yaml.safe_load((clone / "dvc.lock").read_text())["stages"]
    sh("dvc checkout --relink -q", clone)  # the copy's outputs linked to its cache again, as DVC leaves them
    assert (clone / "data/target/target.json").stat().st_nlink == 2  # linked: a write in place would show
    for st in lock.values():
        sh(st["cmd"], clone)
    v = sh("eaglenest verify --cache -q", clone)
    assert "BAD" not in v.stdout and v.stdout.startswith("OK") and "not in the cache" not in v.stdout, v.stdout
    assert sh("dvc status", clone).stdout.strip().endswith("Data and pipelines are up to date.")


def test_verify_cache_names_an_object_rewritten_through_its_link(clone):
    """What a stage writing in place would do: the cache object changes with the output (a `dvc
    push` would send the bad bytes), and `eaglenest verify --cache` names the object and fails."""
    sh("dvc checkout --relink -q", clone)
    pointer = clone / "data/target/target.json"
    with open(pointer, "a") as f:  # through the hard link, on purpose
        f.write(" ")
    v = sh("eaglenest verify --cache -q", clone, check=False)
    assert v.returncode == 1 and "BAD     data/target/target.json: cache object" in v.stdout, v.stdout


def test_metrics_diff_shows_a_changed_training_param(clone):
    before = json.loads((clone / "metrics/train.json").read_text())
    params = yaml.safe_load((clone / "params.yaml").read_text())
    params["train"]["lr"] = params["train"]["lr"] / 10
    (clone / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    p = sh("dvc repro", clone)
    assert "Running stage 'train'" in p.stdout and "Running stage 'extract@tiny-a'" not in p.stdout
    assert "train.lr" in sh("dvc params diff", clone).stdout
    diff = json.loads(sh("dvc metrics diff --json", clone).stdout)
    changed = diff["metrics/train.json"]
    assert changed["val_tau"]["old"] == before["val_tau"] and changed["val_tau"]["diff"] != 0
    assert "cpu" not in changed and "torch" not in changed  # the same machine made both


def test_a_fresh_clone_without_the_cache_diffs_every_metric(built, tmp_path):
    """`dvc metrics diff HEAD~1` on a clone with an empty DVC cache: every metric loads, no warning."""
    repo = built[0]
    sh(f"git clone -q {repo} {tmp_path / 'c'}", tmp_path)
    clone = tmp_path / "c"
    with open(clone / "params.yaml", "a") as f:
        f.write("\n")  # a second commit, so that HEAD~1 exists
    sh("git -c user.email=t@t -c user.name=t commit -qam two", clone)
    p = sh("dvc metrics diff HEAD~1 --all", clone)
    assert "failed to load" not in (p.stdout + p.stderr).lower() and p.stderr.strip() == "", p.stderr
    for f in ("metrics/data.json", "metrics/train.json", "metrics/evaluate.json"):
        assert f in p.stdout, p.stdout


def test_bad_user_part_fails_naming_the_line_and_keeps_committed_outputs(clone):
    before = (clone / "data/hidden/tiny-a/index.parquet").read_bytes()
    good = {"id": "u1", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    (clone / "data/parts").mkdir(exist_ok=True)
    (clone / "data/parts/mine.jsonl").write_text(json.dumps(good) + "\n" + '{"id": "u2", "messages": [\n')
    sh("dvc add -q data/parts/mine.jsonl", clone)
    params = yaml.safe_load((clone / "params.yaml").read_text())
    params["data"]["parts"].append("mine")
    (clone / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    p = sh("dvc repro", clone, check=False)
    assert p.returncode != 0
    assert "data/parts/mine.jsonl:2" in p.stdout + p.stderr
    assert (clone / "data/hidden/tiny-a/index.parquet").read_bytes() == before
    assert verify_store(clone / "data/hidden/tiny-a", progress=False) == []
    # fixed input: only the new part runs
    (clone / "data/parts/mine.jsonl").write_text(json.dumps(good) + "\n")
    sh("dvc add -q data/parts/mine.jsonl", clone)
    p = sh("dvc repro", clone)
    assert "Running stage 'extract@mine'" in p.stdout and "Running stage 'extract@tiny-a'" not in p.stdout


def test_out_of_range_taps_fail_clearly(clone):
    params = yaml.safe_load((clone / "params.yaml").read_text())
    params["extract"]["taps"] = [2, 15, 40]
    (clone / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    p = sh("dvc repro extract@tiny-a", clone, check=False)
    assert p.returncode != 0 and "extract.taps [2, 15, 40]: [40] out of range" in p.stdout + p.stderr
    # DVC clears a stage's outs before running it; the committed version is still in the cache
    sh("dvc checkout -q data/hidden/tiny-a", clone)
    assert verify_store(clone / "data/hidden/tiny-a", progress=False) == []


def test_vllm_serves_the_exported_drafter_as_the_offline_evaluation_says(built, tmp_path):
    """vLLM's CPU build (`make vllm-env`, a real OpenAI server on 127.0.0.1) loads the pipeline's
    exported drafter unchanged, drafts k tokens per step, stays lossless against its own plain
    greedy decoding, and its acceptance counters agree with this project's offline decoder on the
    same prompt tokens and budget."""
    from eaglenest.evaluate import mtbench_prompts
    from eaglenest.serving.check import serve_check
    from eaglenest.serving.vllm import VLLM, VLLM_PYTHON
    from eaglenest.target.directory import load_target

    from .conftest import REPO

    repo = built[0]
    m, per_q = serve_check(
        VLLM(REPO / VLLM_PYTHON),
        load_target(repo / "data/target"),
        repo / "data/drafter",
        mtbench_prompts(4),
        mode=3,
        max_new_tokens=24,
        log_dir=tmp_path,
    )
    assert m["engine"] == "vllm" and m["mode"] == "3" and m["questions"] == len(per_q) == 4
    assert m["identical_to_greedy"] == m["offline_identical_to_greedy"] == 4, per_q
    assert m["drafts"] > 0 and m["draft_tokens"] == 3 * m["drafts"]
    assert len(m["accept_per_position_engine"]) == 3
    assert abs(m["tau_gap"]) < 0.05, m


def test_sglang_drafts_trees_as_the_offline_evaluation_says(built, tmp_path):
    """SGLang's own EAGLE-3 tree decoding (`sglang_patch.serve`, on this CPU through the kernel
    stand-in) with the pipeline's exported drafter: its plain run equals transformers' greedy
    decoding, its tree run equals its plain run, and its counters (verifications, tau, acceptance
    per depth) agree with this project's offline tree decoder on the same prompts and tree."""
    from eaglenest.decoding.speculative import TargetRunner, greedy_decode
    from eaglenest.decoding.tree import TreeShape
    from eaglenest.evaluate import mtbench_prompts, prompt_ids
    from eaglenest.serving.check import serve_check
    from eaglenest.serving.sglang import SGLANG_PYTHON, SGLang
    from eaglenest.target.directory import load_target
    from eaglenest.target.loading import load_model, load_tokenizer, stop_ids

    from .conftest import REPO

    repo = built[0]
    target, prompts, tree = load_target(repo / "data/target"), mtbench_prompts(4), TreeShape(3, 4, 8)
    m, per_q = serve_check(
        SGLang(REPO / SGLANG_PYTHON), target, repo / "data/drafter", prompts, tree, 24, log_dir=tmp_path
    )
    assert m["engine"] == "sglang" and m["mode"] == "tree-3x4x8" and m["questions"] == len(per_q) == 4
    assert m["identical_to_greedy"] == m["offline_identical_to_greedy"] == 4, per_q
    assert m["drafts"] == m["verifications_offline"] > 0 and m["draft_tokens"] == 7 * m["drafts"]
    assert len(m["accept_per_position_engine"]) == 3 and m["accepted_tokens"] > 0
    assert abs(m["tau_gap"]) < 0.05, m
    tok = load_tokenizer(target)
    model = load_model(target, dtype="float32", device="cpu")
    runner, eos = TargetRunner(model, []), stop_ids(model, tok) | {tok.eos_token_id}
    for q, ids in zip(per_q, prompt_ids(tok, prompts)):
        assert q["output_ids"] == greedy_decode(runner, ids, 24, eos).tokens, q["id"]
