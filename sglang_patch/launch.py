"""Start an SGLang server with eaglenest's hidden-state capture enabled.

    python -m sglang_patch.launch --model-path data/target [--capture-dir DIR] [--capture-taps auto|2,15,27]
                                  [any other sglang.launch_server argument]

Capture needs every prompt position computed in one prefill forward, so this launcher ADDS
  --disable-radix-cache --chunked-prefill-size -1 --disable-cuda-graph --pp-size 1 --skip-tokenizer-init
(and --host 127.0.0.1 unless --host is given) and REFUSES arguments that contradict them, judged by
what SGLang's own parser makes of them (any spelling it accepts), and SGLang versions outside the
supported range. With --device cpu it also sets SGLANG_USE_CPU_ENGINE=1,
defaults --attention-backend torch_native, --mem-fraction-static 0.3, --max-total-tokens 32768,
--disable-overlap-schedule and --sleep-on-idle (an MLA model, DeepSeek-V2/V3: also
--prefill- and --decode-attention-backend intel_amx, whose prefill takes MLA's keys as computed),
and, when SGLang's CPU kernel package is not installed, puts a pure-torch stand-in on PYTHONPATH
(likewise a torchvision stand-in when torchvision is absent: see sglang_patch/standins).
Capture files (safetensors, 0600) go to --capture-dir (created 0700; default a fresh directory
under /dev/shm or $TMPDIR); the client deletes each one after storing it."""

import argparse
import os
import sys
import tempfile
from pathlib import Path

from .protocol import DEFAULT_RID_PREFIX, ENV_DIR, ENV_RID_PREFIX, ENV_TAPS, PLUGIN_NAME
from .server_env import (
    CPU_DEFAULTS,
    MLA_CPU_DEFAULTS,
    LaunchError,
    add_unless_set,
    check_version,
    cpu_env,
    exec_server,
    is_mla,
    sglang_parser,
)

ENFORCED = [
    ("--disable-radix-cache", None),
    ("--chunked-prefill-size", "-1"),
    ("--disable-cuda-graph", None),
    ("--pp-size", "1"),
    ("--skip-tokenizer-init", None),
]
# SGLang's own option (argparse dest) -> (values that are fine, why anything else contradicts capture).
# The arguments are parsed by SGLang's parser, so every spelling it accepts (an abbreviation like
# --speculative-algo, --opt=value, an alias like --pipeline-parallel-size) is judged by its meaning.
FORBIDDEN = {
    "disable_radix_cache": ({True}, "the prefix cache must be off: cached positions are never recomputed"),
    "chunked_prefill_size": ({-1}, "chunked prefill splits a prompt over several forwards (partial captures)"),
    "enable_dynamic_chunking": ({False, None}, "chunks prompts (partial captures)"),
    "enable_mixed_chunk": ({False, None}, "mixes prefill chunks into decode batches"),
    "radix_cache_backend": ({None}, "turns a prefix cache on: cached positions are never recomputed"),
    "enable_session_radix_cache": ({False, None}, "a prefix cache: cached positions are never recomputed"),
    "enable_hierarchical_cache": ({False, None}, "a prefix cache: cached positions are never recomputed"),
    "pp_size": ({1}, "only the last pipeline stage captures aux states"),
    "cuda_graph_backend_prefill": (
        {None, "disabled"},
        "prefill CUDA graphs replay static buffers over the layer stack",
    ),
    "cuda_graph_config": ({None}, "may enable prefill CUDA graphs"),
    "enable_piecewise_cuda_graph": ({False, None}, "prefill CUDA graphs replay static buffers over the layer stack"),
    "enable_dp_attention": ({False, None}, "DP attention shards tokens across ranks"),
    "speculative_algorithm": ({None}, "a speculative server verifies drafts instead of running plain prefill"),
    "skip_tokenizer_init": (
        {True},
        "the client sends token ids; a tokenizer would re-tokenize nothing but costs a process",
    ),
}


def option_names(parser: argparse.ArgumentParser, dest: str) -> str:
    return "/".join(next(a.option_strings for a in parser._actions if a.dest == dest))


def check_meaning(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Refuse the final arguments if any option SGLang parsed means something capture cannot allow."""
    for dest, (fine, why) in FORBIDDEN.items():
        if hasattr(ns, dest) and getattr(ns, dest) not in fine:  # options this SGLang lacks cannot be given
            raise LaunchError(
                f"{option_names(parser, dest)} {getattr(ns, dest)} contradicts hidden-state capture: {why}"
            )


def capture_dir(given: str | None) -> str:
    if given is None:
        base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        return tempfile.mkdtemp(prefix="eaglenest-capture-", dir=base)  # 0700 by construction
    p = Path(given)
    p.mkdir(mode=0o700, parents=True, exist_ok=True)
    if p.stat().st_mode & 0o077:
        raise LaunchError(
            f"--capture-dir {p} is accessible to group/others (mode {oct(p.stat().st_mode & 0o777)}); "
            f"use a fresh directory or chmod 700 it"
        )
    return str(p.resolve())


def build(argv: list[str]) -> tuple[list[str], dict[str, str], str]:
    ap = argparse.ArgumentParser(
        prog="python -m sglang_patch.launch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--capture-dir", help="where capture files are written (created 0700)")
    ap.add_argument(
        "--capture-taps",
        default="auto",
        help="aux taps as HF hidden_states indices (input of layer j), e.g. 2,15,27; auto = [2, L//2, L-3]",
    )
    ap.add_argument(
        "--rid-prefix", default=DEFAULT_RID_PREFIX, help="only requests whose rid starts with this are captured"
    )
    ours, rest = ap.parse_known_args(argv)
    version = check_version()
    parser = sglang_parser()
    user = parser.parse_args(rest)
    if not getattr(user, "model_path", None):
        raise LaunchError("--model-path is required")
    args = list(rest)
    add_unless_set(parser, user, args, ENFORCED + [("--host", "127.0.0.1")])
    cpu = user.device == "cpu"
    if cpu:
        add_unless_set(parser, user, args, CPU_DEFAULTS + (MLA_CPU_DEFAULTS if is_mla(user.model_path) else []))
    check_meaning(parser, parser.parse_args(args))
    env = {ENV_DIR: capture_dir(ours.capture_dir), ENV_TAPS: ours.capture_taps, ENV_RID_PREFIX: ours.rid_prefix}
    if os.environ.get("SGLANG_PLUGINS") and PLUGIN_NAME not in os.environ["SGLANG_PLUGINS"].split(","):
        env["SGLANG_PLUGINS"] = os.environ["SGLANG_PLUGINS"] + "," + PLUGIN_NAME
    env.update(cpu_env(cpu))
    return args, env, version


def main(argv: list[str] | None = None) -> None:
    args, env, version = build(sys.argv[1:] if argv is None else argv)
    print(
        f"sglang_patch.launch: sglang {version}; capture dir {env[ENV_DIR]}; taps {env[ENV_TAPS]}; "
        f"server args: {' '.join(args)}",
        file=sys.stderr,
        flush=True,
    )
    exec_server(args, env)


if __name__ == "__main__":
    main()
