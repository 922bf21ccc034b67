"""Extraction: padding leaks, the validation gate against injected defects, crash + resume."""

import dataclasses
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from eaglenest.extraction.backends.hf import HFBackend
from eaglenest.extraction.gate import token_stats
from eaglenest.extraction.loop import GateFailed, extract_part
from eaglenest.extraction.reference import Reference
from eaglenest.runtime.errors import EaglenestError
from eaglenest.store.hidden_store import HiddenStore, verify_store
from eaglenest.store.piece_buffers import SHM_PREFIX
from eaglenest.target.taps import resolve_taps

from .conftest import REPO, base_params, cosine, gate, random_samples, run_py, stage_workspace, write_tokenized
from .defects import DroppedFirstPosition, OffByOneTap, PreNormFinal


def own_shm() -> set[str]:
    """This process's shared-memory piece buffers (another test process may hold its own meanwhile)."""
    return {p.name for p in Path("/dev/shm").glob(f"{SHM_PREFIX}{os.getpid()}-*")}


@pytest.mark.parametrize("dtype, min_cos, max_rel", [("float32", 0.999999, 2e-5), ("bfloat16", 0.999, 0.03)])
def test_padded_batch_equals_one_by_one(tiny_target, dtype, min_cos, max_rel):
    taps = resolve_taps("auto", tiny_target.num_layers)
    be = HFBackend(tiny_target, taps, dtype=dtype, device="cpu")
    seqs = random_samples(5, tiny_target.vocab_size, 3, 90, seed=1)
    batched = be.extract(seqs)  # one batch, right-padded to the longest
    for s, (a, f) in zip(seqs, batched):
        a1, f1 = be.extract([s])[0]
        for x, y in ((a.flatten(0, 1), a1.flatten(0, 1)), (f, f1)):
            cos, rel = token_stats(x.float(), y.float())
            assert cos.min() >= min_cos and rel.max() <= max_rel, (dtype, len(s), cos.min(), rel.max())


def test_padded_batch_equals_one_by_one_smollm2(smollm2):
    be = HFBackend(smollm2, resolve_taps("auto", smollm2.num_layers), dtype="bfloat16", device="cpu")
    seqs = random_samples(4, smollm2.vocab_size, 8, 120, seed=2)
    for s, (a, f) in zip(seqs, be.extract(seqs)):
        a1, f1 = be.extract([s])[0]
        cos, rel = token_stats(torch.cat([a.flatten(0, 1), f]).float(), torch.cat([a1.flatten(0, 1), f1]).float())
        assert cos.min() >= 0.998 and rel.mean() <= 0.02


def test_compiled_backend_equals_eager(tiny_target):
    """`extract.hf.compile: true` compiles each decoder layer inside transformers' forward; the
    states must not change beyond float reordering, for any batch shape (one sample, one token
    too), with one set of graphs for all layers and shapes (a per-layer or per-shape recompile would
    show as more graphs), and a bad value is refused."""
    from torch._dynamo.utils import counters

    taps = resolve_taps("auto", tiny_target.num_layers)
    assert HFBackend(tiny_target, taps, device="cpu").compile is False  # auto: CUDA only
    with pytest.raises(EaglenestError, match="extract.hf.compile must be"):
        HFBackend(tiny_target, taps, device="cpu", compile="yes")
    from eaglenest.extraction.backends.hf import COMPILE
    from stages._params import SCHEMA

    rule = SCHEMA["extract"]["hf"]["compile"]  # params.yaml takes what the backend takes
    assert set(COMPILE) == {"auto", "kernels", "layers", True, False}
    assert all(rule(v) is None for v in COMPILE) and rule("yes")
    eager = HFBackend(tiny_target, taps, dtype="float32", device="cpu", compile=False)
    comp = HFBackend(tiny_target, taps, dtype="float32", device="cpu", compile=True)
    counters.clear()
    graphs = []
    for seqs in (
        random_samples(3, tiny_target.vocab_size, 3, 40, seed=4),
        random_samples(1, tiny_target.vocab_size, 50, 70, seed=5),
    ):
        for (a, f), (a1, f1) in zip(eager.extract(seqs), comp.extract(seqs)):
            cos, rel = token_stats(torch.cat([a.flatten(0, 1), f]).float(), torch.cat([a1.flatten(0, 1), f1]).float())
            # fp32 compute, stored as bf16: at most a rounding flip (one bf16 ulp = 2^-8 relative)
            assert cos.min() >= 0.99999 and rel.max() <= 2**-7, (cos.min(), rel.max())
        graphs.append(counters["stats"]["unique_graphs"])
    compiled = [m for m in comp.decoder.modules() if getattr(m, "_compiled_call_impl", None) is not None]
    assert [type(m).__name__ for m in compiled] == ["LlamaDecoderLayer"] * tiny_target.num_layers, compiled
    # input norm | attention (its capture hook breaks the graph) | residual + norm + MLP + residual,
    # all three at the FIRST batch (the warm-up); a one-sample batch is padded to two rows and a
    # one-token sample to two tokens, so no size-1 family is ever compiled; other shapes reuse them
    assert graphs == [3, 3], (graphs, dict(counters["stats"]))
    comp.extract(random_samples(5, tiny_target.vocab_size, 7, 90, seed=6))
    (a, f), (a1, f1) = eager.extract([np.array([5], np.int32)])[0], comp.extract([np.array([5], np.int32)])[0]
    assert a1.shape == a.shape == (1, 3, tiny_target.hidden_size) and f1.shape == f.shape
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])


