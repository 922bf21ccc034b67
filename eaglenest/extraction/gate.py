"""Validation gate (docs/design.md: Gate): recompute a seeded subset with an independent reference — float32,
eager attention, one sequence at a time, no padding — and compare per token and per tap.

Figures per tap: cosine (mean, min over tokens) and relative error ||s-r||/||r|| (mean, max).
Beside each, the same figures against the ADJACENT reference tap (j+1; for `final`, the pre-norm
state) so a reader sees the margin between precision noise and an off-by-one defect."""

import logging
import time

import torch

from eaglenest.extraction.reference import Reference
from eaglenest.extraction.routing import is_moe
from eaglenest.runtime.errors import EaglenestError

log = logging.getLogger(__name__)

THRESHOLDS = ("min_cosine_mean", "min_cosine_token", "max_rel_err_mean", "max_rel_err_token")  # params `validate`
MOE_QUANTILE = 0.98  # per-token thresholds judge the 98th-percentile token of a mixture of experts


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


def thresholds_for(cfg: dict, target_config: dict) -> dict:
    """The gate's limits from params `validate` (its other keys left out), `token_quantile` resolved
    for the target and kept only below 1 (a dense target's figures stay as they were)."""
    th = {k: cfg[k] for k in THRESHOLDS if k in cfg}
    q = token_quantile(cfg, target_config)
    if q < 1:
        th["token_quantile"] = q
    return th


def token_quantile(cfg: dict, target_config: dict) -> float:
    """`validate.token_quantile`: auto is 1 (the worst token) for a dense target and MOE_QUANTILE for a
    mixture of experts: the reference replays a bf16 forward's experts (`replays_routing`), but the
    extraction's own forward (batched, or another engine's kernels) may still choose otherwise on a
    near-tie, and that token then differs (docs/design.md: Gate)."""
    q = cfg.get("token_quantile", "auto")
    if q == "auto":
        return MOE_QUANTILE if is_moe(target_config) else 1.0
    return float(q)


def replays_routing(cfg: dict, target_config: dict) -> bool:
    """`validate.routing`: replay (the float32 reference takes the experts a bf16 forward chose), own
    (it routes by itself), or auto: replay for a mixture of experts (docs/design.md: Gate)."""
    mode = cfg.get("routing", "auto")
    return is_moe(target_config) if mode == "auto" else mode == "replay"


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
