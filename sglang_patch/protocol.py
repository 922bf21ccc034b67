"""The contract between the capture plugin (inside SGLang) and eaglenest's sglang client (docs/design.md: Extraction).
Plain constants, imported on both sides."""

import re

from eaglenest.runtime.versions import CAPTURE_VERSIONS

CAPTURE_VERSION = CAPTURE_VERSIONS["sglang"]
RECEIPT_KEY = "hs_capture"  # meta_info key of the per-request receipt
ENV_DIR = "EAGLENEST_CAPTURE_DIR"  # set by the launcher; the plugin is inert without it
ENV_TAPS = "EAGLENEST_CAPTURE_TAPS"  # internal tap ids (HF hidden_states indices), "auto" or "2,15,27"
ENV_RID_PREFIX = "EAGLENEST_CAPTURE_RID_PREFIX"
DEFAULT_RID_PREFIX = "eaglenest-"
PLUGIN_NAME = "eaglenest_capture"  # entry point name in group sglang.srt.plugins


def capture_file(rid: str) -> str:
    """The name of a request's capture file in the capture dir: the plugin writes it, the client
    reads and deletes exactly this file and no other."""
    return f"{rid}.safetensors"


# Plugins, ForwardBatch.rids and LogitsProcessorOutput.customized_info all exist from 0.5.11; the
# LogitsProcessor.forward signature and set_eagle3_layers_to_capture were checked up to 0.5.23.
# CI runs 0.5.21 (requirements-sglang.txt).
SUPPORTED_SGLANG = ((0, 5, 11), (0, 5, 23))


def version_tuple(v: str) -> tuple[int, int, int]:
    """ "0.5.21.post1" -> (0, 5, 21); post/rc suffixes do not move a release across the range."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", v)
    if not m:
        raise ValueError(f"unparsable SGLang version {v!r}")
    return tuple(int(x) for x in m.groups())


def supported(v: str) -> bool:
    lo, hi = SUPPORTED_SGLANG
    return lo <= version_tuple(v) <= hi
