"""Bytes before work (docs/design.md: Disk plan): `eaglenest plan` estimates what the stores and pack
will take, near what they do take, and the extract stage refuses a part the disk cannot hold
before anything loads or is written."""

import json
import shutil

import numpy as np
import yaml

from eaglenest.disk_plan import for_params
from eaglenest.store.hidden_store import HiddenStore
from eaglenest.target.directory import load_target

from .conftest import base_params, random_samples, run_py, stage_workspace, write_tokenized


def test_plan_for_a_config_alone_gives_the_1t_moe_users_terabytes(tmp_path):
    """hidden 7168, 3 taps + final, 21M tokens: ~1.2 TB in bf16 (what that user worked out by hand),
    half that in fp8 (one byte an element and a float32 scale per tap)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61}))
    p = run_py(["-m", "eaglenest.cli", "plan", "--config", str(config), "--tokens", "21e6", "--json"], cwd=tmp_path)
    plan = json.loads(p.stdout)
    assert plan["bf16"]["store_bytes"] == 21_000_000 * 4 * 7168 * 2  # 1.204 TB
    assert plan["fp8"]["store_bytes"] == 21_000_000 * (4 * 7168 + 4 * 4)
    text = run_py(["-m", "eaglenest.cli", "plan", "--config", str(config), "--tokens", "21e6"], cwd=tmp_path).stdout
    assert "1.20 TB" in text and "602 GB" in text
    bad = run_py(["-m", "eaglenest.cli", "plan", "--config", str(tmp_path / "none.json"), "--tokens", "1"],
                 cwd=tmp_path, check=False)  # fmt: skip
    assert bad.returncode != 0 and "none.json: not a readable config.json" in bad.stderr


def test_plan_estimates_the_stores_and_pack_it_made(tiny_packed, tmp_path):
    """Each part's store from its tokens and the compression of the stores written: within a few percent
    of the bytes on disk; pack (tokens and an index, no state): within 2x, and a small fraction of them."""
    ws = shutil.copytree(tiny_packed, tmp_path / "ws", symlinks=True)
    params = yaml.safe_load((ws / "params.yaml").read_text())
    params["data"] = {"parts": ["a", "b", "c"]}  # c: not tokenized yet
    plan = for_params(params, ws)
    for part in ("a", "b"):
        store = HiddenStore(ws / "data" / "hidden" / part)
        on_disk = sum(f.stat().st_size for f in store.path.rglob("*") if f.is_file())
        assert plan["parts"][part]["tokens"] == store.n_tokens
        assert abs(plan["parts"][part]["store_bytes"] / on_disk - 1) < 0.05, (part, plan["parts"][part], on_disk)
    assert plan["untokenized"] == ["c"] and plan["parts"]["c"]["store_bytes"] is None
    packed = sum(f.stat().st_size for f in (ws / "data" / "packed").rglob("*") if f.is_file())
    assert 0.5 < plan["pack_bytes"] / packed < 2, (plan["pack_bytes"], packed)
    assert plan["pack_bytes"] < 0.1 * plan["stores_bytes"]
    # the target's weights: as stored, and in bf16 (what a GPU holds), counted from its tensors
    from safetensors import safe_open

    model_dir = load_target(ws / "data" / "target").model_dir
    files = [f for f in model_dir.iterdir() if f.suffix == ".safetensors"]
    numel = 0
    for f in files:
        with safe_open(f, "pt") as st:
            numel += sum(int(np.prod(st.get_slice(k).get_shape())) for k in st.keys())
    assert plan["target_weights_bytes"] == sum(f.stat().st_size for f in files) > 0
    assert plan["target_bf16_bytes"] == 2 * numel and plan["gpu_bytes"] is None  # no GPU here


def test_extract_refuses_a_part_the_disk_cannot_hold_before_it_starts(tiny_target, tmp_path):
    params = base_params(extract={"disk_reserve_gb": 1e9})  # an exabyte of reserve: no disk holds it
    ws = stage_workspace(tmp_path / "ws", tiny_target, params)
    write_tokenized(ws / "data" / "tokenized" / "p.parquet", random_samples(8, 500, 20, 60, seed=1))
    p = run_py(["-m", "stages.extract", "p", "--no-progress"], cwd=ws, check=False)
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert "part p: its store needs ~" in last and "free; nothing started" in last
    assert not (ws / "data" / "hidden" / "p").exists() and not (ws / ".eaglenest" / "work").exists()
    assert not (ws / "reports").exists()
