"""`extract.backend: vllm`: hidden states through vLLM's own extraction path (a real vLLM server,
its CPU build from `make vllm-env`, with vllm_patch.capture's connector), stored and put through
the same gate as the hf backend."""

import json

import pytest

from eaglenest.store.hidden_store import HiddenStore

from .conftest import (
    REPO,
    assert_stores_agree,
    base_params,
    gate,
    random_samples,
    run_py,
    stage_workspace,
    write_tokenized,
)

pytestmark = pytest.mark.slow
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"


def test_vllm_states_pass_the_gate_and_match_the_hf_store(smollm2, tmp_path):
    seqs = random_samples(6, 20000, 8, 120, seed=5)  # within base_params max_seq_len 128
    stores = {}
    for backend in ("vllm", "hf"):
        params = base_params(extract={"backend": backend}, validate=gate(6))  # every sample checked
        params["extract"]["vllm"] = {**params["extract"]["vllm"], "python": str(VLLM_PY), "log_dir": str(tmp_path)}
        ws = stage_workspace(tmp_path / backend, smollm2, params)
        write_tokenized(ws / "data/tokenized/p.parquet", seqs)
        run_py(["-m", "stages.extract", "p", "--no-progress"], cwd=ws, timeout=900)
        report = json.loads((ws / "reports/extract/p.json").read_text())
        assert report["validation"]["passed"] and len(report["validation"]["sample_ids"]) == 6, report["validation"]
        stores[backend] = HiddenStore(ws / "data/hidden/p")
    v, h = stores["vllm"], stores["hf"]
    assert v.attrs["extractor"]["backend_version"].startswith("vllm-0.")
    assert v.attrs["extractor_fingerprint"] != h.attrs["extractor_fingerprint"]
    assert_stores_agree(v, h, seqs, min_cosine=0.98)


def test_vllm_tensor_parallel_over_two_cpu_workers_passes_the_gate(smollm2, tmp_path):
    """vLLM's own tensor parallelism (`--tensor-parallel-size 2`: two CPU workers, the backend binds
    each to half the cores) extracts states that pass the gate. SmolLM2's 9 heads do not split in
    two: a random Llama with 4 (head size 64, which vLLM's CPU attention takes)."""
    from eaglenest.target.directory import materialize
    from eaglenest.target.random_weights import build

    target = materialize(str(build("llama", tmp_path / "model", smollm2.model_dir)), tmp_path / "target")
    params = base_params(extract={"backend": "vllm", "taps": [1, 3, 4]}, validate=gate(6))
    params["extract"]["vllm"] = {**params["extract"]["vllm"], "python": str(VLLM_PY), "log_dir": str(tmp_path),
                                 "server_args": ["--tensor-parallel-size", "2"]}  # fmt: skip
    ws = stage_workspace(tmp_path / "ws", target, params)
    write_tokenized(ws / "data/tokenized/p.parquet", random_samples(6, 20000, 8, 120, seed=5))
    run_py(["-m", "stages.extract", "p", "--no-progress"], cwd=ws, timeout=900)
    report = json.loads((ws / "reports/extract/p.json").read_text())
    assert report["validation"]["passed"] and len(report["validation"]["sample_ids"]) == 6
    log = next(tmp_path.glob("server-*.log")).read_text()
    assert "Worker_TP1" in log, "the server ran a second tensor-parallel worker"
