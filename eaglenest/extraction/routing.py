"""Expert routing for the gate of a mixture-of-experts target (docs/design.md: Gate, "Mixtures of
experts"). In bf16 a router sends some tokens to other experts than in float32, and from that layer
on the two compute different functions: at real width nearly every token differs somewhere. So the
float32 reference replays the experts a bf16 forward chose, and checks everything but the routing
against the same function; the routing is reported on its own.

- `bf16_like_extraction`: the float32 model computing as transformers' bf16 model does (weights,
  activations, SDPA attention; the modules transformers keeps in float32 stay so), one decoder
  layer cast at a time and put back after, so a streamed reference holds nothing more.
- `Routing.recording`: each router's chosen experts per token, per sample, in layer order.
- `Routing.replaying`: each router takes the recorded experts, weighted by its own float32 scores of
  them; where its own choice differs, the token and the float32 margin are counted.

With the routing replayed, honest states meet the dense limits at the worst token, and the tokens
whose float32 choice differs are near-ties: their float32 margin is within bf16's spacing of the
scores (docs/design.md: Gate; bench/RESULTS.md)."""

import threading
from contextlib import contextmanager

import numpy as np
import torch


def is_moe(cfg: dict) -> bool:
    """A mixture-of-experts config.json (routed experts under any of transformers' names)."""
    cfg = cfg.get("text_config", cfg)
    return any(
        (cfg.get(k) or 0) > 1 for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    )


def routers(model) -> list[torch.nn.Module]:
    """The routers of transformers' MoE blocks (DeepSeek-V3, Qwen3-MoE, Mixtral, ...), in layer order:
    modules returning (logits, weights, chosen experts)."""
    return [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]


def sample_key(ids) -> bytes:
    return np.asarray(ids, dtype=np.int64).tobytes()


