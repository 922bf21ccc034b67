"""What both of eaglenest's SGLang launchers (`launch`: capture, `serve`: speculative decoding) need:
SGLang's own argument parser, the supported-version check, and the CPU environment (defaults, and
stand-ins for packages PyPI lacks)."""

import argparse
import importlib.util
import json
import os
import sys
from importlib import metadata
from pathlib import Path

from .protocol import SUPPORTED_SGLANG, supported

# On CPU: the AMX attention backend needs the real kernel package; without --mem-fraction-static startup
# fails; an idle scheduler otherwise spins a core at 100%; the KV pool would take ~30% of RAM.
CPU_DEFAULTS = [
    ("--attention-backend", "torch_native"),
    ("--mem-fraction-static", "0.3"),
    ("--max-total-tokens", "32768"),
    ("--disable-overlap-schedule", None),
    ("--sleep-on-idle", None),
]
# An MLA model (DeepSeek-V2/V3) on CPU: torch_native's prefill reads its keys from the KV pool, which
# holds MLA's latent vectors, not the keys of the prefill's MHA form; intel_amx's takes them as given
# (SGLang's CPU kernel package or the stand-in's plain-torch op)
MLA_CPU_DEFAULTS = [("--prefill-attention-backend", "intel_amx"), ("--decode-attention-backend", "intel_amx")]
STANDINS = Path(__file__).resolve().parent / "standins"


def is_mla(model_path: str) -> bool:
    """A model with multi-head latent attention (config.json's kv_lora_rank: DeepSeek-V2/V3, Kimi K2)."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return False  # a hub id or an unreadable config: SGLang reports it
    return bool(cfg.get("text_config", cfg).get("kv_lora_rank"))


class LaunchError(SystemExit):
    def __init__(self, msg: str):
        super().__init__(f"sglang_patch: {msg}")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line naming the problem, not SGLang's 600-line usage
        raise LaunchError(f"SGLang's argument parser rejects the server arguments: {message}")


def sglang_parser() -> argparse.ArgumentParser:
    """SGLang's own command-line parser, built as `sglang.launch_server` builds it (abbreviations allowed)."""
    from sglang.srt.server_args import ServerArgs

    parser = _Parser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    return parser


def add_unless_set(parser, user: argparse.Namespace, args: list[str], defaults) -> None:
    """Append `flag [value]` for each default whose option the user left at SGLang's default."""
    for flag, value in defaults:
        dest = parser._option_string_actions[flag].dest
        if getattr(user, dest) == parser.get_default(dest):
            args += [flag] + ([value] if value is not None else [])


def check_version() -> str:
    try:
        v = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        raise LaunchError(
            f"sglang is not installed in {sys.executable} (`make sglang-env` builds .venv-sglang)"
        ) from None
    if not supported(v):
        lo, hi = (".".join(map(str, t)) for t in SUPPORTED_SGLANG)
        raise LaunchError(
            f"sglang {v} is outside the supported range {lo}..{hi} (plugin hooks and "
            f"customized_info were checked there)"
        )
    return v


def cpu_env(cpu: bool) -> dict[str, str]:
    """SGLANG_USE_CPU_ENGINE for a CPU server, and PYTHONPATH with a stand-in for each package
    SGLang imports that is not installed: the CPU kernel package (CPU only) and torchvision."""
    env = {"SGLANG_USE_CPU_ENGINE": "1"} if cpu else {}
    standins = []
    if cpu and importlib.util.find_spec("sgl_kernel") is None:
        standins.append("sgl_kernel_cpu")
    if importlib.util.find_spec("torchvision") is None:
        standins.append("no_torchvision")
    if standins:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(STANDINS / s) for s in standins] + [p for p in [os.environ.get("PYTHONPATH")] if p]
        )
        print(
            f"sglang_patch: using eaglenest's stand-ins {standins} (sglang_patch/standins: the real "
            f"packages are not installed here)",
            file=sys.stderr,
        )
    return env


def exec_server(args: list[str], env: dict[str, str]) -> None:
    """Become `sglang.launch_server`: an exec, not a child, so signals to this PID reach SGLang
    directly and PYTHONPATH applies from the start."""
    os.environ.update(env)
    os.execv(sys.executable, [sys.executable, "-m", "sglang.launch_server", *args])
