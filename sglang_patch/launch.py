"""Start an SGLang server with eaglenest's hidden-state capture enabled.

    python -m sglang_patch.launch --model-path data/target [--capture-dir DIR] [--capture-taps auto|2,15,27]
                                  [any other sglang.launch_server argument]

Capture needs every prompt position computed in one prefill forward, so this launcher ADDS
  --disable-radix-cache --chunked-prefill-size -1 --disable-cuda-graph --pp-size 1 --skip-tokenizer-init
(and --host 127.0.0.1 unless --host is given) and REFUSES flags that contradict them, and SGLang
versions outside the supported range. With --device cpu it also sets SGLANG_USE_CPU_ENGINE=1,
defaults --attention-backend torch_native, --mem-fraction-static 0.3, --max-total-tokens 32768,
--disable-overlap-schedule and --sleep-on-idle,
and, when SGLang's CPU kernel package is not installed, puts a pure-torch stand-in on PYTHONPATH
(likewise a torchvision stand-in when torchvision is absent: see sglang_patch/standins).
Capture files (safetensors, 0600) go to --capture-dir (created 0700; default a fresh directory
under /dev/shm or $TMPDIR); the client deletes each one after storing it."""
import argparse
import importlib.util
import os
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from .protocol import DEFAULT_RID_PREFIX, ENV_DIR, ENV_RID_PREFIX, ENV_TAPS, PLUGIN_NAME, SUPPORTED_SGLANG, supported

ENFORCED = [("--disable-radix-cache", None), ("--chunked-prefill-size", "-1"), ("--disable-cuda-graph", None),
            ("--pp-size", "1"), ("--skip-tokenizer-init", None)]
# flag -> (values that are fine, why anything else contradicts capture)
CONTRADICTING = {
    "--chunked-prefill-size": ({"-1"}, "chunked prefill splits a prompt over several forwards (partial captures)"),
    "--enable-dynamic-chunking": (set(), "chunks prompts (partial captures)"),
    "--enable-mixed-chunk": (set(), "mixes prefill chunks into decode batches"),
    "--radix-cache-backend": (set(), "turns a prefix cache on: cached positions are never recomputed"),
    "--enable-session-radix-cache": (set(), "a prefix cache: cached positions are never recomputed"),
    "--enable-hierarchical-cache": (set(), "a prefix cache: cached positions are never recomputed"),
    "--pp-size": ({"1"}, "only the last pipeline stage captures aux states"),
    "--pipeline-parallel-size": ({"1"}, "only the last pipeline stage captures aux states"),
    "--cuda-graph-backend-prefill": ({"disabled"}, "prefill CUDA graphs replay static buffers over the layer stack"),
    "--cuda-graph-config": (set(), "may enable prefill CUDA graphs"),
    "--enable-piecewise-cuda-graph": (set(), "prefill CUDA graphs replay static buffers over the layer stack"),
    "--enable-dp-attention": (set(), "DP attention shards tokens across ranks"),
    "--speculative-algorithm": (set(), "a speculative server verifies drafts instead of running plain prefill"),
}
# On CPU: the AMX attention backend needs the real kernel package; without --mem-fraction-static startup
# fails; an idle scheduler otherwise spins a core at 100%; the KV pool would take ~30% of RAM.
CPU_DEFAULTS = [("--attention-backend", "torch_native"), ("--mem-fraction-static", "0.3"),
                ("--max-total-tokens", "32768"), ("--disable-overlap-schedule", None), ("--sleep-on-idle", None)]
STANDINS = Path(__file__).resolve().parent / "standins"


class LaunchError(SystemExit):
    def __init__(self, msg: str):
        super().__init__(f"sglang_patch.launch: {msg}")


def flag_values(args: list[str]) -> dict[str, str | None]:
    """{flag: value or None} for `--flag value`, `--flag=value` and bare `--flag`."""
    out, i = {}, 0
    while i < len(args):
        a = args[i]
        if a.startswith("--"):
            if "=" in a:
                k, v = a.split("=", 1)
                out[k] = v
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                out[a] = args[i + 1]
                i += 1
            else:
                out[a] = None
        i += 1
    return out


