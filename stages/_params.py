"""params.yaml access for the stages (the library never reads it). Every load checks the whole file
against `SCHEMA`: the type and range of each key, no unknown keys, and no key missing from a section
that is there (params.yaml is the one home of the defaults: the stages read `p[key]`, never
`p.get(key, default)`). A typo, a bad value or a dropped key fails before any work, in one message
naming the key. A section may be absent as a whole (a workspace that runs one stage holds its own)."""

import os
import re
from pathlib import Path

from eaglenest.files.names import RULE, is_plain, load_yaml
from eaglenest.runtime.errors import EaglenestError

PARAMS = Path("params.yaml")


def _int(lo=None, hi=None):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, int):
            return "an integer"
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            return f"an integer in [{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"

    return check


def _num(lo=None, hi=None, lo_open=False):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return "a number"
        if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
            return f"a number in {'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}]"

    return check


def _one_of(*options):
    return lambda v: None if v in options else "one of " + ", ".join(map(repr, options))


def _either(*checks, what: str):
    return lambda v: None if any(c(v) is None for c in checks) else what


def _list(item, min_len=1, max_len=None):
    def check(v):
        if not isinstance(v, list) or len(v) < min_len or (max_len and len(v) > max_len) or any(item(x) for x in v):
            n = f"{min_len}" + (f"..{max_len}" if max_len else "+")
            return f"a list of {n} items, each {item(0) or item('') or 'valid'}"

    return check


def _str(v):
    return None if isinstance(v, str) and v else "a non-empty string"


def _name(v):
    """A part's name: it becomes file names under data/."""
    return None if is_plain(v) else f"a plain name: {RULE}"


def _bool(v):
    return None if isinstance(v, bool) else "true or false"


def _null(v):
    return None if v is None else "null"


AUTO_BOOL = _either(_one_of("auto"), _bool, what="auto, true or false")
DEVICE = _either(
    _one_of("auto", "cpu", "cuda"),
    lambda v: None if isinstance(v, str) and v.startswith("cuda:") else "x",
    what="auto, cpu, cuda or cuda:N",
)
DTYPE = _one_of("bfloat16", "float16", "float32")
COMPUTE_DTYPE = _one_of("auto", "bfloat16", "float16", "float32")  # auto: made_on.compute_dtype
POS = _int(1)

SCHEMA = {
    "target": {"path": _str, "dtype": DTYPE},
    "data": {
        "parts": _list(_name),
        "sharegpt": {"*": {"start": _int(0), "count": _int(1), "turns": _int(0)}},
        "synthetic": {"*": {"count": _int(1), "seed": _int(0), "temperature": _num(0, lo_open=True), "turns": _int(1)}},
    },
    "synthetic": {
        "system": _either(_null, _str, what="null or a non-empty string"),
        "max_prompt_tokens": POS,
        "near_duplicate": _num(0, 1, lo_open=True),
        "dtype": COMPUTE_DTYPE,
        "device": DEVICE,
        "batch_tokens": POS,
        "max_rows": POS,
    },
    "generate": {
        "enabled": _bool,
        "max_new_tokens": POS,
        "temperature": _num(0),
        "max_turns": _int(0),
        "seed": _int(),
        "dtype": COMPUTE_DTYPE,
        "device": DEVICE,
        "batch_tokens": POS,
        "max_rows": POS,
    },
    "tokenize": {
        "max_seq_len": _int(8),
        "on_error": _one_of("fail", "skip"),
        "workers": _either(_one_of("auto"), POS, what="auto or an integer >= 1"),
    },
    "extract": {
        "backend": _one_of("hf", "sglang", "vllm"),
        "taps": _either(_one_of("auto"), _list(_int(0), 3, 3), what="auto or three layer indices >= 0"),
        "dtype": COMPUTE_DTYPE,
        "revision": _int(0),
        "device": DEVICE,
        "batch_tokens": _either(_one_of("auto"), POS, what="auto or an integer >= 1"),
        "writers": _either(_one_of("auto"), POS, what="auto or an integer >= 1"),
        "devices": _either(_one_of("auto"), POS, what="auto or an integer >= 1"),
        "work_dir": _str,
        "disk_reserve_gb": _num(0),
        "hf": {
            "compile": _either(_one_of("auto", "kernels", "layers"), _bool, what="auto, kernels, layers, true or false")
        },
        "sglang": {
            "server_url": _either(_null, _str, _list(_str), what="null, a URL or a list of URLs"),
            "python": _str,
            "server_args": _list(_either(_str, _num(), what="x"), min_len=0),
            "concurrency": POS,
            "retries": _int(0),
            "capture_dir": _either(_null, _str, what="null or a path"),
            "reserve_mb": _num(0),
            "request_timeout_s": _num(0, lo_open=True),
            "startup_timeout_s": _num(0, lo_open=True),
            "space_timeout_s": _num(0),
            "log_dir": _str,
        },
        "vllm": {
            "python": _str,
            "server_args": _list(_either(_str, _num(), what="x"), min_len=0),
            "concurrency": POS,
            "startup_timeout_s": _num(0, lo_open=True),
            "log_dir": _str,
        },
    },
    "store": {
        "states": _one_of("bf16", "fp8"),
        "codec": _one_of("zstd", "none"),
        "level": _int(1, 22),
        "chunk_mb": _num(0, lo_open=True),
        "shard_mb": _num(0, lo_open=True),
    },
    "validate": {
        "samples": _int(0),
        "seed": _int(),
        "min_cosine_mean": _num(-1, 1),
        "min_cosine_token": _num(-1, 1),
        "max_rel_err_mean": _num(0),
        "max_rel_err_token": _num(0),
        "token_quantile": _either(_one_of("auto"), _num(0.5, 1), what="auto or a number in [0.5, 1]"),
        "reference": _one_of("auto", "whole", "streamed"),
        "routing": _one_of("auto", "replay", "own"),
        "reference_memory_gb": _either(_one_of("auto"), _num(0, lo_open=True), what="auto or a number of GB > 0"),
    },
    "teacher": {
        "device": DEVICE,
        "workers": _either(_one_of("auto"), POS, what="auto or an integer >= 1"),
        "unit_mb": _num(0, lo_open=True),
    },
    "pack": {
        "draft_vocab_size": _int(2),
        "val_fraction": _num(0, 0.99),
    },
    "train": {
        "epochs": POS,
        "lr": _num(0, lo_open=True),
        "warmup": _num(0, 1),
        "weight_decay": _num(0),
        "grad_clip": _num(0),
        "ttt_steps": POS,
        "decay": _num(0, 1, lo_open=True),
        "topk": _int(0),
        "topk_weight": _num(0),
        "align_topk": _int(0),
        "batch_tokens": _int(16),
        "micro_batches": POS,
        "seed": _int(),
        "autocast": _one_of("auto", "bf16", "none"),
        "ckpt_every": POS,
        "device": DEVICE,
        "attention": _one_of("auto", "eager", "flex"),
        "compile": AUTO_BOOL,
        "intermediate_size": _either(_null, POS, what="null or an integer >= 1"),
        "loader_workers": _either(_one_of("auto"), _int(0), what="auto or an integer >= 0"),
        "nproc": _either(_one_of("auto"), POS, what="auto or an integer >= 1"),
    },
    "evaluate": {
        "questions": POS,
        "k": _either(POS, _list(POS), what="an integer >= 1 or a list of them"),
        "trees": _list(_list(POS, 3, 3), min_len=0),
        "max_new_tokens": POS,
        "dtype": COMPUTE_DTYPE,
        "device": DEVICE,
        "batch_size": POS,
        "speed_questions": _either(_null, POS, what="null or an integer >= 1"),
        "min_tau": _either(_null, _num(1), what="null or a number >= 1"),
    },
}


