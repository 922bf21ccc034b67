"""The tap convention (docs/design.md: Taps): tap j = HF `hidden_states[j]`, the residual stream
entering decoder layer j; the default taps and the check of configured ones."""

from eaglenest.runtime.errors import EaglenestError


def default_taps(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def resolve_taps(taps, num_layers: int) -> list[int]:
    """`auto` -> [2, L//2, L-3]; else three HF hidden_states indices in [0, L-1], ascending."""
    if taps in (None, "auto"):
        auto = default_taps(num_layers)
        if not (0 <= auto[0] < auto[1] < auto[2] <= num_layers - 1):  # fewer than 7 layers
            raise EaglenestError(
                f"extract.taps auto gives {auto} for this {num_layers}-layer target: not three distinct "
                f"layers; set extract.taps to three ascending ids in [0, {num_layers - 1}]"
            )
        return auto
    if not isinstance(taps, (list, tuple)) or len(taps) != 3 or not all(isinstance(t, int) for t in taps):
        raise EaglenestError(f"extract.taps must be `auto` or three integers (low, mid, high), got {taps!r}")
    bad = [t for t in taps if not 0 <= t <= num_layers - 1]
    if bad:
        raise EaglenestError(
            f"extract.taps {list(taps)}: {bad} out of range; a tap is an HF hidden_states "
            f"index in [0, {num_layers - 1}] for this {num_layers}-layer target "
            f"(the final post-norm state is stored separately)"
        )
    if list(taps) != sorted(set(taps)):
        raise EaglenestError(f"extract.taps {list(taps)} must be distinct and ascending (low, mid, high)")
    return list(taps)
