"""Start, watch and stop an SGLang server through `python -m sglang_patch.launch` in the server's
own virtual environment (SGLang pins its own torch/transformers: `make sglang-env`)."""

from pathlib import Path

from eaglenest.runtime.errors import EaglenestError
from eaglenest.runtime.server_process import ServerProcess, free_port, get_json, installed_version

__all__ = ["LaunchedServer", "free_port", "get_json", "sglang_version"]


def sglang_version(python: Path) -> str:
    """The SGLang version installed beside `python`, without starting a server."""
    return installed_version(python, "sglang", "sglang-env")


class LaunchedServer(ServerProcess):
    """One SGLang server (and its children) in its own session, logged to `log_path`."""

    def __init__(
        self,
        python: Path,
        model_dir: Path,
        *,
        dtype: str,
        taps: list[int],
        capture_dir: Path,
        device: str,
        extra_args: list[str],
        log_path: Path,
        startup_timeout: float = 600.0,
    ):
        self.python = Path(python)
        if not self.python.exists():
            raise EaglenestError(
                f"SGLang server environment not found: {self.python} (run `make sglang-env`, "
                f"or set extract.sglang.python)"
            )
        self.capture_dir = Path(capture_dir)
        port = free_port()
        cmd = [
            str(self.python),
            "-m",
            "sglang_patch.launch",
            "--model-path",
            str(Path(model_dir).resolve()),
            "--dtype",
            dtype,
            "--port",
            str(port),
            "--device",
            "cpu" if device == "cpu" else "cuda",
            "--capture-dir",
            str(capture_dir),
            "--capture-taps",
            ",".join(map(str, taps)),
            *extra_args,
        ]
        super().__init__("SGLang server", cmd, port, "/model_info", log_path, startup_timeout=startup_timeout)
