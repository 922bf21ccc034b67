"""A profile's `dvc repro`, and DVC experiments beside it, in a work repo on the host, under a budget
of seconds a command: each stage runs on its own (`dvc repro --single-item`), timed; at the budget the
running stage is interrupted (training saves a checkpoint), and the next command goes on from there.
A run may also go on in the background (`detach`), followed by `wait`, stopped by `stop`.

The work repo (--workdir) is a copy of this checkout's code with the profile applied; its dvc.lock,
DVC cache and data are its own and stay between commands while the host is up. The runner's own
records (stage times, disk, logs) are in <work>/.offline_gpu/."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
STATE = ".offline_gpu"
TIMES, DISK, EXPS, QUEUED = (f"{STATE}/{n}.json" for n in ("times", "disk", "experiments", "queued"))
RUN_LOG, RUN_PID, LOCK_OK = f"{STATE}/run.log", f"{STATE}/run.pid", f"{STATE}/dvc.lock.ok"
NOT_CODE = {".git", ".carry", ".venv", ".venv-sglang", ".venv-vllm", "data", "metrics", "reports", "dvc.lock",
            ".eaglenest", "dvclive", "__pycache__", ".pytest_cache", ".ruff_cache", STATE}  # fmt: skip


def sh(cmd: list[str], work: Path, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=work, check=True, text=True, **kw)


def commit(work: Path, message: str) -> None:
    sh(["git", "-c", "user.email=run@eaglenest", "-c", "user.name=run", "commit", "-q", "--allow-empty", "-m",
        message], work)  # fmt: skip


def record(work: Path, rel: str, key: str | None = None, value=None):
    """A small JSON record of the runner: read it (key None), or set one key (a callable: of the old value)."""
    path = work / rel
    rows = json.loads(path.read_text()) if path.exists() else {}
    if key is None:
        return rows
    rows[key] = value(rows.get(key)) if callable(value) else value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1))
    return rows


def setup(work: Path, profile: str, sets: list[str]) -> None:
    """This checkout's code into the work repo, the profile (`default`: params.yaml as it is) and the
    -S `section.key=yaml` overrides applied by the profile rule (each key must exist), committed."""
    sys.path.insert(0, str(REPO))
    from eaglenest import profile as prof

    fresh = not work.exists()
    work.mkdir(parents=True, exist_ok=True)
    for item in (i for i in REPO.iterdir() if i.name not in NOT_CODE):
        if item.is_dir():
            shutil.copytree(item, work / item.name, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "out"))  # fmt: skip
        else:
            shutil.copy2(item, work / item.name)
    if fresh:  # DVC's .gitignore files and part pointers, and the lock the outputs came from
        keep = lambda p, names: [
            n for n in names if not (n.endswith(".dvc") or n == ".gitignore" or (Path(p) / n).is_dir())
        ]  # noqa: E501, E731
        for d in ("data", "metrics", "reports"):
            shutil.copytree(REPO / d, work / d, dirs_exist_ok=True, ignore=keep)
        if (REPO / "dvc.lock").exists():
            shutil.copy2(REPO / "dvc.lock", work / "dvc.lock")
    changes = [] if profile == "default" else prof.apply(work / "profiles" / f"{profile}.yaml", work / "params.yaml")
    changes += prof.apply_sets(sets, work / "params.yaml", work / STATE / "set.yaml")
    local = work / ".dvc" / "config.local"
    if not local.exists():  # hash tens of GB with every core (DVC's default is 4 threads)
        local.write_text(f"[core]\n    checksum_jobs = {os.cpu_count() or 4}\n")
    print(f"{work}: profile {profile}, {len(changes)} key(s) set")
    if not (work / ".git").exists():
        sh(["git", "init", "-q"], work)
    # the runner's own records (STATE) are in .gitignore: naming them here too makes git add fail
    sh(["git", "add", "-A", "--", ".", ":!data", ":!metrics", ":!reports"], work)
    commit(work, f"profile {profile}")


def stages(work: Path) -> list[str]:
    lock, ok = work / "dvc.lock", work / LOCK_OK
    # an interrupted stage once left dvc.lock empty, and DVC then refuses every command
    if lock.exists() and not isinstance(yaml.safe_load(lock.read_text()), dict) and ok.exists():
        print(f"dvc.lock was left unreadable; restored the copy taken after the last finished stage ({LOCK_OK})")
        shutil.copy2(ok, lock)
    out = sh(["dvc", "stage", "list", "--name-only"], work, capture_output=True).stdout
    return out.split()


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def stream(cmd: list[str], work: Path, log_name: str, deadline: float) -> tuple[int, list[str]]:
    """cmd in a process session of its own, its output teed to <STATE>/logs/<log_name>.log. At the
    deadline (TimeoutError) or when this process is interrupted (SIGINT, SIGTERM: `stop`), SIGINT to
    that session, then SIGKILL after 30 s, and the exception raised again."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
    p = subprocess.Popen(cmd, cwd=work, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True)  # fmt: skip
    log = work / STATE / "logs" / f"{log_name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    try:
        with open(log, "a") as f:
            for line in p.stdout:
                lines.append(line)
                f.write(line)
                f.flush()
                if "Running stage" in line or "ERROR" in line or "INFO" in line or line.startswith("20"):
                    print(line, end="", flush=True)
                if time.time() > deadline:
                    raise TimeoutError
        p.wait()
    except (TimeoutError, KeyboardInterrupt):
        os.killpg(p.pid, signal.SIGINT)  # DVC cleans up on an interrupt; the trainer keeps its checkpoint
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
        raise
    return p.returncode, lines


