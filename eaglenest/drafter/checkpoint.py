"""A training checkpoint: model, optimizer, schedule, loop state and every RNG, written atomically
(temp file + rename) and read back onto the training device."""

import random
from pathlib import Path

import numpy as np
import torch

from eaglenest.files.atomic import replaced_file


def save(path: Path, model, opt, sched, state: dict) -> None:
    with replaced_file(path) as tmp:
        torch.save(
            {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "sched": sched.state_dict(),
                "state": state,
                "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
            },
            tmp,
        )


def load(path: Path, device, model, opt, sched) -> dict:
    """Restores model, optimizer, schedule and RNGs in place; returns the loop state."""
    ck = torch.load(path, map_location=device, weights_only=False)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    sched.load_state_dict(ck["sched"])
    torch.set_rng_state(ck["rng"]["torch"].cpu())  # map_location moved it to the device
    np.random.set_state(ck["rng"]["numpy"])
    random.setstate(ck["rng"]["python"])
    return ck["state"]
