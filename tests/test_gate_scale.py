"""The gate at scale (docs/design.md: Gate): a reference that streams the weights one decoder layer at
a time gives the whole-model reference's figures; mixture-of-experts targets (MLA and shared
experts too) pass with honest states and fail each defect; what the reference cannot work with
fails the part before anything is written."""

import contextlib
import dataclasses
import shutil

import numpy as np
import pytest

from eaglenest.extraction.backends.hf import HFBackend
from eaglenest.extraction.checkpoint_index import CheckpointIndex
from eaglenest.extraction.loop import GateFailed, extract_part
from eaglenest.extraction.plan import plan_pieces, plan_windows, window_batches
from eaglenest.extraction.reference import Reference
from eaglenest.extraction.reference_process import LocalReference, choose
from eaglenest.runtime.errors import EaglenestError
from eaglenest.store.hidden_store import HiddenStore
from eaglenest.target.directory import materialize
from eaglenest.target.random_weights import build

from .conftest import gate, random_samples, write_tokenized
from .defects import DroppedFirstPosition, OffByOneTap, OtherSeed, PrefixOutOfContext, PreNormFinal

TAPS = [1, 3, 4]  # of the 6-layer random targets


@pytest.fixture(scope="session")
def random_targets(smollm2, tmp_path_factory):
    """Random 6-layer targets with the built-in tokenizer, sharded safetensors with an index; a
    second DeepSeek-V3 of another seed for 'another model's states'."""
    root = tmp_path_factory.mktemp("random-targets")
    made = {}
    for arch, seed in (("qwen3-moe", 0), ("qwen3-moe", 1), ("deepseek-v3", 0), ("deepseek-v3", 1), ("mixtral", 0),
                       ("llama", 0), ("deepseek-v3-wide", 0), ("deepseek-v3-wide", 1)):  # fmt: skip
        name = f"{arch}-{seed}"
        base, over = (arch, None) if arch != "deepseek-v3-wide" else ("deepseek-v3", WIDE)
        build(base, root / name / "model", smollm2.model_dir, seed=seed, overrides=over)
        made[name] = materialize(str(root / name / "model"), root / name / "target")
    return made


# Another DeepSeek-V3 shape than random_weights' (the one a user first tried): hidden 256, one group,
# larger q and kv LoRA; its honest states failed the gate when the reference routed by itself.
WIDE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "n_group": 1,
    "topk_group": 1,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
}


def extract(target, tmp_path, backend=None, validate=None, samples=None, name="p", batch_tokens=512):
    seqs = samples or random_samples(12, min(20000, target.vocab_size), 40, 120, seed=5)
    tok = write_tokenized(tmp_path / f"{name}.parquet", seqs)
    return extract_part(
        part=name,
        tokenized=tok,
        target=target,
        backend=backend or HFBackend(target, TAPS, device="cpu"),
        taps=TAPS,
        dtype="bfloat16",
        revision=0,
        layout_cfg=dict(chunk_mb=0.05, shard_mb=0.5, codec="zstd", level=1),
        validate_cfg={**gate(6), **(validate or {})},
        out_dir=tmp_path / "hidden" / name,
        work_root=tmp_path / "work",
        batch_tokens=batch_tokens,
        max_seq_len=128,
        progress=False,
    )


@pytest.mark.parametrize("arch", ["tiny", "deepseek-v3-0"])
def test_the_streamed_reference_gives_the_whole_models_figures_one_layer_at_a_time(
    random_targets, tiny_target, arch, tmp_path
):
    """A dense Llama with tied embeddings in one file; an MLA/MoE target in shards with an index."""
    target = tiny_target if arch == "tiny" else random_targets[arch]
    extract(target, tmp_path)
    store = tmp_path / "hidden" / "p"
    chosen = choose(12, 6, 0)
    figures = {}
    for streamed in (False, True):
        ref = LocalReference(target, TAPS, "cpu", tmp_path / "p.parquet", chosen, streamed, replay=arch != "tiny")
        figures[streamed], passed = ref.compare(store, {**gate(6), "token_quantile": 0.99})
        assert passed
    whole, streamed = figures[False], figures[True]
    for key in ("taps", "margin", "lm_head_logits_cosine", "tokens"):
        assert whole[key] == streamed[key], key  # bit for bit: the same modules, the same order of sums
    assert whole["reference"].get("routing") == streamed["reference"].get("routing")  # the same experts replayed
    memory = streamed["reference"]
    index = CheckpointIndex(target.model_dir)
    assert memory["mode"] == "streamed" and whole["reference"]["mode"] == "whole"
    assert memory["peak_layers"] == 1, "more than one decoder layer's weights were resident at once"
    assert memory["peak_bytes"] <= index.largest_layer_bytes() + index.float32_bytes(None)
    if arch != "tiny":  # untied: the embedding (before the first layer) and the lm_head (after the last) never meet
        assert memory["peak_bytes"] < index.float32_bytes(None)
    assert memory["model_bytes_fp32"] == index.model_float32_bytes()  # the checkpoint's tensors, buffers too


