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