def add_time(work: Path, key: str, seconds: float) -> dict:
    return record(work, TIMES, key, lambda old: round((old or 0) + seconds, 1))


def record_disk(work: Path, stage: str) -> dict:
    u = shutil.disk_usage(work)
    return record(work, DISK, stage, {"used_gb": round(u.used / 1e9, 1), "free_gb": round(u.free / 1e9, 1)})[stage]


def run(work: Path, budget: float, min_left: float, until: str | None = None) -> bool:
    """Each stage in pipeline order (through `until`'s, if given) while the budget lasts; True once all are done."""
    t0, todo = time.time(), stages(work)
    if "start" not in record(work, DISK):
        record_disk(work, "start")  # the baseline: the pipeline's own disk is used_gb minus this
    if until:
        kinds = [s.split("@")[0] for s in todo]
        if until not in kinds:
            sys.exit(f"--until {until}: no such stage (stages: {', '.join(dict.fromkeys(kinds))})")
        todo = todo[: len(kinds) - kinds[::-1].index(until)]
    for stage in todo:
        if budget - (time.time() - t0) < min_left:
            print(f"budget spent; next: {stage}")
            return False
        t = time.time()
        try:
            rc, lines = stream(["dvc", "repro", "--single-item", stage], work, stage, t0 + budget)
        except (TimeoutError, KeyboardInterrupt) as e:
            add_time(work, stage, time.time() - t)
            why = "at the budget" if isinstance(e, TimeoutError) else f"on {e or 'an interrupt'}"
            print(f"stopped {stage} {why} after {time.time() - t:.0f} s; it resumes next call")
            return False
        if rc != 0:
            print("".join(lines[-40:]))
            sys.exit(f"{stage} failed ({rc})")
        shutil.copy2(work / "dvc.lock", work / LOCK_OK)
        if any("Running stage" in ln for ln in lines):
            times, disk = add_time(work, stage, time.time() - t), record_disk(work, stage)
            print(f"== {stage}: {times[stage]:.1f} s; disk {disk['used_gb']} GB used, {disk['free_gb']} free",
                  flush=True)  # fmt: skip
    sh(["git", "add", "dvc.lock"], work)  # experiments start from it; `restore` returns to it
    commit(work, "dvc.lock")
    print(f"stages done through {until}" if until else "all stages done")
    return True


def detach(work: Path, argv: list[str]) -> None:
    """`run` (argv: its options) in a process session of its own, which outlives the command that starts it."""
    log = work / RUN_LOG
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, "-m", "tools.offline_gpu", "--workdir", str(work), "run", *argv],
                             cwd=REPO, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    (work / RUN_PID).write_text(str(p.pid))
    print(f"running in the background (pid {p.pid}, log {log}); follow it with `wait`")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except (ProcessLookupError, FileNotFoundError):
        return False


def running_pid(work: Path) -> int | None:
    path = work / RUN_PID
    pid = int(path.read_text()) if path.exists() else None
    return pid if pid is not None and alive(pid) else None


def stop(work: Path, timeout: float = 90) -> None:
    """A detached run stopped as its budget would stop it (the trainer saves a checkpoint); returns once it exited."""
    pid = running_pid(work)
    if pid is None:
        print("no run going")
        return
    os.kill(pid, signal.SIGTERM)
    t0 = time.time()
    while alive(pid):
        if time.time() - t0 > timeout:
            os.killpg(pid, signal.SIGKILL)
            sys.exit(f"run {pid} did not stop in {timeout:.0f} s after SIGTERM: killed (its checkpoint may be older)")
        time.sleep(1)
    print(f"run {pid} stopped after {time.time() - t0:.0f} s")


def wait(work: Path, budget: float) -> None:
    """A detached run's log as it grows, until it ends (exit 0 if it finished, 1 if not) or the
    budget is spent (exit 3: still running, call again)."""
    log, pid = work / RUN_LOG, int((work / RUN_PID).read_text())
    t0, shown = time.time(), 0
    while True:
        running = alive(pid)
        text = log.read_text(errors="replace")
        print(text[shown:], end="", flush=True)
        shown = len(text)
        if not running:
            break
        if time.time() - t0 > budget:
            print(f"still running after {time.time() - t0:.0f} s (pid {pid}); call wait again", flush=True)
            sys.exit(3)
        time.sleep(5)
    if "all stages done" not in text and "stages done through" not in text:
        sys.exit("the background run ended unfinished (its log is above)")