class Capture:
    """The experts a model's own forward chose for some samples while it extracts them (batched,
    right-padded rows): kept in a `Routing` for the gate's reference to replay. `before(batch)` and
    `after(length)` bracket each forward; only a batch holding one of the samples keeps anything.
    `then(chosen)` is called once, as soon as every sample's experts are kept: a reference in a
    process of its own takes its states from there while the part runs on."""

    def __init__(self, model, samples: list, then=None):
        self.routing, self.want, self.then = Routing(), {sample_key(x) for x in samples}, then
        self.forwards = 0
        self._calls, self._rows = None, []
        self._hooks = [r.register_forward_hook(self._hook) for r in routers(model)]

    def _hook(self, router, args, out):
        if self._calls is not None:
            self._calls.append(out[2])

    def before(self, batch: list) -> None:
        self.forwards += 1
        self._rows = [(b, sample_key(x), len(x)) for b, x in enumerate(batch) if sample_key(x) in self.want]
        self._calls = [] if self._rows else None

    def after(self, length: int) -> None:
        for b, key, n in self._rows if self._calls else []:
            self.routing.chosen[key] = [c.view(-1, length, c.shape[-1])[b, :n].cpu() for c in self._calls]
        self._calls, self._rows = None, []
        if self.then is not None and self.want <= self.routing.chosen.keys():
            then, self.then = self.then, None  # once
            then(self.routing.chosen)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def weights_for(router, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The weights `router` gives the experts `chosen` [T, k] from its logits [T, E], by its own rule:
    sigmoid scores (DeepSeek-V3: normalised if norm_topk_prob, times routed_scaling_factor), or softmax
    probabilities (normalised over the chosen unless norm_topk_prob is False)."""
    if hasattr(router, "e_score_correction_bias"):
        w = logits.float().sigmoid().gather(1, chosen)
        if router.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * router.routed_scaling_factor
    w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, chosen)
    if getattr(router, "norm_topk_prob", True):
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype)


def _choice_scores(router, logits: torch.Tensor) -> torch.Tensor:
    """The scores a router ranks experts by (DeepSeek-V3: sigmoid plus its correction bias)."""
    if hasattr(router, "e_score_correction_bias"):
        return logits.float().sigmoid() + router.e_score_correction_bias.float()
    return torch.softmax(logits, dim=-1, dtype=torch.float)


@contextmanager
def bf16_like_extraction(model):
    """Within: the float32 model's forward computes as the same model loaded in bf16 would. Each
    decoder layer and the final norm are cast when called and put back after, under a lock of their
    own (threads of a streamed reference meet there); the post-hook runs before any other."""
    keep = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    decoder = model.get_decoder()
    saved, locks = {}, {}

    def down(module, args, kwargs):
        locks[module].acquire()
        saved[module] = []
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if t.is_floating_point() and t.dtype != torch.bfloat16 and not any(k in name for k in keep):
                saved[module].append((t, t.data))
                t.data = t.data.to(torch.bfloat16)
        cast = lambda x: x.to(torch.bfloat16) if torch.is_tensor(x) and x.is_floating_point() else x  # noqa: E731
        return tuple(map(cast, args)), {k: cast(v) for k, v in kwargs.items()}

    def up(module, args, kwargs, out):
        for t, data in saved.pop(module, []):
            t.data = data
        locks[module].release()

    modules = [*decoder.layers, *([decoder.norm] if getattr(decoder, "norm", None) is not None else [])]
    locks.update({m: threading.Lock() for m in modules})
    hooks = [m.register_forward_pre_hook(down, with_kwargs=True) for m in modules]
    hooks += [m.register_forward_hook(up, with_kwargs=True, prepend=True) for m in modules]
    hooks.append(model.get_input_embeddings().register_forward_hook(lambda m, a, out: out.to(torch.bfloat16)))
    attn = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(attn)
        for h in hooks:
            h.remove()
        for module in list(saved):  # a forward that failed inside a module
            up(module, (), {}, None)


class Routing:
    """The experts each sample's tokens went to, per router, recorded from one forward and replayed
    in another. Samples are keyed by their token bytes; each forward runs in one thread (the
    streamed reference runs a thread per sample), which says which sample it is with `as_sample`."""

    def __init__(self):
        self.chosen: dict[bytes, list[torch.Tensor]] = {}
        # whose forward chose each sample's experts; "unfit": captured ones that fit no router of this target
        self.sources = {"extraction": 0, "reference_bf16": 0, "unfit": 0}
        self.flips: dict[bytes, list[tuple[int, int]]] = {}  # per router: (tokens choosing otherwise, tokens)
        self.margins: list[torch.Tensor] = []  # of each token choosing otherwise: the float32 margin, in bf16 ulps
        self.typical: list[torch.Tensor] = []  # every token's: its k-th against its (k+1)-th, in bf16 ulps
        self._local = threading.local()
        self._lock = threading.Lock()

    @contextmanager
    def as_sample(self, ids: np.ndarray):
        self._local.key, self._local.n = sample_key(ids), 0
        try:
            yield
        finally:
            self._local.key = None

    @contextmanager
    def recording(self, model):
        def record(router, args, out):
            self.chosen.setdefault(self._local.key, []).append(out[2].detach().cpu())

        hooks = [r.register_forward_hook(record) for r in routers(model)]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()

    @contextmanager
    def replaying(self, model):
        def replay(router, args, out):
            logits, _, own = out
            chosen = self.chosen[self._local.key][self._local.n].to(own.device)
            self._local.n += 1
            other = (own.sort(-1).values != chosen.sort(-1).values).any(-1)
            scores = _choice_scores(router, logits)
            theirs = scores.gather(1, chosen).min(-1).values  # the weakest expert the bf16 forward chose
            ours = scores.gather(1, own).min(-1).values  # and the float32 router's own k-th
            ulp = torch.exp2(torch.floor(torch.log2(theirs.abs().clamp_min(1e-30))) - 7)  # bf16's at that score
            top = scores.topk(chosen.shape[-1] + 1, dim=-1).values
            with self._lock:
                self.flips.setdefault(self._local.key, []).append((int(other.sum()), int(other.numel())))
                self.margins.append(((ours - theirs) / ulp)[other].cpu())
                self.typical.append(((top[:, -2] - top[:, -1]) / ulp).cpu())
            return logits, weights_for(router, logits, chosen), chosen

        hooks = [r.register_forward_hook(replay) for r in routers(model)]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()

    def figures(self) -> dict:
        """Per router, the fraction of tokens whose float32 choice, given the same inputs, differs from
        the bf16 forward's; overall, and the float32 margin of those tokens between its own weakest
        chosen expert and the weakest the bf16 forward chose, in units of bf16's spacing at that score."""
        per = np.array([[f for f in flips] for flips in self.flips.values()])  # [samples, routers, 2]
        if per.size == 0:
            return {}
        by_router = per.sum(0)
        margins = torch.cat(self.margins) if self.margins else torch.zeros(0)
        q = lambda p: round(float(margins.quantile(p)), 6) if len(margins) else None  # noqa: E731
        return {
            "chosen_by": dict(self.sources),
            "routers": len(by_router),
            "flip_fraction": round(float(by_router[:, 0].sum() / by_router[:, 1].sum()), 5),
            "flip_fraction_per_router": [round(float(a / b), 5) for a, b in by_router],
            "flipped_margin_bf16_ulps": {"median": q(0.5), "p99": q(0.99), "max": q(1.0)},
            "margin_bf16_ulps_median_all_tokens": round(float(torch.cat(self.typical).median()), 4),
        }