def family_target(root, family: str):
    """A 4-layer random decoder of `family` (hidden 64, bf16, every parameter random: biases and norms
    too), saved under root/family."""
    import transformers as tf

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    cls, extra = {
        "llama3_rope": ("Llama", {"rope_parameters": llama3}),
        "llama_bias": ("Llama", {"attention_bias": True}),
        "mistral": ("Mistral", {"sliding_window": None}),
        "qwen2": ("Qwen2", {}),
        "qwen3": ("Qwen3", {"head_dim": 32}),
        "mistral_window": ("Mistral", {"sliding_window": 16}),
        "yarn": ("Llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}),
        "phi3": ("Phi3", {"pad_token_id": 0}),
    }[family]
    torch.manual_seed(0)
    model = getattr(tf, f"{cls}ForCausalLM")(getattr(tf, f"{cls}Config")(**common, **extra))
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    model.to(torch.bfloat16).save_pretrained(root / family)
    return root / family


@pytest.mark.parametrize("family", ["llama3_rope", "llama_bias", "mistral", "qwen2", "qwen3"])
def test_own_layers_equal_transformers_bit_for_bit(tmp_path, family):
    """The own decoder (`backends.llama`: what the hf backend runs on CUDA) computes exactly what
    transformers' decoder computes, eager, in float32 and bfloat16, for each family it runs: every
    layer's input and the final norm's output, bit for bit."""
    from transformers import AutoModel

    from eaglenest.extraction.backends import llama
    from eaglenest.extraction.backends.hf_weights import copy_cast

    path = family_target(tmp_path, family)
    spec = llama.plan(path)
    ids = torch.from_numpy(np.stack(random_samples(3, 512, 40, 40, seed=3))).long()
    for dtype in (torch.float32, torch.bfloat16):
        ref = AutoModel.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
        weights = llama.allocate(spec, dtype, "cpu")
        copy_cast(path, weights)
        with torch.inference_mode():
            out = ref(input_ids=ids, output_hidden_states=True, use_cache=False)
            kept, final = llama.Decoder(spec, weights).run(ids, (True,) * spec.layers)
        assert len(kept) == spec.layers
        for j, h in enumerate(kept):
            assert torch.equal(h, out.hidden_states[j]), (family, dtype, j)
        assert torch.equal(final, out.last_hidden_state), (family, dtype)


def test_own_layers_compiled_once_in_a_thread_and_where_they_do_not_run(tiny_target, tmp_path, caplog):
    """`extract.hf.compile: layers` (the CUDA default): the own decoder, its one layer function
    compiled in a thread while the weights are copied in; the first batch waits for it. Within float
    reordering of transformers' eager states, one graph for every layer and batch shape, no
    transformers forward. Targets the own layers do not run (another family, a sliding window,
    another rotary kind, eager attention) fall back to transformers' layers compiled in place,
    saying why; the extractor's fingerprint names the code that computes the states."""
    from torch._dynamo.utils import counters

    from eaglenest.extraction.backends import llama
    from eaglenest.extraction.backends.hf_weights import Unsupported

    taps = resolve_taps("auto", tiny_target.num_layers)
    eager = HFBackend(tiny_target, taps, dtype="float32", device="cpu", compile=False)
    own = HFBackend(tiny_target, taps, dtype="float32", device="cpu", compile="layers")
    assert own.own is not None and own.describe()["version"].startswith(llama.VERSION)
    assert eager.describe()["version"].startswith("transformers-")
    counters.clear()
    own.load()
    assert own.compiling is not None  # compiling beside the copy
    for seqs in (
        random_samples(3, tiny_target.vocab_size, 3, 40, seed=4),
        random_samples(1, tiny_target.vocab_size, 50, 70, seed=5),
        random_samples(5, tiny_target.vocab_size, 7, 90, seed=6),
    ):
        for (a, f), (a1, f1) in zip(eager.extract(seqs), own.extract(seqs)):
            cos, rel = token_stats(torch.cat([a.flatten(0, 1), f]).float(), torch.cat([a1.flatten(0, 1), f1]).float())
            assert cos.min() >= 0.99999 and rel.max() <= 2**-7, (cos.min(), rel.max())
    assert own.forward == own._own_forward and own.compiling is None
    assert own.timings["compile_s"] > 0 and own.timings["warm_up_s"] <= own.timings["compile_s"] + 0.5
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # one graph, every layer and shape
    assert isinstance(own.decoder, llama.Decoder)

    for family, why in (("mistral_window", "sliding-window"), ("yarn", "rotary embedding 'yarn'"),
                        ("phi3", "model_type 'phi3'")):  # fmt: skip
        with pytest.raises(Unsupported, match=why):
            llama.plan(family_target(tmp_path, family))
    caplog.clear()
    with caplog.at_level("INFO"):
        fallback = HFBackend(tiny_target, taps, device="cpu", compile="layers", attn="eager")  # bfloat16
    assert "attention 'eager'" in caplog.text and fallback.mode is True and fallback.own is None
    fallback.load()
    assert fallback.forward == fallback._hf_forward
    assert torch.get_default_dtype() is torch.float32
    assert {p.dtype for p in fallback.decoder.parameters()} == {torch.bfloat16}


def test_own_kernels_in_the_triton_interpreter(tmp_path):
    """The own layer with its Triton kernels (`compile: kernels`, the CUDA default), run here in
    Triton's interpreter (tests/kernels_interpreted.py, a process of its own): the eager own layer's
    states within float32 reordering, for a Llama with q/k/v biases and a Qwen3 with per-head q/k
    norms (both GQA), and at sizes no power of two (hidden 576, 9 heads, a head of 80); through the
    backend, eager transformers' states, a sample of one token among them, the kernels built in the
    warm-up thread and named by the fingerprint; refused on a CPU outside the interpreter. (The
    interpreter rounds float32 to bfloat16 by truncation, so bfloat16 is compared on the GPU:
    tests/gpu_checks.py.)"""
    p = run_py(["-m", "tests.kernels_interpreted", str(tmp_path)], cwd=REPO, env_extra={"TRITON_INTERPRET": "1"})
    res = json.loads(p.stdout.strip().splitlines()[-1])
    for name, r in [(n, res[n]) for n in ("llama_bias", "qwen3", "backend")] + list(res["odd_shapes"].items()):
        assert r["min_cos"] >= 0.999999 and r["max_rel"] <= 1e-5, (name, r)
    assert len(res["odd_shapes"]) == 2
    be = res["backend"]
    assert 1 in be["lengths"] and be["layer_module"] == "eaglenest.extraction.backends.llama_kernels"
    assert be["version"].startswith("eaglenest-llama-kernels-1-triton-") and be["compile_s"] > 0
    assert "kernels runs Triton kernels: CUDA only" in be.get("refused", ""), be


def test_own_weight_loader_equals_transformers_and_falls_back_where_files_differ(tiny_target, tmp_path, caplog):
    """The hf backend fills the decoder straight from the safetensors: the very parameters (and
    states) transformers' loader gives. Files that do not hold exactly the decoder's parameters in
    its dtype go through transformers instead, saying why; a truncated file is an error naming it,
    also when the load ran in a thread."""
    import shutil

    from safetensors.torch import load_file, save_file

    from eaglenest.extraction.backends.hf_weights import Unsupported, build_decoder, copy_weights, plan_copy
    from eaglenest.target.loading import load_model

    taps = resolve_taps("auto", tiny_target.num_layers)
    own = HFBackend(tiny_target, taps, device="cpu")  # bfloat16, as the files
    with caplog.at_level("INFO"):
        own.load()
    assert "weights copied from the safetensors" in caplog.text
    ref = load_model(tiny_target, dtype="bfloat16").get_decoder().state_dict()
    got = own.decoder.state_dict()
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    caplog.clear()
    with caplog.at_level("INFO"):
        HFBackend(tiny_target, taps, dtype="float32", device="cpu").load()
    assert "loading through transformers" in caplog.text and "BF16" in caplog.text

    other = tmp_path / "model"
    shutil.copytree(tiny_target.model_dir, other)
    (f,) = other.glob("*.safetensors")
    tensors = load_file(f)
    save_file({**tensors, "model.extra.weight": torch.zeros(3)}, f, metadata={"format": "pt"})
    decoder = build_decoder(other, "bfloat16", "cpu", "sdpa").state_dict(keep_vars=True)
    with pytest.raises(Unsupported, match="model.extra.weight"):
        plan_copy(other, decoder)
    save_file({k: v for k, v in tensors.items() if "layers.3." not in k}, f, metadata={"format": "pt"})
    with pytest.raises(Unsupported, match="not in the files"):
        plan_copy(other, decoder)
    save_file(tensors, f, metadata={"format": "pt"})
    copies = plan_copy(other, decoder)
    os.truncate(f, f.stat().st_size - 100)
    with pytest.raises(EaglenestError, match=f"{f.name}: short read"):
        copy_weights(copies, "cpu")
    # loading in a thread beside the part's preparation (`start_load`): the same error, in the caller
    broken = HFBackend(dataclasses.replace(tiny_target, model_dir=other), taps, device="cpu")
    broken.start_load()
    assert not broken.loaded
    with pytest.raises(EaglenestError, match=f"{f.name}: short read"):
        broken.load()
    broken.close()


def test_tap_ids_out_of_range():
    with pytest.raises(EaglenestError, match=r"\[30\] out of range.*\[0, 29\]"):
        resolve_taps([2, 15, 30], 30)
    with pytest.raises(EaglenestError, match="three integers"):
        resolve_taps([2, 15], 30)
    assert resolve_taps("auto", 30) == [2, 15, 27]
    assert resolve_taps("auto", 7) == [2, 3, 4]
    for layers in (2, 4, 6):  # auto's [2, L//2, L-3] collapses: a clear error, not a gate IndexError
        with pytest.raises(EaglenestError, match=rf"auto gives .* {layers}-layer target.*\[0, {layers - 1}\]"):
            resolve_taps("auto", layers)


# --- injected defects: each must fail the gate and commit nothing -------------------------------


@pytest.mark.parametrize(
    "defect, tap", [(OffByOneTap, "aux_"), (PreNormFinal, "final"), (DroppedFirstPosition, "aux_")]
)
def test_gate_rejects_injected_defects(smollm2, tmp_path, defect, tap):
    taps = resolve_taps("auto", smollm2.num_layers)
    seqs = random_samples(6, 20000, 20, 80, seed=3)
    tok = write_tokenized(tmp_path / "p.parquet", seqs)
    out = tmp_path / "hidden" / "p"
    shm = own_shm()
    with pytest.raises(GateFailed) as e:  # writer processes: piece buffers in shared memory
        extract_part(
            part="p",
            tokenized=tok,
            target=smollm2,
            backend=defect(smollm2, taps, device="cpu"),
            taps=taps,
            dtype="bfloat16",
            revision=0,
            layout_cfg=dict(chunk_mb=0.1, shard_mb=1, codec="zstd", level=1),
            validate_cfg=gate(4),
            out_dir=out,
            work_root=tmp_path / "work",
            batch_tokens=512,
            max_seq_len=128,
            progress=False,
            writers=2,
        )
    assert not out.exists(), "a failed gate must commit nothing"
    assert own_shm() - shm == set(), "the piece buffers are freed on failure too"
    m = e.value.metrics
    assert not m["validation"]["passed"] and any(f.startswith(tap) for f in m["validation"]["failures"])


def test_reference_model_is_freed_and_runs_in_a_process_of_its_own(tiny_target, tmp_path):
    """The gate's float32 reference (32 GB for an 8B target) is gone when its gate ends, without
    waiting for the cyclic GC: a process extracting several parts ran out of GPU memory on the 4th.
    Its states taken ahead (`precompute`), all of it but the lm_head is freed and the states are
    those it would compute. On a GPU the stage runs it in a process of its own (`ReferenceProcess`):
    the same figures as in the stage's process; a reference that fails to load, or a process that
    dies, is an error that commits nothing."""
    import gc
    import signal
    import weakref

    from eaglenest.extraction.reference_process import ReferenceProcess, choose

    taps = resolve_taps("auto", tiny_target.num_layers)
    ids = np.arange(3, 12)
    gc.disable()
    try:
        with Reference(tiny_target, taps) as ref:
            model = weakref.ref(ref.model)
            direct = ref.states(ids)
            assert direct["final"].shape == (9, tiny_target.hidden_size)
            ref.precompute([ids])
            ref.keep_head_only()
            assert model() is None and ref.head is not None
            again = ref.states(ids)
            assert all(torch.equal(direct[k], again[k]) for k in direct)
            with pytest.raises(EaglenestError, match="no reference states for a sample of 4 tokens"):
                ref.states(ids[:4])
        del ref
    finally:
        gc.enable()
    assert choose(10, 4, 0) == sorted(choose(10, 4, 0)) and len(set(choose(10, 4, 0))) == 4
    # on the CPU the stage's gate runs here; in its own process (a GPU's way) the figures are the same
    seqs = random_samples(12, 500, 10, 60, seed=8)
    here = extract_small(tiny_target, write_tokenized(tmp_path / "t.parquet", seqs), tmp_path / "s", tmp_path / "w")
    ref = ReferenceProcess(tiny_target, taps, "cpu", tmp_path / "t.parquet", choose(len(seqs), 2, 0))
    try:
        there, passed = ref.compare(tmp_path / "s", gate(2))
    finally:
        ref.close()
    assert passed and there["taps"] == here["validation"]["taps"] and there["reference_states_s"] > 0
    tok = write_tokenized(tmp_path / "p.parquet", [ids.astype(np.int32)])
    broken = dataclasses.replace(tiny_target, model_dir=tiny_target.model_dir / "missing")
    ref = ReferenceProcess(broken, taps, "cpu", tok, [0])
    with pytest.raises(EaglenestError, match="reference failed \\(loading the float32 reference\\).*missing"):
        ref.compare(tmp_path, gate(1))
    ref.close()
    ref = ReferenceProcess(tiny_target, taps, "cpu", tok, [0])
    os.kill(ref.proc.pid, signal.SIGKILL)
    with pytest.raises(EaglenestError, match="reference process died"):
        ref.compare(tmp_path, gate(1))
    ref.close()
    assert not ref.proc.is_alive()


def test_gate_passes_clean_extraction_with_margin(smollm2, tmp_path):
    taps = resolve_taps("auto", smollm2.num_layers)
    tok = write_tokenized(tmp_path / "p.parquet", random_samples(6, 20000, 20, 80, seed=3))
    m = extract_part(
        part="p",
        tokenized=tok,
        target=smollm2,
        backend=HFBackend(smollm2, taps, device="cpu"),
        taps=taps,
        dtype="bfloat16",
        revision=0,
        layout_cfg=dict(chunk_mb=0.1, shard_mb=1, codec="zstd", level=1),
        validate_cfg=gate(4),
        out_dir=tmp_path / "hidden" / "p",
        work_root=tmp_path / "work",
        batch_tokens=512,
        max_seq_len=128,
        progress=False,
    )
    v = m["validation"]
    assert v["passed"] and v["lm_head_logits_cosine"]["min"] > 0.98
    for k in taps:  # the adjacent tap is far below the threshold the real tap clears
        assert (
            v["taps"][f"aux_{k}"]["cosine_mean"]
            > v["thresholds"]["min_cosine_mean"]
            > v["margin"][f"aux_{k}_vs_adjacent_{k + 1}"]["cosine_mean"]
        )


class SeesChildren(HFBackend):
    """The hf backend, counting this process's child processes when the extraction loads it."""

    def load(self):
        self.children_at_load = len(multiprocessing.active_children())
        return super().load()


def test_writer_processes_store_the_same_bytes(tiny_target, tmp_path):
    """Pieces written by writer processes over shared memory (the many-core GPU-host path) equal
    those written in-thread, and no shared-memory segment is left behind."""
    taps = resolve_taps("auto", tiny_target.num_layers)
    tok = write_tokenized(tmp_path / "p.parquet", random_samples(40, tiny_target.vocab_size, 5, 60, seed=4))
    before = own_shm()
    index = {}
    for writers in (1, 3):
        m = extract_part(
            part="p",
            tokenized=tok,
            target=tiny_target,
            backend=(backend := SeesChildren(tiny_target, taps, device="cpu")),
            taps=taps,
            dtype="float32",
            revision=0,
            layout_cfg=dict(chunk_mb=0.005, shard_mb=0.02, codec="zstd", level=1),
            validate_cfg=gate(2),
            out_dir=tmp_path / f"w{writers}",
            work_root=tmp_path / "work",
            batch_tokens=256,
            max_seq_len=64,
            progress=False,
            writers=writers,
        )
        store = HiddenStore(tmp_path / f"w{writers}")
        assert verify_store(store.path, progress=False) == []
        # the host-path report accounts for every piece the writers handled
        hp = m["host_path"]
        assert hp["writers"] == writers and hp["bound_by"] in ("backend", "store")
        # writer processes are spawned before the target loads, not when the first piece needs one
        assert backend.children_at_load == (writers if writers > 1 else 0) and hp["writers_ready_s"] >= 0
        busy = hp["writer_busy"]
        # the parts of a piece's time add up: the phases within the writer's call, the call and the
        # commit within piece_s (each figure rounded to 0.01 s: up to 0.005 s off)
        phases = busy["digest_s"] + busy["encode_s"] + busy["write_s"]
        assert busy["piece_s"] > 0 and busy["call_s"] >= phases - 0.02
        assert busy["piece_s"] >= busy["call_s"] + busy["commit_s"] - 0.015
        assert {"fill_s", "wait_fill_s"} <= busy.keys() and hp["launch_s"] + hp["wait_backend_s"] > 0
        waits = hp["launch_s"] + hp["wait_backend_s"] + hp["wait_writers_s"] + hp["new_buffers_s"]
        assert hp["loop_s"] >= waits - 0.02 and hp["loop_s"] > 0  # the loop's time, split (2 decimals)
        index[writers] = [(r["key"], r["digest"], r["start"]) for r in store.index]
        # pieces reuse pooled buffers: every row no sample owns must hold the fill values, not a
        # previous piece's states
        a = store.arrays
        free = np.ones(a["input_ids"].shape[0], dtype=bool)
        for r in store.index:
            free[r["start"] : r["start"] + r["length"]] = False
        assert free.any() and (a["input_ids"][:][free] == -1).all()
        assert not a["aux"][:][free].any() and not a["final"][:][free].any()
    assert index[1] == index[3] and HiddenStore(tmp_path / "w3").attrs["layout"]["shard_tokens"] < 200
    assert own_shm() - before == set()


# --- crash safety --------------------------------------------------------------------------------


def _workspace(root, target, seqs):
    ws = stage_workspace(root, target, base_params(store={"chunk_mb": 0.02, "shard_mb": 0.5}))
    write_tokenized(ws / "data" / "tokenized" / "p.parquet", seqs)
    return ws


def test_sigkill_then_resume_loses_and_duplicates_nothing(smollm2, tmp_path):
    seqs = random_samples(24, 20000, 90, 128, seed=4)  # one sample per piece: 24 pieces
    ws = _workspace(tmp_path / "a", smollm2, seqs)
    env_cmd = [sys.executable, "-m", "stages.extract", "p", "--no-progress"]
    proc = subprocess.Popen(
        env_cmd,
        cwd=ws,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    manifests = []
    deadline = time.time() + 300
    while time.time() < deadline and len(manifests) < 5:
        manifests = list((ws / ".eaglenest" / "work").glob("p-*/pieces/*.json"))
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 5 <= len(manifests) < 24, "kill must land mid-extraction"
    assert not (ws / "data" / "hidden" / "p").exists()

    p = run_py(["-m", "stages.extract", "p", "--no-progress"], cwd=ws)
    assert "resuming" in p.stderr
    resumed = HiddenStore(ws / "data" / "hidden" / "p")
    assert verify_store(resumed.path, progress=False) == []
    metrics = json.loads((ws / "reports" / "timing" / "extract" / "p.json").read_text())  # how this run went
    assert metrics["pieces_resumed"] >= 5 and metrics["tokens_extracted_now"] < sum(map(len, seqs))

    clean_ws = _workspace(tmp_path / "b", smollm2, seqs)
    run_py(["-m", "stages.extract", "p", "--no-progress"], cwd=clean_ws)
    clean = HiddenStore(clean_ws / "data" / "hidden" / "p")
    # the part's wall clock, itemised: forward loop + fixed cost (imports, fingerprint, load, gate, ...)
    report = json.loads((clean_ws / "reports" / "timing" / "extract" / "p.json").read_text())
    fc = report["fixed_cost"]
    items = ("imports_s", "fingerprint_s", "prepare_s", "load_s", "gate_s", "publish_s")
    assert all(fc[k] > 0 for k in items if k != "load_s") and fc["load_s"] >= 0, fc
    assert report["wall_s"] == pytest.approx(report["forward_s"] + fc["total_s"], abs=0.02)
    assert sum(fc[k] for k in items) <= fc["total_s"] + 0.05
    # the load ran beside the preparation (`start_load`): the part waited for what was left of it
    assert 0 < fc["load_build_s"] + fc["load_copy_s"] <= fc["load_run_s"] + 0.02  # the own loader's two parts
    assert fc["load_s"] <= fc["load_run_s"] + 0.02
    assert fc["gate_s"] == pytest.approx(report["validation"]["seconds"], abs=0.5)
    assert 0 < report["forward_s"] < report["extract_seconds"]
    digests = json.loads((clean_ws / ".eaglenest" / "digests.json").read_text())
    assert any("model.safetensors|" in k for k in digests)  # the next part reads no weight to check them
    cols = ("id", "key", "start", "length", "digest")
    assert [tuple(r[c] for c in cols) for r in resumed.index] == [tuple(r[c] for c in cols) for r in clean.index]
    assert not list((ws / ".eaglenest" / "work").iterdir()), "work dir is cleaned after success"


def test_write_failure_is_clear_and_keeps_committed_pieces(smollm2, tmp_path):
    """A file-size limit stands in for a full disk: clear error, non-zero exit, pieces kept."""
    seqs = random_samples(6, 20000, 90, 128, seed=5)
    ws = _workspace(tmp_path / "a", smollm2, seqs)
    # RLIMIT_FSIZE below one shard: the first shard write fails with EFBIG
    code = (
        "import resource, runpy, sys, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN);"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000));"
        "sys.argv=['x','p','--no-progress']; runpy.run_module('stages.extract', run_name='__main__')"
    )
    p = run_py(["-c", code], cwd=ws, check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "writing piece" in p.stderr and "File too large" in p.stderr
    assert not (ws / "data" / "hidden" / "p").exists()
    run_py(["-m", "stages.extract", "p", "--no-progress"], cwd=ws)  # limit lifted: completes
    assert verify_store(ws / "data" / "hidden" / "p", progress=False) == []


def extract_small(tiny_target, tok, out_dir, work_root, backend=None, **kw):
    """One part of the tiny target in many small pieces (64-token batches, 0.05 MB shards), gate on 2."""
    taps = resolve_taps("auto", tiny_target.num_layers)
    return extract_part(part="p", tokenized=tok, target=tiny_target, taps=taps, dtype="bfloat16", revision=0,
                        backend=backend or HFBackend(tiny_target, taps, device="cpu"), batch_tokens=64,
                        max_seq_len=64, layout_cfg=dict(chunk_mb=0.01, shard_mb=0.05, codec="zstd", level=1),
                        validate_cfg=gate(2), out_dir=out_dir, work_root=work_root, progress=False, **kw)  # fmt: skip


def test_one_part_over_three_worker_processes_gives_the_one_process_store(tiny_target, tmp_path):
    """extract.devices: windows of pieces dealt round-robin to worker processes (here 3 on the CPU, as
    3 GPUs would be), the gate once: the same keys, digests and shard bytes as one process. A worker
    that fails is named, and the pieces committed so far are kept for the resume."""
    taps = resolve_taps("auto", tiny_target.num_layers)
    tok = write_tokenized(tmp_path / "tok.parquet", random_samples(40, 500, 10, 60, seed=3))
    spec = ("hf", {"taps": taps, "dtype": "bfloat16"})

    def run(name, work="work", **kw):
        return extract_small(tiny_target, tok, tmp_path / name, tmp_path / work / name, **kw)

    one = run("one")
    three = run("three", devices=["cpu"] * 3, backend_spec=spec)
    assert one["devices"] == 1 and three["devices"] == 3 and one["pieces"] >= 6
    assert 3 <= one["windows"] < one["pieces"]  # a worker each; batches span the pieces of a window
    a, b = HiddenStore(tmp_path / "one"), HiddenStore(tmp_path / "three")
    assert a.index == b.index
    files = sorted(p.relative_to(a.path) for p in a.path.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b.path) for p in b.path.rglob("*") if p.is_file())
    for f in files:
        assert (a.path / f).read_bytes() == (b.path / f).read_bytes(), f

    tracebacks = lambda: set(Path(tempfile.gettempdir()).glob("pytorch-errorfile-*"))  # noqa: E731
    before = tracebacks()
    with pytest.raises(EaglenestError, match="worker 1 on cuda:7 failed") as e:
        run("broken", devices=["cpu", "cuda:7"], backend_spec=spec)
    assert "rerun to resume" in str(e.value) and not (tmp_path / "broken").exists()
    assert tracebacks() == before  # the failed worker's traceback file does not outlive the failure
    resumed = run("broken")  # one process now: the pieces the failed run committed are kept
    assert 0 < resumed["pieces_resumed"] < resumed["pieces"] and HiddenStore(tmp_path / "broken").index == a.index


