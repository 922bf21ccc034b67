"""eaglenest's CPU stand-in for SGLang's speculative-decoding kernels (sglang_patch/standins) against
SGLang's own Triton kernels for the same ops, run by Triton's interpreter in `.venv-sglang`
(`make sglang-env`). The stand-in's attention ops are checked end to end: SGLang's tree decoding
through them equals greedy decoding and the offline tree decoder (tests/test_pipeline.py)."""

import json
import subprocess

from .conftest import REPO

SGPY = REPO / ".venv-sglang" / "bin" / "python"


def test_tree_build_and_greedy_walk_equal_sglangs_triton_kernels():
    p = subprocess.run(
        [str(SGPY), str(REPO / "tests" / "standin_kernels_vs_triton.py")], capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {"cases": 30}