# may be left out of their section: user parts need no built-in ShareGPT cut or synthetic part; a
# synthetic part has one user turn unless it says otherwise
OPTIONAL = {"data.sharegpt", "data.synthetic", "data.synthetic.*.turns"}


def validate(params, schema=SCHEMA, where: str = "") -> None:
    if not isinstance(params, dict):
        raise EaglenestError(f"{PARAMS}: {where or 'the file'} must be a mapping, not {params!r}")
    for key, value in params.items():
        name = f"{where}.{key}" if where else str(key)
        if key not in schema and "*" in schema and _name(key):  # a declared part: its name becomes paths
            raise EaglenestError(f"{PARAMS}: part `{name}`: the name must be {_name(key)}")
        rule = schema.get(key, schema.get("*"))
        if rule is None:
            raise EaglenestError(
                f"{PARAMS}: unknown key `{name}` (known here: {', '.join(k for k in schema if k != '*')})"
            )
        if isinstance(rule, dict):
            validate(value, rule, name)
        elif (want := rule(value)) is not None:
            raise EaglenestError(f"{PARAMS}: `{name}` is {value!r}; it must be {want}")
    part = re.fullmatch(r"data\.(sharegpt|synthetic)\.[^.]+", where)  # a declared part's keys
    if (where.count(".") == 0 and where) or part:  # a section's own keys (a backend's sub-options may be left out)
        generic = f"data.{part[1]}.*" if part else where
        missing = [f"{where}.{k}" for k in schema if k != "*" and k not in params and f"{generic}.{k}" not in OPTIONAL]
        if missing:
            raise EaglenestError(
                f"{PARAMS}: missing {', '.join(f'`{m}`' for m in missing)}; every key of a section must be set "
                f"(the repository's params.yaml has them all, with their defaults)"
            )


def validate_across(params: dict) -> None:
    """Rules between sections, after each key's own: the top-K term takes the teacher's K likeliest of
    the draft vocabulary's tokens. A workspace may hold only the sections its stages read."""
    topk = (params.get("train") or {}).get("topk")
    vocab = (params.get("pack") or {}).get("draft_vocab_size")
    if topk is not None and vocab is not None and topk > vocab:
        raise EaglenestError(f"{PARAMS}: `train.topk` is {topk}; it must be at most `pack.draft_vocab_size` ({vocab})")


def load(section: str | None = None) -> dict:
    if not PARAMS.is_file():
        raise EaglenestError(f"{PARAMS.resolve()}: not found; run stages from the repository root")
    params = load_yaml(PARAMS) or {}  # a key set twice is refused, as DVC refuses it
    validate(params)
    validate_across(params)
    if section is None:
        return params
    if section not in params:
        raise EaglenestError(f"{PARAMS}: missing section `{section}`")
    return params[section]


def workers(value) -> int:
    """A stage's worker processes (teacher.workers, tokenize.workers): auto = cores, max 16."""
    return min(os.cpu_count() or 1, 16) if value == "auto" else int(value)