def check_flags(flags: dict) -> None:
    for flag, (fine, why) in CONTRADICTING.items():
        if flag in flags and flags[flag] not in fine:
            shown = f"{flag} {flags[flag]}" if flags[flag] is not None else flag
            raise LaunchError(f"{shown} contradicts hidden-state capture: {why}")


def check_version() -> str:
    try:
        v = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        raise LaunchError(f"sglang is not installed in {sys.executable} (`make sglang-env` builds .venv-sglang)")
    if not supported(v):
        lo, hi = (".".join(map(str, t)) for t in SUPPORTED_SGLANG)
        raise LaunchError(f"sglang {v} is outside the supported range {lo}..{hi} (plugin hooks and "
                          f"customized_info were checked there)")
    return v


def capture_dir(given: str | None) -> str:
    if given is None:
        base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        return tempfile.mkdtemp(prefix="eaglenest-capture-", dir=base)  # 0700 by construction
    p = Path(given)
    p.mkdir(mode=0o700, parents=True, exist_ok=True)
    if p.stat().st_mode & 0o077:
        raise LaunchError(f"--capture-dir {p} is accessible to group/others (mode {oct(p.stat().st_mode & 0o777)}); "
                          f"use a fresh directory or chmod 700 it")
    return str(p.resolve())


def build(argv: list[str]) -> tuple[list[str], dict[str, str], str]:
    ap = argparse.ArgumentParser(prog="python -m sglang_patch.launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capture-dir", help="where capture files are written (created 0700)")
    ap.add_argument("--capture-taps", default="auto",
                    help="aux taps as HF hidden_states indices (input of layer j), e.g. 2,15,27; auto = [2, L//2, L-3]")
    ap.add_argument("--rid-prefix", default=DEFAULT_RID_PREFIX, help="only requests whose rid starts with this are captured")
    ours, rest = ap.parse_known_args(argv)
    flags = flag_values(rest)
    if "--model-path" not in flags and "--model" not in flags:
        raise LaunchError("--model-path is required")
    check_flags(flags)
    version = check_version()
    args = list(rest)
    for flag, value in ENFORCED:
        if flag not in flags:
            args += [flag] + ([value] if value is not None else [])
    if "--host" not in flags:
        args += ["--host", "127.0.0.1"]
    env = {ENV_DIR: capture_dir(ours.capture_dir), ENV_TAPS: ours.capture_taps, ENV_RID_PREFIX: ours.rid_prefix}
    if os.environ.get("SGLANG_PLUGINS") and PLUGIN_NAME not in os.environ["SGLANG_PLUGINS"].split(","):
        env["SGLANG_PLUGINS"] = os.environ["SGLANG_PLUGINS"] + "," + PLUGIN_NAME
    if flags.get("--device") == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        for flag, value in CPU_DEFAULTS:
            if flag not in flags:
                args += [flag] + ([value] if value is not None else [])
    standins = []
    if flags.get("--device") == "cpu" and importlib.util.find_spec("sgl_kernel") is None:
        standins.append("sgl_kernel_cpu")
    if importlib.util.find_spec("torchvision") is None:
        standins.append("no_torchvision")
    if standins:
        env["PYTHONPATH"] = os.pathsep.join([str(STANDINS / s) for s in standins] +
                                            [p for p in [os.environ.get("PYTHONPATH")] if p])
        print(f"sglang_patch.launch: using eaglenest's stand-ins {standins} (sglang_patch/standins: the real "
              f"packages are not installed here)", file=sys.stderr)
    return args, env, version


def main(argv: list[str] | None = None) -> None:
    args, env, version = build(sys.argv[1:] if argv is None else argv)
    print(f"sglang_patch.launch: sglang {version}; capture dir {env[ENV_DIR]}; taps {env[ENV_TAPS]}; "
          f"server args: {' '.join(args)}", file=sys.stderr, flush=True)
    os.environ.update(env)
    # exec, not a child: signals to this PID reach SGLang directly, and PYTHONPATH applies from the start.
    os.execv(sys.executable, [sys.executable, "-m", "sglang.launch_server", *args])


if __name__ == "__main__":
    main()
