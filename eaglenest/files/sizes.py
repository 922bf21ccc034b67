"""Byte counts for people: decimal units (kB, MB, GB, TB), as disks and `df -H` count them."""


def size(n: float) -> str:
    """Three significant digits: 269 kB, 25.0 MB, 1.20 TB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1)):
        v = n / scale
        if unit == "B":
            return f"{n:.0f} B"
        if abs(v) >= 1:
            return f"{v:.{2 if abs(v) < 10 else 1 if abs(v) < 100 else 0}f} {unit}"