def enqueue(work: Path, name: str, sets: list[str]) -> None:
    """`dvc exp run --queue -n NAME -S ...` from the committed profile; a name queued before is left as it is."""
    if record(work, QUEUED).get(name) is not None:
        print(f"{name}: queued before")
        return
    sh(["git", "checkout", "HEAD", "--", "params.yaml"], work)
    sh(["dvc", "exp", "run", "--queue", "-n", name, *[a for s in sets for a in ("-S", s)]], work)
    record(work, QUEUED, name, sets)
    print(f"queued {name}: {' '.join(sets)}")


def queue_status(work: Path) -> dict[str, str]:
    """{experiment: Queued | Running | Success | Failed}, from `dvc queue status`'s rows."""
    out = sh(["dvc", "queue", "status"], work, capture_output=True).stdout
    states = ("Queued", "Running", "Success", "Failed")
    return {f[1]: f[-1] for f in (line.split() for line in out.splitlines()) if len(f) >= 4 and f[-1] in states}


def train_speed(work: Path, name: str) -> dict:
    """An experiment's training speed, from the train stage's last line in its log: its
    reports/timing (not an output: a clock is no result) stays in the experiment's own workspace."""
    out = subprocess.run(["dvc", "queue", "logs", name], cwd=work, text=True, capture_output=True).stdout
    found = re.findall(r"trained \d+ epochs: ([\d.]+) tokens/s over ([\d.]+) s", out)
    return {"tokens_per_s": float(found[-1][0]), "wall_s": float(found[-1][1])} if found else {}


def epoch_curve(work: Path) -> dict:
    """The val loss and simulated τ after each epoch, from the train stage's DVCLive plots: where a
    short screen's run was still heading."""
    out = {}
    for name in ("loss", "simulated_tau"):
        tsv = work / "dvclive" / "plots" / "metrics" / "val" / f"{name}.tsv"
        if tsv.exists():
            out[name] = [round(float(line.split("\t")[1]), 4) for line in tsv.read_text().splitlines()[1:] if line]
    return out


def run_queue(work: Path, jobs: int, budget: float) -> None:
    """The queued experiments side by side (`dvc queue start -j JOBS`: DVC's own workers), polled until
    none is left or the budget is spent (the workers go on; call again). Each finished one is applied,
    its reports recorded in <STATE>/experiments.json, and the profile's workspace put back; a failed
    one is recorded with its log and forgotten, so the next `enqueue` queues it again."""
    t0, queued, state = time.time(), record(work, QUEUED), queue_status(work)
    if "Queued" in state.values() and "Running" not in state.values():
        sh(["dvc", "queue", "start", "-j", str(jobs)], work)
    while {"Queued", "Running"} & set(state.values()) and time.time() - t0 < budget:
        time.sleep(15)
        state = queue_status(work)
    add_time(work, "exp:queue", time.time() - t0)
    print(json.dumps(state, indent=1), f"after {time.time() - t0:.0f} s", flush=True)
    saved = work / STATE / "baseline"
    shutil.rmtree(saved, ignore_errors=True)
    for d in ("metrics", "reports"):
        shutil.copytree(work / d, saved / d)
    for name, st in state.items():
        if queued.get(name) is None or name in record(work, EXPS) or st not in ("Success", "Failed"):
            continue
        row = {"set": queued[name], "exit": 0 if st == "Success" else 1}
        if st == "Failed":
            row["log"] = subprocess.run(["dvc", "queue", "logs", name], cwd=work, text=True,
                                        capture_output=True).stdout[-6000:]  # fmt: skip
            subprocess.run(["dvc", "queue", "remove", name], cwd=work, capture_output=True)
            record(work, QUEUED, name, None)
        else:
            sh(["dvc", "exp", "apply", name], work)
            for rel in ("evaluate.json", "train.json", "pack.json", "evaluate_questions.json"):
                if (work / "reports" / rel).exists():
                    row[rel.removesuffix(".json")] = json.loads((work / "reports" / rel).read_text())
            row["timing/train"] = train_speed(work, name)
            row["curve"] = epoch_curve(work)
            sh(["git", "checkout", "HEAD", "--", "params.yaml", "dvc.lock"], work)
            for d in ("metrics", "reports"):
                shutil.rmtree(work / d)
                shutil.copytree(saved / d, work / d)
            sh(["dvc", "checkout", "--quiet"], work)
        record(work, EXPS if st == "Success" else f"{STATE}/failed.json", name, row)
        print(f"== experiment {name}: {st}, tau {row.get('evaluate', {}).get('tau')}", flush=True)
