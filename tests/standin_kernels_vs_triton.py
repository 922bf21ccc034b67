"""Run by tests/test_sglang_standin.py in `.venv-sglang`: eaglenest's CPU stand-in for SGLang's tree
kernels against SGLang's own Triton kernels for the same ops (run by Triton's interpreter on the CPU),
on draft trees that SGLang's own drafting code selects from random draft scores.
Prints one JSON line: the cases compared; exits non-zero at the first difference."""

import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on CPU tensors
os.environ["TORCHDYNAMO_DISABLE"] = "1"  # SGLang's torch.compile'd top-k selection, run eagerly
os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
STANDINS = Path(__file__).resolve().parents[1] / "sglang_patch/standins"
sys.path[:0] = [str(STANDINS / "sgl_kernel_cpu"), str(STANDINS / "no_torchvision")]

import torch  # noqa: E402
from sgl_kernel import speculative as standin  # noqa: E402
from sglang.srt.speculative.eagle_utils import (  # noqa: E402
    organize_draft_results,
    sgl_build_tree_kernel_triton,
    verify_tree_greedy_triton,
)
from sglang.srt.speculative.spec_utils import select_top_k_tokens  # noqa: E402

CPU_NAMES = ["retrive_index", "retrive_next_token", "retrive_next_sibling"]
TRITON_NAMES = ["retrieve_index", "retrieve_next_token", "retrieve_next_sibling"]


def draft(gen, bs, steps, topk, tokens, vocab):
    """SGLang's drafting loop on random draft distributions: parent_list, top_scores_index, tokens."""
    scores, infos = None, []
    for i in range(steps):
        rows = bs if i == 0 else bs * topk
        p = torch.rand(rows, topk, generator=gen).sort(-1, descending=True).values
        idx = torch.randint(0, vocab, (rows, topk), generator=gen)
        _, _, scores, info = select_top_k_tokens(i, p, idx, None, scores, topk)
        infos.append(info)
    return organize_draft_results(*(list(x) for x in zip(*infos)), tokens)


def build(fn, parent_list, sel, seq_lens, topk, steps, tokens, mode):
    bs = len(seq_lens)
    size = tokens * tokens * bs + (int(seq_lens.sum()) * tokens if mode == 0 else 0)
    out = dict(
        tree_mask=torch.full((size,), True),
        positions=torch.empty(bs * tokens, dtype=torch.long),
        retrieve=torch.full((3, bs, tokens), -1, dtype=torch.long),
    )
    r = out["retrieve"]
    fn(parent_list, sel, seq_lens, out["tree_mask"], out["positions"], r[0], r[1], r[2], topk, steps, tokens, mode)
    return out


def verify(fn, names, candidates, retrieve, target, steps):
    """`names`: the op's keyword names of the three retrieve arrays (the CPU op keeps CUDA's `retrive_*`)."""
    bs, tokens = candidates.shape
    out = dict(
        predicts=torch.full((bs * tokens,), -7, dtype=torch.long),
        accept_index=torch.full((bs, steps + 1), -1, dtype=torch.long),
        accept_token_num=torch.zeros(bs, dtype=torch.long),
    )
    fn(**out, candidates=candidates, target_predict=target, **dict(zip(names, retrieve)))
    return out


def same(a: dict, b: dict, what: str) -> None:
    for k in a:
        if not torch.equal(a[k], b[k]):
            sys.exit(f"{what}: {k} differs\nstand-in {a[k].tolist()}\ntriton   {b[k].tolist()}")


def main():
    gen = torch.Generator().manual_seed(0)
    cases = 0
    for steps, topk, tokens in [(5, 4, 8), (3, 4, 8), (3, 1, 4), (2, 3, 10), (4, 2, 6)]:
        for trial in range(6):
            bs = 1 + trial % 3
            vocab = 3 if trial % 2 else 50  # few tokens: many matches, long acceptances
            parent_list, sel, drafts = draft(gen, bs, steps, topk, tokens, vocab)
            seq_lens = torch.randint(1, 20, (bs,), generator=gen)
            for mode in (0, 1):  # FULL_MASK, QLEN_ONLY
                ours = build(standin.build_tree_kernel_efficient_cpu, parent_list, sel, seq_lens, topk, steps, tokens,
                             mode)  # fmt: skip
                ref = build(sgl_build_tree_kernel_triton, parent_list, sel, seq_lens, topk, steps, tokens, mode)
                same(ours, ref, f"build_tree {steps}x{topk}x{tokens} bs {bs} mode {mode} trial {trial}")
            candidates = torch.cat([torch.randint(0, vocab, (bs, 1), generator=gen), drafts], 1)
            target = torch.randint(0, vocab, (bs, tokens), generator=gen)
            r = ref["retrieve"]
            ours = verify(standin.verify_tree_greedy_cpu, CPU_NAMES, candidates, r, target, steps)
            theirs = verify(verify_tree_greedy_triton, TRITON_NAMES, candidates, r, target, steps)
            same(ours, theirs, f"verify_tree_greedy {steps}x{topk}x{tokens} bs {bs} trial {trial}")
            cases += 1
    print(json.dumps({"cases": cases}))


if __name__ == "__main__":
    main()
