"""Signals (docs/design.md: Failure rules): SIGTERM (a job time limit, `kill`, DVC), SIGINT (Ctrl-C)
or SIGHUP (a closed terminal) to a stage ends it and everything it started -- pool workers, writer
and loader processes -- within 10 s, with one line saying so and no traceback; a rerun resumes. Each is
started as a script's background job starts it, SIGINT ignored, which a stage must undo."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import yaml

from eaglenest.runtime.children import descendants

from .conftest import REPO, sh

pytestmark = pytest.mark.slow


def tagged(tag: str) -> list[int]:
    """Every process whose environment carries `tag`: the stage and all it started, sessions of
    their own included."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if tag.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def as_a_background_job() -> None:
    """How a script's `cmd &` (and so every stage of a detached `dvc repro`) starts a command: with
    SIGINT ignored, which Python keeps unless the command sets it again."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def has_children(n: int):
    return lambda proc, out, age: len(descendants(proc.pid)) >= n


def after(seconds: float, text: str = ""):
    return lambda proc, out, age: text in out and age >= seconds


# stage command, params that make it long enough to interrupt (and start its processes), when to signal
CASES = {
    "target": ("stages.target", {}, after(3, "converting")),
    "synthetic": ("stages.synthetic synth --count 64 --seed 0 --temperature 1.0", {}, after(8)),
    # as soon as it decodes: a fast CPU answers the part in ~4 s
    "generate": (
        "stages.generate tiny-a",
        {"generate": {"enabled": True, "max_new_tokens": 200}},
        after(0, "generate turn 1"),
    ),
    "tokenize": ("stages.tokenize big", {"tokenize": {"workers": 2}}, has_children(2)),
    "extract": ("stages.extract long", {"extract": {"writers": 2}}, has_children(2)),
    "teacher": ("stages.teacher tiny-a", {"teacher": {"workers": 2, "unit_mb": 0.01}}, has_children(2)),
    "train": ("stages.train", {"train": {"epochs": 500}}, after(2, "training batches read")),
    "evaluate": ("stages.evaluate", {"evaluate": {"questions": 80, "max_new_tokens": 64}}, after(10)),
}
SIGNALS = {
    "target": signal.SIGTERM,
    "synthetic": signal.SIGINT,
    "generate": signal.SIGHUP,
    "tokenize": signal.SIGTERM,
    "extract": signal.SIGTERM,
    "teacher": signal.SIGINT,
    "train": signal.SIGHUP,
    "evaluate": signal.SIGTERM,
}


@pytest.fixture(scope="module")
def workspace(built, tmp_path_factory):
    import shutil

    dst = tmp_path_factory.mktemp("signals") / "repo"
    shutil.copytree(built[0], dst, symlinks=True)
    # parts long enough that worker processes are caught at work: `big` to tokenize, and `long` (tokenized
    # here) to extract: on a fast CPU tiny-a's loop ends before its writer processes are up, and the
    # signal could come after the stage had ended
    lines = (dst / "data/generated/tiny-a.jsonl").read_text().splitlines()
    for part, copies in (("big", 2000), ("long", 100)):
        rows = [json.dumps({**json.loads(x), "id": f"{i}"}) for i, x in enumerate(lines * copies)]
        (dst / f"data/generated/{part}.jsonl").write_text("\n".join(rows) + "\n")
    sh("python -m stages.tokenize long", dst, env_extra={"PYTHONPATH": str(REPO)})
    return dst


@pytest.mark.parametrize("name", list(CASES))
def test_a_signal_ends_the_stage_and_everything_it_started(workspace, name):
    module_args, over, ready = CASES[name]
    sig = SIGNALS[name]
    own = (workspace / "params.yaml").read_text()
    params = yaml.safe_load(own)
    base = yaml.safe_load((REPO / "params.yaml").read_text())
    for section, keys in over.items():
        params[section] = {**base[section], **params.get(section, {}), **keys}
    (workspace / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    tag = f"EAGLENEST_SIGNAL_TEST={uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", tag.split("=")[0]: tag.split("=")[1]}
    log = workspace / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", *module_args.split()], cwd=workspace, env=env,
                                stdout=out, stderr=subprocess.STDOUT, preexec_fn=as_a_background_job)  # fmt: skip
    try:
        t0 = time.time()
        while not ready(proc, log.read_text(errors="replace"), time.time() - t0):
            assert proc.poll() is None, f"{name} ended before it could be signalled:\n{log.read_text()[-3000:]}"
            assert time.time() - t0 < 300, f"{name} never became ready:\n{log.read_text()[-3000:]}"
            time.sleep(0.1)
        started = len(descendants(proc.pid))
        proc.send_signal(sig)
        t_sig = time.time()
        while tagged(tag) and time.time() - t_sig < 10:
            time.sleep(0.1)
        left = tagged(tag)  # a zombie has no environment: the stage itself counts once it has ended
        try:
            code = proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            code = None
    finally:
        for pid in tagged(tag):
            os.kill(pid, signal.SIGKILL)
        proc.wait()
    text = log.read_text(errors="replace")
    assert not left, f"{name}: {len(left)} process(es) still running 10 s after {sig.name}:\n{text[-2000:]}"
    assert code is not None and code != 0, (name, code)
    assert "Traceback" not in text and "interrupted" in text, text[-3000:]
    if name in ("extract", "teacher", "tokenize"):
        assert started >= 2  # its writer or pool processes were running when the signal came
    (workspace / "params.yaml").write_text(own)  # the next case starts from the clone's own params


FINALIZER = """
import time
from eaglenest.runtime.errors import exit_on_error

class Slow:
    def __del__(self):
        print("finalizing", flush=True)
        time.sleep(5)  # the signal lands here, where an exception cannot propagate

@exit_on_error
def main():
    Slow()
    time.sleep(20)
    print("ran on to the end", flush=True)

main()
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_that_lands_in_a_finalizer_still_ends_the_command(tmp_path, sig):
    """Python cannot raise out of a `__del__` (the garbage collector's, at any moment): the exception a
    signal raises there is printed as "Exception ignored" and the command runs on. It is delivered
    again where ordinary code runs next, so the command still ends at once, with its one line."""
    (tmp_path / "slow.py").write_text(FINALIZER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "slow.py"], cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, preexec_fn=as_a_background_job)  # fmt: skip
    assert proc.stdout.readline().strip() == "finalizing"
    t = time.time()
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, out
    assert time.time() - t < 8, "it ended only when the finalizer's sleep was over, or later"
    assert f"interrupted by {sig.name}" in out and "Traceback" not in out and "ran on" not in out, out
