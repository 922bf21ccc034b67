"""Validation gate (docs/design.md: Gate): recompute a seeded subset with an independent reference — float32,
eager attention, one sequence at a time, no padding — and compare per token and per tap.

Figures per tap: cosine (mean, min over tokens) and relative error ||s-r||/||r|| (mean, max).
Beside each, the same figures against the ADJACENT reference tap (j+1; for `final`, the pre-norm
state) so a reader sees the margin between precision noise and an off-by-one defect."""

import logging
import time

import numpy as np
import torch

from eaglenest.errors import EaglenestError
from eaglenest.target import Target, load_model

log = logging.getLogger(__name__)

THRESHOLDS = ("min_cosine_mean", "min_cosine_token", "max_rel_err_mean", "max_rel_err_token")  # params `validate`


class Reference:
    """The float32 reference model; a context manager that frees it on exit (an 8B target's copy is
    32 GB: a process that extracts several parts must not keep one per gate). `precompute` takes the
    gate's samples' states ahead of the comparison, after which `keep_head_only` frees all of the model
    but its lm_head (`reference_process`: the states are taken while the extraction compiles)."""

    def __init__(self, target: Target, taps: list[int], device: str = "cpu"):
        self.model = load_model(target, dtype="float32", device=device, attn="eager")
        self.decoder = self.model.get_decoder()
        self.head = self.model.get_output_embeddings()
        self.taps, self.device, self.L = list(taps), device, target.num_layers
        self._prenorm, self._hook = None, None
        self._done = {}  # the samples' token bytes -> their states, on the host (`precompute`)
        norm = getattr(self.decoder, "norm", None)
        if norm is not None:
            self._hook = norm.register_forward_pre_hook(lambda _m, args: setattr(self, "_prenorm", args[0]))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.keep_head_only()
        self.head = self._done = None

    def keep_head_only(self) -> None:
        if self._hook is not None:  # the hook holds self: a cycle only the cyclic GC would free
            self._hook.remove()
        self.model = self.decoder = self._prenorm = self._hook = None

    def precompute(self, samples: list[np.ndarray]) -> None:
        for ids in samples:
            key = np.asarray(ids, dtype=np.int64).tobytes()
            self._done[key] = {k: v.cpu() for k, v in self.states(ids).items()}

    @torch.inference_mode()
    def states(self, ids: np.ndarray) -> dict:
        """The reference's states for one sample, float32, on its device (compared there)."""
        done = self._done.get(np.asarray(ids, dtype=np.int64).tobytes())
        if done is not None:
            return {k: v.to(self.device) for k, v in done.items()}
        if self.decoder is None:
            raise EaglenestError(f"validation gate: no reference states for a sample of {len(ids)} tokens whose "
                                 "ids differ from every sample of the tokenized part it was chosen from")  # fmt: skip
        x = torch.from_numpy(np.asarray(ids, dtype=np.int64))[None].to(self.device)
        out = self.decoder(input_ids=x, output_hidden_states=True, use_cache=False)
        hs = out.hidden_states
        ref = {
            "aux": torch.stack([hs[j] for j in self.taps], 2)[0].float(),
            "aux_adjacent": torch.stack([hs[j + 1] for j in self.taps], 2)[0].float(),
            "final": out.last_hidden_state[0].float(),
        }
        if self._prenorm is not None:
            ref["final_adjacent"] = self._prenorm[0].float()
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


def summarize(cos: torch.Tensor, rel: torch.Tensor) -> dict:
    return {
        "cosine_mean": float(cos.mean()),
        "cosine_min": float(cos.min()),
        "rel_err_mean": float(rel.mean()),
        "rel_err_max": float(rel.max()),
    }


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

    metrics = {"samples": len(sample_ids), "tokens": tokens, "thresholds": th, "taps": {}, "margin": {}}
    metrics["seconds_by_step"] = {k: round(v, 2) for k, v in steps.items()}
    failures = []
    for name, (coss, rels) in acc.items():
        cos = torch.cat(coss)
        if name == "lm_head_logits":
            metrics["lm_head_logits_cosine"] = {"mean": float(cos.mean()), "min": float(cos.min())}
            continue
        s = summarize(cos, torch.cat(rels))
        if "_vs_" in name:
            metrics["margin"][name] = s
            continue
        metrics["taps"][name] = s
        checks = [
            ("cosine_mean", s["cosine_mean"] >= th["min_cosine_mean"], "min_cosine_mean"),
            ("cosine_min", s["cosine_min"] >= th["min_cosine_token"], "min_cosine_token"),
            ("rel_err_mean", s["rel_err_mean"] <= th["max_rel_err_mean"], "max_rel_err_mean"),
            ("rel_err_max", s["rel_err_max"] <= th["max_rel_err_token"], "max_rel_err_token"),
        ]
        failures += [f"{name}: {fig}={s[fig]:.4f} violates {t}={th[t]}" for fig, ok, t in checks if not ok]
    metrics["passed"] = not failures
    metrics["failures"] = failures
    return metrics, not failures
