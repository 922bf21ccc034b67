"""Acceptance figures from per-step training statistics (docs/design.md: Evaluate)."""

import torch


def simulated_acceptance(acc: list[float]) -> float:
    """tau = 1 + sum_k prod_{i<=k} acc_i (includes the bonus token; no speculation = 1.0)."""
    tau, p = 1.0, 1.0
    for a in acc:
        p *= a
        tau += p
    return tau


def summarize(stats: torch.Tensor) -> dict:
    """stats [K, 3] = per-step sums of (CE, correct, mask)."""
    s = stats.detach().cpu().double()
    acc = [float(s[k, 1] / max(1.0, s[k, 2])) for k in range(len(s))]
    ce = [float(s[k, 0] / max(1.0, s[k, 2])) for k in range(len(s))]
    return {
        "loss": ce[0],
        "ce_per_step": ce,
        "acc_per_step": acc,
        "simulated_tau": simulated_acceptance(acc),
        "tokens": int(s[0, 2]),
    }
