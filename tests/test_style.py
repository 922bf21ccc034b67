"""The style holds by itself: ruff's lint rules and layout, as pyproject.toml configures them."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True)


def test_ruff_lint_is_clean():
    p = ruff("check", "--output-format", "concise", ".")
    assert p.returncode == 0, f"ruff check found problems (see pyproject.toml):\n{p.stdout}{p.stderr}"


def test_ruff_format_leaves_every_file_as_it_is():
    p = ruff("format", "--check", ".")
    assert p.returncode == 0, f"run `ruff format .`:\n{p.stdout}{p.stderr}"


def test_the_library_stays_a_house_a_newcomer_can_walk():
    """No module of the library, the stages or the SGLang plugin over 300 lines; a few entry modules at
    the library's top, the rest in packages by role (docs/design.md, Layout); a README that is a guide."""
    long = [
        f"{p.relative_to(REPO)} ({n} lines)"
        for d in ("eaglenest", "stages", "sglang_patch")
        for p in sorted((REPO / d).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > 300
    ]
    assert not long, f"split these by what they do: {long}"
    top = sorted(p.name for p in (REPO / "eaglenest").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 6, f"eaglenest/ top-level modules: {top}; move them into a package by role"
    assert len((REPO / "README.md").read_text().splitlines()) <= 150, "README.md over 150 lines: figures go to RESULTS"
