"""Validation gate (docs/design.md: Gate): recompute a seeded subset with an independent reference — float32,
eager attention, one sequence at a time, no padding — and compare per token and per tap.

Figures per tap: cosine (mean, min over tokens) and relative error ||s-r||/||r|| (mean, max).
Beside each, the same figures against the ADJACENT reference tap (j+1; for `final`, the pre-norm
state) so a reader sees the margin between precision noise and an off-by-one defect."""

import logging
import threading
import time

import numpy as np
import torch

from eaglenest.extraction.checkpoint_index import CheckpointIndex
from eaglenest.extraction.layer_stream import LayerStream, causal_lm_config
from eaglenest.files.sizes import size
from eaglenest.runtime import host_memory
from eaglenest.runtime.errors import EaglenestError
from eaglenest.target.directory import Target
from eaglenest.target.loading import load_model

log = logging.getLogger(__name__)

THRESHOLDS = ("min_cosine_mean", "min_cosine_token", "max_rel_err_mean", "max_rel_err_token")  # params `validate`
MOE_QUANTILE = 0.98  # per-token thresholds judge the 98th-percentile token of a mixture of experts
HEADROOM = 0.8  # of the budget for the whole model's weights: the rest for the samples' activations


def free_bytes(device: str) -> int:
    """Memory the reference may take now: the GPU's free memory, or the host's MemAvailable."""
    if device.startswith("cuda"):
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    if not host_memory.available():
        raise EaglenestError("validate.reference_memory_gb auto: /proc/meminfo has no MemAvailable; give a number")
    return host_memory.available()


def choose_streamed(target: Target, device: str, cfg: dict) -> tuple[bool, str]:
    """Whether the gate's reference streams its weights a layer at a time, and why (logged).
    `validate.reference`: whole, streamed, or auto (streamed when the whole float32 model does not fit
    HEADROOM of `validate.reference_memory_gb`, auto: the device's free memory when the part starts)."""
    mode, budget = cfg.get("reference", "auto"), cfg.get("reference_memory_gb", "auto")
    causal_lm_config(target.model_dir)  # an architecture transformers cannot build fails here, not after the work
    if mode == "whole":
        return False, "validate.reference: whole"
    try:
        index = CheckpointIndex(target.model_dir)
    except EaglenestError as e:
        if mode == "streamed" or "missing shard" in str(e):
            raise
        return False, f"whole model ({e})"
    free = free_bytes(device) if budget == "auto" else int(float(budget) * 1e9)
    whole, layer, rest = index.model_float32_bytes(), index.largest_layer_bytes(), index.float32_bytes(None)
    said = f"float32 model {size(whole)}, budget {size(free)} ({budget})"
    if mode == "auto" and whole <= HEADROOM * free:
        return False, f"whole model: {said}"
    if layer + rest > free:
        raise EaglenestError(
            f"validate.reference_memory_gb {budget}: {size(free)} hold less than one decoder layer's "
            f"float32 weights ({size(layer)}) and the weights outside the layers ({size(rest)})"
        )
    return True, f"streamed, one layer at a time (largest {size(layer)}): {said}"


