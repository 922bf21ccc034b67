"""Serve a target with an EAGLE-3 drafter through SGLang's own speculative decoding.

    python -m sglang_patch.serve --model-path TARGET --speculative-draft-model-path DRAFTER
        [--speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 8]
        [any other sglang.launch_server argument]

With a drafter it adds --speculative-algorithm EAGLE3 unless given; without one it serves the plain
target with the same flags (the greedy reference a speculative run must equal). It adds --host
127.0.0.1 unless given. With --device cpu it also adds the CPU defaults of `sglang_patch.launch`,
except that decode and prefill attention run on `intel_amx`: SGLang's one CPU backend that verifies
a token tree and drafts several branches (torch_native runs no speculative decoding). They are given
as --decode/--prefill-attention-backend because SGLang turns --attention-backend intel_amx into
torch_native on a CPU without AMX. Without SGLang's CPU kernel package, eaglenest's stand-in provides
the kernels (sglang_patch/standins). The capture plugin stays inert: no capture directory is set."""

import sys

from .server_env import CPU_DEFAULTS, add_unless_set, check_version, cpu_env, exec_server, sglang_parser

# What the CPU defaults become for serving: the same, with the attention backend that speculates.
CPU_SERVE_DEFAULTS = [d for d in CPU_DEFAULTS if d[0] != "--attention-backend"] + [
    ("--attention-backend", "intel_amx"),
    ("--decode-attention-backend", "intel_amx"),
    ("--prefill-attention-backend", "intel_amx"),
]


def build(argv: list[str]) -> tuple[list[str], dict[str, str], str]:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        sys.exit(0)
    version = check_version()
    parser = sglang_parser()
    user = parser.parse_args(argv)
    args = list(argv)
    extra = [("--host", "127.0.0.1")]
    if user.speculative_draft_model_path:
        extra.append(("--speculative-algorithm", "EAGLE3"))
    add_unless_set(parser, user, args, extra)
    cpu = user.device == "cpu"
    if cpu:
        add_unless_set(parser, user, args, CPU_SERVE_DEFAULTS)
    return args, cpu_env(cpu), version


def main(argv: list[str] | None = None) -> None:
    args, env, version = build(sys.argv[1:] if argv is None else argv)
    print(f"sglang_patch.serve: sglang {version}; server args: {' '.join(args)}", file=sys.stderr, flush=True)
    exec_server(args, env)


if __name__ == "__main__":
    main()
