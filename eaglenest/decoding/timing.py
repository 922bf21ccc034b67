"""Batch-1 decoding time of plain greedy decoding and of each speculative mode over the same prompts,
and the speed figures evaluate reports from it."""

import time

from eaglenest.decoding.modes import depth, mode_key, spec_decode
from eaglenest.decoding.speculative import Decoded, TargetRunner, greedy_decode
from eaglenest.decoding.tree import TreeShape


class Clock:
    """Batch-1 decoding time per mode (None = plain greedy, else k or a tree), and the speed figures: tokens/s,
    the speedup, and why. Past the prompt's forward, plain decoding costs one target step a token, and
    speculative decoding one round per verification: k draft steps, then one target forward of k + 1
    tokens (a tree: its depth in draft steps, one forward of its nodes). A round yields tau tokens on
    average, so it pays off from tau = round / target step (the break-even tau; speedup ~ tau /
    break-even tau, up to the prompt's forward and the last round)."""

    def __init__(self, modes: list):
        self.modes = list(modes)
        every = [None, *modes]
        self.tokens, self.seconds, self.prefill = dict.fromkeys(every, 0), dict.fromkeys(every, 0.0), {}
        self.prompts = dict.fromkeys(every, 0)
        self.draft_seconds, self.rounds = dict.fromkeys(modes, 0.0), dict.fromkeys(modes, 0)

    def add(self, k: int | None, d: Decoded, seconds: float | None = None) -> None:
        self.tokens[k] += len(d.tokens)
        self.seconds[k] += d.seconds if seconds is None else seconds
        self.prefill[k] = self.prefill.get(k, 0.0) + d.prefill_seconds
        self.prompts[k] += 1
        if k is not None:
            self.draft_seconds[k] += d.draft_seconds
            self.rounds[k] += len(d.accepted)

    def figures(self, tau: dict) -> dict:
        steps = self.tokens[None] - self.prompts[None]  # the first token comes from the prompt's forward
        if steps <= 0:
            return {}
        step = (self.seconds[None] - self.prefill[None]) / steps
        out = {
            "tokens_per_s_plain": round(self.tokens[None] / self.seconds[None], 2),
            "target_step_ms": round(1000 * step, 2),
            "prefill_ms": round(1000 * self.prefill[None] / self.prompts[None], 2),
            "k": {},
            "tree": {},
        }
        for k in self.modes:
            if not self.rounds[k]:
                continue
            rnd = (self.seconds[k] - self.prefill[k]) / self.rounds[k]
            drafting = self.draft_seconds[k] / self.rounds[k]
            out["tree" if isinstance(k, TreeShape) else "k"][mode_key(k)] = {
                "tokens_per_s": round(self.tokens[k] / self.seconds[k], 2),
                "speedup": round(self.tokens[k] / self.seconds[k] * self.seconds[None] / self.tokens[None], 3),
                "tau": round(tau.get(mode_key(k), float("nan")), 4),
                "round_ms": round(1000 * rnd, 2),
                "draft_step_ms": round(1000 * drafting / depth(k), 2),
                "verify_ms": round(1000 * (rnd - drafting), 2),
                "break_even_tau": round(rnd / step, 3),
            }
        if out["k"]:  # the fastest chain and tree on this hardware: what to serve with (README)
            out["best_k"] = int(max(out["k"], key=lambda k: out["k"][k]["speedup"]))
        if out["tree"]:
            out["best_tree"] = max(out["tree"], key=lambda t: out["tree"][t]["speedup"])
        return out


def decode_speed(
    model, taps, drafter, embed, prompts: list[list[int]], max_new_tokens: int, eos: set, modes: list
) -> Clock:
    """Batch-1 plain greedy and speculative decoding (per k) over the same prompts, the modes
    interleaved question by question: batch-1 decoding is launch-bound, so the host's state (clocks,
    other processes) moves it, and interleaving puts any drift on every mode alike."""
    runner = TargetRunner(model, taps)
    if prompts:  # warm-up: first calls pay allocator and kernel selection
        greedy_decode(runner, prompts[0], 4, eos)
        for m in modes:
            spec_decode(runner, drafter, embed, prompts[0], 4, eos, m)
    clock = Clock(modes)
    for x in prompts:
        for m in [None, *modes]:
            t0 = time.perf_counter()
            d = (
                greedy_decode(runner, x, max_new_tokens, eos)
                if m is None
                else spec_decode(runner, drafter, embed, x, max_new_tokens, eos, m)
            )
            clock.add(m, d, time.perf_counter() - t0)
    return clock
