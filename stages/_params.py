"""params.yaml access for the stages (the library never reads it)."""
from pathlib import Path

import yaml

from eaglenest.errors import EaglenestError

PARAMS = Path("params.yaml")


def load(section: str | None = None) -> dict:
    if not PARAMS.is_file():
        raise EaglenestError(f"{PARAMS.resolve()}: not found; run stages from the repository root")
    params = yaml.safe_load(PARAMS.read_text()) or {}
    if section is None:
        return params
    if section not in params:
        raise EaglenestError(f"{PARAMS}: missing section `{section}`")
    return params[section]