class Reference:
    """The float32 reference model; a context manager that frees it on exit (an 8B target's copy is
    32 GB: a process that extracts several parts must not keep one per gate). `precompute` takes the
    gate's samples' states ahead of the comparison, after which `keep_head_only` frees all of the model
    but its lm_head (`reference_process`: the states are taken while the extraction compiles).
    `streamed`: the weights are read one decoder layer at a time (`layer_stream`), all samples
    running through each layer before the next is read; otherwise the whole model is loaded. Both run
    the same transformers modules and take the states by the same hooks: the same figures."""

    def __init__(self, target: Target, taps: list[int], device: str = "cpu", streamed: bool = False):
        self.stream = LayerStream(target.model_dir, device) if streamed else None
        self.model = self.stream.model if streamed else load_model(target, dtype="float32", device=device, attn="eager")
        self.decoder = self.model.get_decoder()
        self.head = self.model.get_output_embeddings()
        self.taps, self.device, self.L = list(taps), device, target.num_layers
        self._done = {}  # the samples' token bytes -> their states, on the host (`precompute`)
        self._local = threading.local()  # this thread's sample's captured states (the hooks write them)
        self._hooks = self._capture()

    def _capture(self) -> list:
        """Hooks that keep hidden_states[j] (the residual stream entering layer j; j = L is the final
        norm's output, as transformers reports it) for the taps and the layers after them, and the
        final norm's input (the pre-norm state)."""
        layers, keep, hooks = self.decoder.layers, {j for t in self.taps for j in (t, t + 1)}, []

        def put(name, x):
            self._local.states[name] = (x[0] if isinstance(x, tuple) else x)[0].float()

        if 0 in keep:
            hooks.append(layers[0].register_forward_pre_hook(
                lambda _m, args, kw: put(0, args[0] if args else kw["hidden_states"]), with_kwargs=True))  # fmt: skip
        for j in sorted(keep - {0, self.L}):
            hooks.append(layers[j - 1].register_forward_hook(lambda _m, _a, out, j=j: put(j, out)))
        norm = getattr(self.decoder, "norm", None)
        if norm is not None:
            hooks.append(norm.register_forward_pre_hook(lambda _m, args: put("prenorm", args)))
        return hooks

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.keep_head_only()
        self.head = self._done = None

    def keep_head_only(self) -> None:
        for h in self._hooks:  # a hook holds self: a cycle only the cyclic GC would free
            h.remove()
        self._hooks = []
        self.model = self.decoder = self.stream = None

    def memory(self) -> dict:
        """What the reference held, in bytes: the whole model in float32, or the streamed peak."""
        if self.stream is None:
            return {"mode": "whole", "model_bytes_fp32": sum(p.numel() * 4 for p in self.model.parameters())}
        index = self.stream.index
        return {"mode": "streamed", "model_bytes_fp32": index.model_float32_bytes(),
                "layer_bytes": index.largest_layer_bytes(), "peak_bytes": self.stream.peak_bytes,
                "peak_layers": self.stream.peak_layers, "read_bytes": self.stream.read_bytes,
                "read_s": round(self.stream.read_s, 2)}  # fmt: skip

    def precompute(self, samples: list[np.ndarray]) -> None:
        todo = [np.asarray(ids, dtype=np.int64) for ids in samples]
        todo = [ids for ids in todo if ids.tobytes() not in self._done]
        if self.stream is not None:
            done = self.stream.run(self._forward, todo)
        else:
            done = [self._forward(ids) for ids in todo]
        for ids, states in zip(todo, done):
            self._done[ids.tobytes()] = {k: v.cpu() for k, v in states.items()}

    @torch.inference_mode()
    def states(self, ids: np.ndarray) -> dict:
        """The reference's states for one sample, float32, on its device (compared there)."""
        done = self._done.get(np.asarray(ids, dtype=np.int64).tobytes())
        if done is not None:
            return {k: v.to(self.device) for k, v in done.items()}
        if self.decoder is None:
            raise EaglenestError(f"validation gate: no reference states for a sample of {len(ids)} tokens whose "
                                 "ids differ from every sample of the tokenized part it was chosen from")  # fmt: skip
        if self.stream is not None:  # one sample alone reads every layer: precompute them together
            self.precompute([ids])
            return self.states(ids)
        return self._forward(ids)

    @torch.inference_mode()
    def _forward(self, ids) -> dict:
        self._local.states = got = {}
        x = torch.from_numpy(np.asarray(ids, dtype=np.int64))[None].to(self.device)
        got[self.L] = self.decoder(input_ids=x, use_cache=False).last_hidden_state[0].float()
        ref = {
            "aux": torch.stack([got[j] for j in self.taps], 1),
            "aux_adjacent": torch.stack([got[j + 1] for j in self.taps], 1),
            "final": got[self.L],
        }
        if "prenorm" in got:
            ref["final_adjacent"] = got["prenorm"]
        return ref

    @torch.inference_mode()
    def lm_head_cosine(self, final: torch.Tensor, ref_final: torch.Tensor) -> torch.Tensor:
        """Per-token cosine between lm_head(stored final) and lm_head(reference final): the logits the
        model computes from its last hidden state, without a second forward (informational)."""
        mine = self.head(final.to(self.device)).float()
        theirs = self.head(ref_final.to(self.device)).float()
        return torch.nn.functional.cosine_similarity(mine, theirs, dim=-1)