def test_streamed_reference_samples_run_alone_and_an_error_in_one_stops_all(random_targets):
    """Samples of different lengths meet at every layer yet each runs unpadded (its states equal those
    of a run of its own); a sample that fails mid-model (an id outside the vocabulary) stops the
    others instead of leaving them waiting at the next layer."""
    target = random_targets["qwen3-moe-0"]
    a, b = np.arange(3, 40), np.arange(100, 117)
    together = Reference(target, TAPS, streamed=True)
    together.precompute([a, b])
    alone = Reference(target, TAPS, streamed=True)
    alone.precompute([b])
    assert all((together.states(b)[k] == alone.states(b)[k]).all() for k in ("aux", "final"))
    with pytest.raises(IndexError):
        Reference(target, TAPS, streamed=True).precompute([a, np.array([3, 10**7])])


MOE = ["qwen3-moe-0", "qwen3-moe-1", "deepseek-v3-0", "deepseek-v3-1", "mixtral-0", "deepseek-v3-wide-0"]


@pytest.mark.parametrize("arch", MOE)
def test_the_reference_computes_the_bf16_forward_exactly_and_replays_its_experts(random_targets, arch):
    """Routing's two passes (docs/design.md: Gate): the float32 model computing as bf16 gives the states
    and experts of the target loaded in bf16, bit for bit; replaying a router's own experts gives its
    own weights."""
    import torch

    from eaglenest.extraction.routing import Routing, bf16_like_extraction, routers, weights_for
    from eaglenest.target.loading import load_model

    target = random_targets[arch]
    ids = random_samples(1, min(20000, target.vocab_size), 90, 90, seed=3)[0]
    x = torch.from_numpy(ids.astype(np.int64))[None]
    got = {}
    for name, dtype, attn, emulate in (("bf16", "bfloat16", "sdpa", False), ("fp32", "float32", "eager", True)):
        model, routing = load_model(target, dtype=dtype, attn=attn), Routing()
        with torch.inference_mode(), routing.recording(model), routing.as_sample(ids):
            with bf16_like_extraction(model) if emulate else contextlib.nullcontext():
                out = model.get_decoder()(input_ids=x, use_cache=False, output_hidden_states=True)
        got[name] = (out.hidden_states, routing.chosen[ids.astype(np.int64).tobytes()], model)
        assert all(p.dtype == torch.float32 for p in model.parameters()) == emulate  # put back after
    assert len(got["bf16"][1]) == len(routers(got["bf16"][2])) > 0
    assert all(torch.equal(a, b) for a, b in zip(got["bf16"][0], got["fp32"][0]))
    assert all(torch.equal(a, b) for a, b in zip(got["bf16"][1], got["fp32"][1]))
    for router in routers(got["fp32"][2]):
        h = torch.randn(17, target.hidden_size)
        logits, weights, chosen = router(h)
        assert torch.equal(weights_for(router, logits, chosen), weights)


