"""A decoding mode of the evaluation: a chain of k drafts (an int) or a draft tree (`TreeShape`)."""

from eaglenest.decoding.speculative import Decoded, speculative_decode
from eaglenest.decoding.tree import TreeShape, tree_decode


def mode_key(mode: int | TreeShape) -> str:
    """A decoding mode's key in the figures: the chain length ("3") or the tree's name ("tree-5x4x8")."""
    return mode.name if isinstance(mode, TreeShape) else str(mode)


def depth(mode: int | TreeShape) -> int:
    """Draft steps a round runs: the chain length, or the tree's depth."""
    return mode.steps if isinstance(mode, TreeShape) else mode


def spec_decode(runner, drafter, embed, x: list[int], max_new: int, eos: set, mode: int | TreeShape) -> Decoded:
    if isinstance(mode, TreeShape):
        return tree_decode(runner, drafter, embed, x, max_new, eos, mode)
    return speculative_decode(runner, drafter, embed, x, max_new, eos, mode)


def slots_per_round(mode: int | TreeShape) -> int:
    """KV slots a verification adds to each question's cache: the last token and the drafts."""
    return mode.tokens if isinstance(mode, TreeShape) else mode + 1