def test_pieces_by_length_fill_one_after_another_in_batches_with_little_padding():
    """An 8B target's 128 MB piece holds ~4k tokens. Pieces are packed from the samples longest first
    and batched over windows of consecutive pieces (every piece in exactly one window, in order), so
    batches reach batch_tokens, hold samples of about one length (little padding), and fill the
    pieces one after another: at most one piece is ever part-filled, and pieces complete in order
    (the writers work beside the loop instead of draining a window's pieces after it)."""
    from eaglenest.extraction.plan import WINDOW_BATCHES, length_batches, plan_pieces, plan_windows

    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(128, 2049, size=2400)]  # the 8B bench's samples
    pieces = plan_pieces(lengths, 4096)
    assert sorted(i for p in pieces for i in p.samples) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in p.samples) <= 4096 for p in pieces)
    assert all(p.offsets == tuple(np.cumsum([0] + [lengths[i] for i in p.samples])[:-1]) for p in pieces)
    piece_of = {i: p.index for p in pieces for i in p.samples}

    for bt in (4096, 16384, 65536):
        windows = plan_windows(pieces, lengths, bt)
        assert [p for w in windows for p in w] == pieces
        assert all(sum(lengths[i] for p in w for i in p.samples) >= WINDOW_BATCHES * bt for w in windows[:-1])
        batches = [b for w in windows for b in length_batches([i for p in w for i in p.samples], lengths, bt)]
        padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
        assert 1 - sum(lengths) / padded < 0.03, bt
        assert max(sum(lengths[i] for i in b) for b in batches) > (bt // 2 if bt > 4096 else 3000)
        left, open_, completed = {p.index: len(p.samples) for p in pieces}, set(), []
        for b in batches:
            for i in b:
                k = piece_of[i]
                left[k] -= 1
                open_.add(k)
                if left[k] == 0:
                    open_.discard(k)
                    completed.append(k)
            assert len(open_) <= 1, bt
        assert completed == sorted(completed) == [p.index for p in pieces]
    # a narrow target's piece (SmolLM2 bf16: ~29k tokens) fills most of a window at the CPU's 4096
    narrow = plan_pieces(lengths, 29 * 1024)
    assert len(plan_windows(narrow, lengths, 4096)) >= len(narrow) / 2


class FailsAfter(HFBackend):
    """Raises at its fourth batch, after some pieces are committed."""

    calls = 0

    def extract_async(self, batch):
        self.calls += 1
        if self.calls == 4:
            raise RuntimeError("injected failure")
        return super().extract_async(batch)


def test_a_work_dir_planned_another_way_is_never_resumed(tiny_target, tmp_path, monkeypatch):
    """The plan's name is part of the work key: pieces committed under another plan hold other samples
    under the same piece numbers, so a run under this plan starts its own work dir (and removes the
    stale one once it publishes) instead of resuming them."""
    import eaglenest.extraction.loop as loop

    taps = resolve_taps("auto", tiny_target.num_layers)
    tok = write_tokenized(tmp_path / "tok.parquet", random_samples(40, 500, 10, 60, seed=8))

    def run(backend, name="out"):
        return extract_small(tiny_target, tok, tmp_path / name, tmp_path / f"work-{name}", backend, writers=1)

    with monkeypatch.context() as m:
        m.setattr(loop, "PLAN", "pieces-in-input-order")
        with pytest.raises(RuntimeError, match="injected failure"):
            run(FailsAfter(tiny_target, taps, device="cpu"))
    (stale,) = (tmp_path / "work-out").iterdir()
    assert list((stale / "pieces").glob("*.json")), "the failed run committed pieces"
    done = run(HFBackend(tiny_target, taps, device="cpu"))
    assert done["pieces_resumed"] == 0 and done["committed"] and not stale.exists()
    run(HFBackend(tiny_target, taps, device="cpu"), "clean")  # from nothing: the same store
    a, b = HiddenStore(tmp_path / "out"), HiddenStore(tmp_path / "clean")
    assert [(r["key"], r["digest"], r["start"]) for r in a.index] == [
        (r["key"], r["digest"], r["start"]) for r in b.index
    ]


def test_batch_tokens_auto_resolves_by_device_kind_and_rejects_junk():
    from eaglenest.extraction.plan import AUTO_BATCH_TOKENS, batch_tokens_for

    assert batch_tokens_for("auto", "cuda:1") == AUTO_BATCH_TOKENS["cuda"] > batch_tokens_for("auto", "cpu")
    assert batch_tokens_for(777, "cuda") == 777
    for bad in (0, -5, True, "16k", 4096.0):
        with pytest.raises(EaglenestError, match="extract.batch_tokens"):
            batch_tokens_for(bad, "cpu")


def test_extract_devices_resolve_to_one_worker_per_device():
    from eaglenest.extraction.devices import devices_for

    assert devices_for("auto", "cpu") == ["cpu"] and devices_for(1, "auto") == ["auto"]
    assert devices_for(3, "cpu") == ["cpu"] * 3  # several processes on the CPU: how tests stand in for GPUs
    with pytest.raises(EaglenestError, match="use device auto or cuda"):
        devices_for(2, "cuda:1")


def test_samples_longer_than_a_batch_run_alone_with_the_same_states(tiny_target, tmp_path):
    """extract.batch_tokens below a sample's length (4k-8k-token samples at 4k-token batches): the
    sample runs as a batch of its own, and the store holds what batches that hold it give (up to
    bf16 rounding: the CPU's GEMMs round by their shapes)."""
    from eaglenest.extraction.plan import length_batches
    from eaglenest.store.bf16 import from_bits

    lengths = [300, 40, 90, 20]
    assert length_batches(range(4), lengths, 64) == [[0], [2], [1], [3]]
    tok = write_tokenized(tmp_path / "t.parquet", random_samples(10, 500, 70, 120, seed=9))
    taps = resolve_taps("auto", tiny_target.num_layers)
    stores = []
    for name, batch in (("small", 64), ("large", 4096)):
        extract_part(part="p", tokenized=tok, target=tiny_target, taps=taps, dtype="bfloat16", revision=0,
                     backend=HFBackend(tiny_target, taps, device="cpu"), batch_tokens=batch, max_seq_len=128,
                     layout_cfg=dict(chunk_mb=0.01, shard_mb=0.05, codec="zstd", level=1), validate_cfg=gate(2),
                     out_dir=tmp_path / name, work_root=tmp_path / "work", progress=False)  # fmt: skip
        stores.append(HiddenStore(tmp_path / name))
    assert [(r["id"], r["length"]) for r in stores[0].index] == [(r["id"], r["length"]) for r in stores[1].index]
    for i in range(len(stores[0])):
        (ids_a, aux_a, fin_a), (ids_b, aux_b, fin_b) = stores[0].read(i), stores[1].read(i)
        assert (ids_a == ids_b).all()
        for a, b in ((aux_a, aux_b), (fin_a, fin_b)):
            assert cosine(from_bits(a), from_bits(b)).min() > 0.999