def token_stats(stored: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cosine and relative error; inputs [n, H] float32."""
    cos = torch.nn.functional.cosine_similarity(stored, ref, dim=-1)
    rel = (stored - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)
    return cos, rel


def summarize(cos: torch.Tensor, rel: torch.Tensor, quantile: float = 1.0) -> dict:
    """Mean and worst token; below quantile 1, also the token at that quantile (`cosine_q`: the
    (1 - q) quantile of cosine, `rel_err_q`: the q quantile of relative error), which the per-token
    thresholds then judge, and how many tokens lie beyond it."""
    s = {
        "cosine_mean": float(cos.mean()),
        "cosine_min": float(cos.min()),
        "rel_err_mean": float(rel.mean()),
        "rel_err_max": float(rel.max()),
    }
    if quantile < 1:
        s["cosine_q"] = float(torch.quantile(cos.double(), 1 - quantile))
        s["rel_err_q"] = float(torch.quantile(rel.double(), quantile))
    return s


def is_moe(cfg: dict) -> bool:
    """A mixture-of-experts config.json (routed experts under any of transformers' names)."""
    cfg = cfg.get("text_config", cfg)
    return any(
        (cfg.get(k) or 0) > 1 for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    )


def thresholds_for(cfg: dict, target_config: dict) -> dict:
    """The gate's limits from params `validate` (its other keys left out), `token_quantile` resolved
    for the target and kept only below 1 (a dense target's figures stay as they were)."""
    th = {k: cfg[k] for k in THRESHOLDS if k in cfg}
    q = token_quantile(cfg, target_config)
    if q < 1:
        th["token_quantile"] = q
    return th


def token_quantile(cfg: dict, target_config: dict) -> float:
    """`validate.token_quantile`: auto is 1 (the worst token) for a dense target and MOE_QUANTILE for
    a mixture of experts, where a near-tie in a router sends a few percent of tokens to other experts
    in bf16 than in float32 (docs/design.md: Gate)."""
    q = cfg.get("token_quantile", "auto")
    if q == "auto":
        return MOE_QUANTILE if is_moe(target_config) else 1.0
    return float(q)


def run_gate(read_sample, sample_ids: list, ref: Reference, thresholds: dict) -> tuple[dict, bool]:
    """read_sample(i) -> (ids, aux bf16 [n,3,H], final bf16 [n,H]). Returns (metrics, passed). The
    stored states go to the reference's device and are compared there (on a GPU: no float32 copies
    of the reference's states back to the host); `seconds_by_step` says where the gate's time went."""
    missing = [k for k in THRESHOLDS if k not in (thresholds or {})]
    if missing:
        raise EaglenestError(f"validation gate: thresholds {missing} not given (params.yaml `validate`)")
    th = thresholds
    acc: dict[str, list] = {}

    def add(name, cos, rel):
        acc.setdefault(name, [[], []])
        acc[name][0].append(cos)
        acc[name][1].append(rel)

    tokens, steps = 0, dict.fromkeys(("read_s", "reference_s", "compare_s"), 0.0)
    sync = torch.cuda.synchronize if str(ref.device).startswith("cuda") else lambda: None
    for i in sample_ids:
        t = time.perf_counter()
        ids, aux, final = read_sample(i)
        aux, final = aux.to(ref.device).float(), final.to(ref.device).float()
        t1 = time.perf_counter()
        r = ref.states(ids)
        sync()
        t2 = time.perf_counter()
        steps["read_s"] += t1 - t
        steps["reference_s"] += t2 - t1
        tokens += len(ids)
        for k, tap in enumerate(ref.taps):
            add(f"aux_{tap}", *token_stats(aux[:, k], r["aux"][:, k]))
            add(f"aux_{tap}_vs_adjacent_{tap + 1}", *token_stats(aux[:, k], r["aux_adjacent"][:, k]))
        add("final", *token_stats(final, r["final"]))
        if "final_adjacent" in r:
            add("final_vs_prenorm", *token_stats(final, r["final_adjacent"]))
        acc.setdefault("lm_head_logits", [[], []])[0].append(ref.lm_head_cosine(final, r["final"]))
        sync()
        steps["compare_s"] += time.perf_counter() - t2

    q = float(th.get("token_quantile", 1.0))
    metrics = {"samples": len(sample_ids), "tokens": tokens, "thresholds": th, "taps": {}, "margin": {}}
    metrics["seconds_by_step"] = {k: round(v, 2) for k, v in steps.items()}
    failures = []
    for name, (coss, rels) in acc.items():
        cos = torch.cat(coss)
        if name == "lm_head_logits":
            metrics["lm_head_logits_cosine"] = {"mean": float(cos.mean()), "min": float(cos.min())}
            continue
        rel = torch.cat(rels)
        s = summarize(cos, rel, q)
        if q < 1:  # how many tokens the quantile lets past the per-token limits
            beyond = (cos < th["min_cosine_token"]) | (rel > th["max_rel_err_token"])
            s["tokens_beyond"] = int(beyond.sum())
        if "_vs_" in name:
            metrics["margin"][name] = s
            continue
        metrics["taps"][name] = s
        worst_cos, worst_rel = ("cosine_q", "rel_err_q") if q < 1 else ("cosine_min", "rel_err_max")
        checks = [
            ("cosine_mean", s["cosine_mean"] >= th["min_cosine_mean"], "min_cosine_mean"),
            (worst_cos, s[worst_cos] >= th["min_cosine_token"], "min_cosine_token"),
            ("rel_err_mean", s["rel_err_mean"] <= th["max_rel_err_mean"], "max_rel_err_mean"),
            (worst_rel, s[worst_rel] <= th["max_rel_err_token"], "max_rel_err_token"),
        ]
        failures += [f"{name}: {fig}={s[fig]:.4f} violates {t}={th[t]}" for fig, ok, t in checks if not ok]
    metrics["passed"] = not failures
    metrics["failures"] = failures
    return metrics, not failures
