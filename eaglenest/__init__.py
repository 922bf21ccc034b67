"""eaglenest: EAGLE-3 drafters trained from a target LLM's own hidden states.

The library knows nothing of DVC or params.yaml; `stages/` wires it to the pipeline.
"""

import os

# No code path may reach a model hub (docs/design.md: Target): every load is local.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

__version__ = "0.1.0"
