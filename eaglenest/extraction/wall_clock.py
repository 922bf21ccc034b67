"""A part's wall clock split into the forward loop and its fixed cost (docs/design.md: Extraction,
"Fixed cost"). The loop itemises what it times; this adds what only the stage process knows: how long
its imports took (process start to main) and the fingerprint check, and the totals."""

import time


def add_fixed_cost(m: dict, t_main: float, fingerprint_s: float) -> None:
    """m: extract_part's metrics (updated in place); t_main: time.time() when the stage's main() began."""
    fc = m.setdefault("fixed_cost", {})
    try:
        import psutil

        fc["imports_s"] = round(t_main - psutil.Process().create_time(), 2)
    except Exception:  # no process start time on this platform: the rest is still itemised
        fc["imports_s"] = None
    fc["fingerprint_s"] = round(fingerprint_s, 2)
    forward_s = m["extract_seconds"] - fc.get("load_s", 0) - fc.get("warm_up_s", 0)
    wall_s = time.time() - t_main + (fc["imports_s"] or 0)
    m["forward_s"] = round(forward_s, 2)
    m["wall_s"] = round(wall_s, 2)
    fc["total_s"] = round(wall_s - forward_s, 2)