@pytest.mark.parametrize("arch", MOE)
def test_moe_gate_passes_honest_states_at_the_worst_token(random_targets, arch, tmp_path):
    """With the bf16 forward's experts replayed, honest states of any of these shapes and seeds meet the
    dense limits at their worst token; the tokens whose float32 router would choose otherwise, given
    the same inputs, are few and nearer a tie than the typical token."""
    v = extract(random_targets[arch], tmp_path, validate={"token_quantile": 1})["validation"]
    assert v["passed"], v["failures"]
    routing = v["reference"]["routing"]
    assert routing["chosen_by"] == {
        "extraction": 6,
        "reference_bf16": 0,
        "unfit": 0,
    }  # the batched forward's own experts
    assert routing["routers"] == 5 + arch.startswith(("qwen3", "mixtral")) and routing["flip_fraction"] < 0.05
    flipped = routing["flipped_margin_bf16_ulps"]["median"]  # near-ties: closer than the typical token's
    assert flipped is None or flipped < routing["margin_bf16_ulps_median_all_tokens"]


@pytest.mark.parametrize("arch", ["qwen3-moe-0", "deepseek-v3-wide-0"])
def test_moe_gate_fails_each_defect(random_targets, arch, tmp_path):
    """Every defect fails under the MoE defaults (routing replayed, the 98th-percentile token), with
    nothing committed; and the reference routing by itself fails the wide target's honest states, as
    it did before."""
    target = random_targets[arch]
    other = random_targets["deepseek-v3-wide-1" if "wide" in arch else "deepseek-v3-1"]
    defects = {
        "off-by-one tap": OffByOneTap(target, TAPS, device="cpu"),
        "shifted positions": DroppedFirstPosition(target, TAPS, device="cpu"),
        "states from a cached prefix": PrefixOutOfContext(target, TAPS, device="cpu"),
        "the final norm skipped": PreNormFinal(target, TAPS, device="cpu"),
        "another model's states": HFBackend(other, TAPS, device="cpu"),
        "another seed's weights in memory": OtherSeed(target, TAPS, device="cpu"),
    }
    for what, backend in defects.items():
        with pytest.raises(GateFailed) as e:
            extract(target, tmp_path / what.replace(" ", "-"), backend=backend)
        assert not (tmp_path / what.replace(" ", "-") / "hidden" / "p").exists(), what
        v = e.value.metrics["validation"]
        assert not v["passed"] and v["thresholds"]["token_quantile"] == 0.98 and "routing" in v["reference"], what
        other_arch = what == "another model's states" and "wide" not in arch  # its experts fit no router here
        assert v["reference"]["routing"]["chosen_by"]["unfit"] == (6 if other_arch else 0), what
    if "wide" in arch:
        with pytest.raises(GateFailed):
            extract(target, tmp_path / "own", validate={"routing": "own"})


def test_a_dense_target_keeps_the_worst_token(random_targets, tmp_path):
    v = extract(random_targets["llama-0"], tmp_path)["validation"]
    assert "token_quantile" not in v["thresholds"] and "cosine_q" not in v["taps"]["final"]


def test_what_the_reference_cannot_use_fails_before_anything_is_written(random_targets, tmp_path):
    target = random_targets["deepseek-v3-0"]

    def fails(t, match, **validate):
        with pytest.raises(EaglenestError, match=match):
            extract(t, tmp_path, validate=validate)
        assert not (tmp_path / "hidden").exists() and not [p.name for p in (tmp_path / "work").glob("*")]

    broken = tmp_path / "broken"
    shutil.copytree(target.model_dir, broken)
    (broken / "model-00002-of-00003.safetensors").unlink()
    fails(dataclasses.replace(target, model_dir=broken), r"model-00002-of-00003.safetensors: missing shard")
    fails(target, r"reference_memory_gb 0.0001: 100 kB hold less than one decoder layer's float32 weights "
          r"\(26\d kB\) and the weights outside the layers \(2\d.\d MB\)", reference_memory_gb=1e-4)  # fmt: skip
    bins = tmp_path / "bins"
    shutil.copytree(target.model_dir, bins)
    for f in bins.glob("*.safetensors*"):
        f.unlink()
    (bins / "pytorch_model.bin").write_bytes(b"")
    fails(dataclasses.replace(target, model_dir=bins), r"bins: no \*.safetensors", reference="streamed")
    alien = tmp_path / "alien"
    shutil.copytree(target.model_dir, alien)
    config = (alien / "config.json").read_text().replace('"deepseek_v3"', '"nonesuch_moe"')
    (alien / "config.json").write_text(config)
    fails(dataclasses.replace(target, model_dir=alien), r"cannot build architecture 'nonesuch_moe'")


