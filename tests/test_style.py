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
