"""The lossless check of speculative decoding (docs/design.md: Evaluate).

An output is lossless when it equals plain greedy decoding of the target. Where it does not, both
decoders computed the same logits in other shapes (a verification of k + 1 positions, one decode
step, other batch rows beside it), and floating point breaks a near-tie either way; in a mixture of
experts a router's near-tie sends a token to another expert and moves the logits by far more than
rounding. The arbiter is then the target's own forward, uncached, over the speculative output:
greedy decoding is the sequence whose every token is that forward's argmax over its prefix, so the
output is lossless when, from the first difference on, each of its tokens is the top logit there,
within how far two shapes of that forward disagree on this device (`shape_noise`). A wrong acceptance
(a draft the verification should have rejected) is below the top by more than that, and named."""

import torch


@torch.no_grad()
def divergence(model, prompt: list[int], greedy: list[int], spec: list[int]) -> dict:
    """Where a speculative output first leaves plain greedy decoding, and whether it follows the
    target's own forward from there: the logit margin of greedy's token over the speculative one at
    that position (negative: the target's forward takes the speculative token, and plain decoding
    broke a near-tie there), over the top logit, the shape noise, and the positions (with margins
    below the top) where the speculative output leaves the forward's argmax."""
    j = next((i for i, (g, t) in enumerate(zip(greedy, spec)) if g != t), min(len(greedy), len(spec)))
    out = {"position": j, "follows_target": False}
    if j >= min(len(greedy), len(spec)):  # one output ended (a stop token) where the other went on
        return out
    n = len(prompt)
    x = torch.tensor([prompt + spec], device=model.device)
    logits = model(input_ids=x).logits[0, n - 1 : n + len(spec) - 1].float()  # row i predicts spec[i]
    # the same position in another shape (the input cut where it is predicted): how far two computations
    # of one function disagree here, the scale a tie is judged on
    again = model(input_ids=x[:, : n + j]).logits[0, -1].float()
    noise = (logits[j] - again).abs().max().item()
    top = logits[j].max().item()
    margin = (logits[j, greedy[j]] - logits[j, spec[j]]).item()
    below = logits[j:].max(-1).values - logits[j:].gather(1, torch.tensor(spec[j:], device=x.device)[:, None])[:, 0]
    off = [(j + i, round(b, 6)) for i, b in enumerate(below.tolist()) if b > noise]
    return out | {
        "follows_target": not off,
        "logit_margin": round(margin, 6),
        "relative_to_top": round(margin / max(abs(top), 1e-6), 8),
        "shape_noise": round(noise, 8),
        "off_target": off[:8],
    }
