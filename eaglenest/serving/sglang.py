"""SGLang as the serving engine of `serve_check`: `python -m sglang_patch.serve` (SGLang's own
EAGLE-3 speculative decoding, chains and draft trees; on a CPU through eaglenest's kernel
stand-in) in `.venv-sglang` (`make sglang-env`). Its counters come with each response
(meta_info: spec_verify_ct, spec_num_correct_drafts, spec_correct_drafts_histogram)."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eaglenest.decoding.tree import TreeShape
from eaglenest.runtime.errors import EaglenestError
from eaglenest.runtime.server_process import ServerProcess, free_port, installed_version, post_json
from eaglenest.serving.flags import sglang_shape

SGLANG_PYTHON = Path(".venv-sglang/bin/python")


def spec_flags(mode: int | TreeShape) -> list[str]:
    """SGLang's flags for a chain of k (k steps, top-1, k + 1 tokens verified) or a draft tree."""
    steps, topk, tokens = sglang_shape(mode)
    return [
        *("--speculative-num-steps", str(steps)),
        *("--speculative-eagle-topk", str(topk)),
        *("--speculative-num-draft-tokens", str(tokens)),
    ]


class SGLang:
    name = "sglang"

    def __init__(self, python: Path = SGLANG_PYTHON, device: str = "cpu"):
        if not Path(python).exists():
            raise EaglenestError(f"SGLang environment not found: {python} (run `make sglang-env`)")
        self.python, self.device = Path(python), device

    def version(self) -> str:
        return installed_version(self.python, "sglang", "sglang-env")

    def server(self, model_dir: Path, drafter_dir: Path | None, mode, log_path: Path) -> ServerProcess:
        """The target in float32 (greedy ties decided as in `evaluate`), with the drafter drafting
        `mode` when given; the same flags otherwise."""
        port = free_port()
        cmd = [str(self.python), "-m", "sglang_patch.serve", "--model-path", str(Path(model_dir).resolve())]
        cmd += ["--device", self.device, "--dtype", "float32", "--port", str(port), "--random-seed", "0"]
        cmd += ["--context-length", "2048", "--max-running-requests", "16", "--skip-tokenizer-init"]
        cmd += ["--disable-cuda-graph"]  # greedy ties: the same kernels in both runs
        name = "SGLang server"
        if drafter_dir is not None:
            cmd += ["--speculative-draft-model-path", str(Path(drafter_dir).resolve()), *spec_flags(mode)]
            name += f" (EAGLE3, {mode.name if isinstance(mode, TreeShape) else f'k={mode}'})"
        # /health answers 503 until SGLang's own warm-up request has run (/model_info answers before)
        return ServerProcess(name, cmd, port, "/health", log_path)

    def decode(self, url: str, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], dict]:
        """Greedy completions of token-id prompts (EOS included when reached), and the speculative
        counters summed over the responses: verifications, accepted and drafted tokens, and accepted
        tokens per position (position i: the verifications that accepted more than i drafts)."""

        def one(ids):
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0}}
            return post_json(f"{url}/generate", body)

        with ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(one, prompts))
        outputs = [list(r["output_ids"]) for r in responses]
        metas = [r["meta_info"] for r in responses]
        counts = {"verifications": 0, "accepted_tokens": 0, "draft_tokens": 0, "accepted_per_position": []}
        for m in metas:
            if "spec_verify_ct" not in m:
                return outputs, {}  # a plain server
            counts["verifications"] += m["spec_verify_ct"]
            counts["accepted_tokens"] += m["spec_num_correct_drafts"]
            counts["draft_tokens"] += m["spec_num_proposed_drafts"]
            hist = m["spec_correct_drafts_histogram"]  # hist[a]: the verifications that accepted a drafts
            per = counts["accepted_per_position"]
            per += [0] * (len(hist) - 1 - len(per))
            for i in range(len(hist) - 1):
                per[i] += sum(hist[i + 1 :])
        return outputs, counts
