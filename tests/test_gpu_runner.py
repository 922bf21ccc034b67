"""bench/gpu_profile.py's runner of `dvc repro` on GPU hosts without internet, under a job time limit:
`stop` (SIGTERM to a detached run) reaches the stage running in DVC's own process session, as the
budget does, so a training stage saves its checkpoint and no stage is left running without its runner."""

import os
import subprocess
import sys
import time
from pathlib import Path

from bench import gpu_profile as gp

from .conftest import REPO, sh

STAGE = """import signal, sys, time
def stop(signum, frame):  # as stages.train: finish the step, save a checkpoint, exit non-zero
    open("checkpoint.txt", "w").write(signal.Signals(signum).name)
    sys.exit(1)
signal.signal(signal.SIGINT, stop)
open("started.txt", "w").write("yes")
time.sleep(600)
"""


def test_stop_interrupts_the_stage_in_dvc_and_the_run_exits(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "stop_test_stage.py").write_text(STAGE)
    (work / "dvc.yaml").write_text(
        "stages:\n  train:\n    cmd: python stop_test_stage.py\n    deps: [stop_test_stage.py]\n    outs: [out]\n"
    )
    sh("git init -q && dvc init -q", work)
    runner = f"from pathlib import Path; from bench import gpu_profile as gp; gp.run(Path({str(work)!r}), 600, 0)"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    with open(tmp_path / "run.log", "w") as log:  # as gp.detach starts it: a session of its own
        p = subprocess.Popen(
            [sys.executable, "-c", runner],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        (work / gp.RUN_PID).parent.mkdir(parents=True, exist_ok=True)
        (work / gp.RUN_PID).write_text(str(p.pid))
        for _ in range(120):
            if (work / "started.txt").exists():
                break
            time.sleep(0.5)
        assert (work / "started.txt").exists(), (tmp_path / "run.log").read_text()
        gp.stop(work)
        assert p.wait(5) == 0  # the runner returned (the stage resumes next call), no traceback
        assert (work / "checkpoint.txt").read_text() == "SIGINT"  # the stage saw the interrupt
        log = (tmp_path / "run.log").read_text()
        assert "stopped train on signal SIGTERM" in log, log
        assert "train" in gp.read_json(work, gp.TIMES)  # its time so far is kept
        left = subprocess.run(["pgrep", "-f", "python stop_test_stage.py"], capture_output=True, text=True).stdout
        assert not left.strip(), f"the stage outlived its runner: {left}"
        assert gp.running_pid(work) is None
    finally:  # nothing, unless an assert failed: no stage outlives the test
        subprocess.run(["pkill", "-f", "python stop_test_stage.py"])
        p.kill()