def test_the_reference_takes_its_states_while_the_part_runs(random_targets, tmp_path):
    """On a GPU the gate's reference runs in a process of its own. A mixture of experts' extraction runs
    the windows holding the gate's samples first and hands their experts over once all are kept, so the
    reference takes its states beside the rest of the part: the same figures as a comparison given
    the experts at the end, and the part's own (in the stage's process, as on the CPU)."""
    from eaglenest.extraction.reference_process import ReferenceProcess

    class Watched(HFBackend):  # notes when the experts were handed over
        def watch_routing(self, samples, then=None):
            def kept(chosen):
                self.kept_after = (self.capture.forwards, dict(chosen))
                then(chosen)

            return super().watch_routing(samples, then=kept)

    target = random_targets["deepseek-v3-0"]
    seqs = random_samples(60, min(20000, target.vocab_size), 20, 50, seed=5)
    backend = Watched(target, TAPS, device="cpu")
    m = extract(target, tmp_path, backend=backend, validate={"samples": 2}, samples=seqs, batch_tokens=64)
    forwards, chosen = backend.kept_after
    # the planned windows (`plan`): all kept within those holding a gate sample, run before the rest
    lengths, gate_set = [len(x) for x in seqs], set(choose(len(seqs), 2, 0))
    shard_tokens = HiddenStore(tmp_path / "hidden" / "p").attrs["layout"]["shard_tokens"]
    windows = plan_windows(plan_pieces(lengths, shard_tokens), lengths, 64)
    holding = [any(i in gate_set for p in w for i in p.samples) for w in windows]
    batches = [len(window_batches(w, lengths, 64)) for w in windows]
    assert sum(holding) < len(windows) and not holding[0], "the test needs a window to skip ahead of"
    ahead = [b for b, h in zip(batches, holding) if h]  # the batches run first, in the windows' order
    assert sum(ahead[:-1]) < forwards <= sum(ahead) < backend.capture.forwards == sum(batches)
    assert m["validation"]["passed"] and len(chosen) == 2
    figures = {}
    for ahead in (True, False):
        ref = ReferenceProcess(target, TAPS, "cpu", tmp_path / "p.parquet", choose(len(seqs), 2, 0), replay=True,
                               captured=True)  # fmt: skip
        try:
            if ahead:
                ref.take_routing(chosen)
            figures[ahead], passed = ref.compare(tmp_path / "hidden" / "p", {**gate(2), "token_quantile": 0.98},
                                                 None if ahead else chosen)  # fmt: skip
        finally:
            ref.close()
        assert passed and figures[ahead]["reference"]["routing"]["chosen_by"]["extraction"] == 2
    assert figures[True]["reference_states_s"] > 0 and "reference_states_s" not in figures[False]
    for key in ("taps", "margin"):
        assert figures[True][key] == figures[False][key] == m["validation"][key], key


def test_the_target_stage_builds_a_random_target_from_its_spec(tmp_path):
    """`target.path: random:<arch>[:<width>]`: drawn with seed 0 and the built-in target's tokenizer, the
    same fingerprint each time; v2-lite is the real-width shape measured in bench/RESULTS.md (15.75B
    parameters); an unknown architecture or width is named."""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from eaglenest.target.random_weights import parse_spec

    a, b = (materialize("random:deepseek-v3", tmp_path / name) for name in ("a", "b"))
    assert a.fingerprint == b.fingerprint and a.num_layers == 6 and a.model_dir == tmp_path / "a" / "model"
    assert (a.model_dir / "tokenizer_config.json").is_file() and a.spec == "random:deepseek-v3"
    arch, shape = parse_spec("random:deepseek-v3:v2-lite")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(DeepseekV3Config(**shape))
    assert arch == "deepseek-v3" and sum(p.numel() for p in model.parameters()) == 15_748_993_024
    widths = r"no width 'v2-lite' for llama \(known: random:deepseek-v3:v2-lite\)"
    for spec, match in (("random:nonesuch", "architecture 'nonesuch' is not one of"), ("random:llama:v2-lite", widths)):
        with pytest.raises(EaglenestError, match=match):
            materialize(spec, tmp_path / "c")
