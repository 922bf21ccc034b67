"""A profile's `dvc repro` on a host without internet (bench/gpu_carry.py brings the packages), whose
commands may be cut off after a while (the lent GPU machines': 10 minutes a call).

    python -m bench.gpu_profile setup [--profile gpu|default] [-S section.key=yaml ...]
        copy this checkout's code to a work repo outside it (--workdir, default ~/run: it survives
        between calls while the machine is warm, and its dvc.lock and DVC cache are the machine's
        own), apply the profile (and -S overrides) to its params.yaml, git-commit it.
    python -m bench.gpu_profile run [--budget 540] [--until STAGE] [--detach]
        `dvc repro --single-item` each stage in pipeline order, timing each; starts no stage once the
        budget is spent, and stops a stage still running at the budget (training resumes from its
        checkpoint next call). Prints what is left. --until pack: no stage after pack (e.g. to train
        another model on the packed data: bench.specforge_train). --detach: the same in a process of
        its own session, which outlives the bounded command that starts it (the machine stays while calls
        follow back to back), so a run longer than one call is measured uncut: `--detach --budget 1700`.
    python -m bench.gpu_profile wait [--budget 560]
        follow a detached run's log; exit 0 once it has finished, 3 while it still runs at the budget
        (call again), 1 if it ended unfinished. `wait --budget 560 && ... report` in each call.
    python -m bench.gpu_profile exp NAME [-S section.key=yaml ...] [--budget 540]
        one ablation: `dvc exp run -n NAME -S ...` from the committed profile, its metrics appended to
        bench/out/gpu_experiments.json (and to the report's "experiments").
    python -m bench.gpu_profile enqueue NAME [-S section.key=yaml ...]   (then)   queue [--jobs 4] [--budget 540]
        ablations side by side: each queued as a DVC experiment, then run by DVC's queue workers at once
        (`dvc queue start -j`), each recorded like `exp`'s when it is done; the same `queue` command
        waits again if the budget ends first.
    python -m bench.gpu_profile report [--out DIR] [--with-drafter]
        gathers the stage times and reports into gpu_profile.json (bench/results/ format); the
        exported drafter too only with --with-drafter (weights do not belong in bench/results/).

Each call starts by running `setup` again: code edits here reach the machine, the work repo's
dvc.lock and data stay. See bench/gpu_carry.py for getting the packages and data there first."""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SKIP = {
    ".git",
    ".carry",
    ".venv",
    ".venv-sglang",
    "data",
    "metrics",
    "reports",
    "dvc.lock",
    ".eaglenest",
    "dvclive",
    "__pycache__",
    ".pytest_cache",
}
TIMES = "bench/out/gpu_profile_times.json"


def sh(cmd: list[str], cwd: Path, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, check=True, text=True, **kw)


def commit(work: Path, message: str) -> None:
    sh(["git", "-c", "user.email=gpu@eaglenest", "-c", "user.name=gpu", "commit", "-q", "--allow-empty", "-m", message],
       work)  # fmt: skip


def apply_sets(sets: list[str], params: Path, scratch: Path) -> list:
    """`section.key=yaml value` overrides onto a params file, by the profile rule (each key must exist
    there: eaglenest.profile.apply); scratch holds them as a profile file. Returns the changes."""
    if not sets:
        return []
    import yaml

    sys.path.insert(0, str(REPO))
    from eaglenest import profile as prof

    extra = {}
    for s in sets:
        key, value = s.split("=", 1)
        section, name = key.split(".", 1)
        extra.setdefault(section, {})[name] = yaml.safe_load(value)
    scratch.parent.mkdir(parents=True, exist_ok=True)
    scratch.write_text(yaml.safe_dump(extra))
    return prof.apply(scratch, params)


def setup(work: Path, profile: str, sets: list[str]) -> None:
    sys.path.insert(0, str(REPO))
    from eaglenest import profile as prof

    fresh = not work.exists()
    work.mkdir(parents=True, exist_ok=True)
    for item in REPO.iterdir():
        if item.name in SKIP:
            continue
        dst = work / item.name
        if item.is_dir():
            shutil.copytree(
                item, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", "cache", "tmp", "out")
            )
        else:
            shutil.copy2(item, dst)
    if fresh:  # DVC's .gitignore files (DVC adds the profile's outputs to them) and part pointers
        for d in ("data", "metrics", "reports"):
            shutil.copytree(
                REPO / d,
                work / d,
                dirs_exist_ok=True,
                ignore=lambda p, names: [
                    n for n in names if not (n.endswith(".dvc") or n == ".gitignore" or (Path(p) / n).is_dir())
                ],
            )
        if (REPO / "dvc.lock").exists():
            shutil.copy2(REPO / "dvc.lock", work / "dvc.lock")
    # "default": params.yaml as it is (the CPU default's recipe, e.g. its drafter for bench checks)
    changes = [] if profile == "default" else prof.apply(work / "profiles" / f"{profile}.yaml", work / "params.yaml")
    changes += apply_sets(sets, work / "params.yaml", work / "bench" / "out" / "set.yaml")
    local = work / ".dvc" / "config.local"
    if not local.exists():  # hash tens of GB with every core (DVC's default is 4 threads)
        local.write_text(f"[core]\n    checksum_jobs = {os.cpu_count() or 4}\n")
    print(f"{work}: profile {profile}, {len(changes)} key(s) set")
    if Path("/dev/shm").is_dir():  # extraction's piece buffers: a window of pieces + the writers' (GBs)
        print(f"/dev/shm: {shutil.disk_usage('/dev/shm').free / 1e9:.1f} GB free")
    if not (work / ".git").exists():
        sh(["git", "init", "-q"], work)
    # data/, metrics/ and reports/ hold DVC outputs: DVC refuses an output that git tracks
    sh(["git", "add", "-A", "--", ".", ":!data", ":!metrics", ":!reports"], work)
    commit(work, "gpu profile")


LOCK_OK = "bench/out/dvc.lock.ok"


def keep_lock(work: Path) -> None:
    """A copy of dvc.lock after each finished stage: an interrupted stage once left dvc.lock empty
    (pack stopped at the budget), and DVC then refuses every command."""
    shutil.copy2(work / "dvc.lock", work / LOCK_OK)


def check_lock(work: Path) -> None:
    import yaml

    lock, ok = work / "dvc.lock", work / LOCK_OK
    if lock.exists() and not isinstance(yaml.safe_load(lock.read_text()), dict) and ok.exists():
        print(f"dvc.lock was left unreadable; restored the copy taken after the last finished stage ({LOCK_OK})")
        shutil.copy2(ok, lock)


def stages(work: Path) -> list[str]:
    check_lock(work)
    out = subprocess.run(
        ["dvc", "stage", "list", "--name-only"], cwd=work, check=True, text=True, capture_output=True
    ).stdout
    return [s for s in out.split() if s]


def raise_on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def stream(cmd: list[str], work: Path, log_name: str, deadline: float) -> tuple[int, list[str]]:
    """Run cmd, teeing its output to bench/out/logs/<log_name>.log; SIGINT (then SIGKILL) at the
    deadline, raising TimeoutError, or when this process is interrupted (SIGINT, SIGTERM: `stop`),
    re-raising: cmd runs in a session of its own, which a signal to this one's would not reach.
    Returns (exit code, output lines)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, raise_on_sigterm)
    p = subprocess.Popen(
        cmd, cwd=work, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    lines = []
    log = work / "bench" / "out" / "logs" / f"{log_name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        for line in p.stdout:
            lines.append(line)
            with open(log, "a") as f:
                f.write(line)
            if "Running stage" in line or "ERROR" in line or line.startswith("20") or "INFO" in line:
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


def read_json(work: Path, rel: str, default=None):
    """A small JSON record under the work repo (bench/out), or `default` where there is none yet."""
    path = work / rel
    return json.loads(path.read_text()) if path.exists() else default


def update_json(work: Path, rel: str, key: str, value) -> dict:
    """One key of a small JSON record under the work repo (bench/out), read, set and written back."""
    path = work / rel
    rows = read_json(work, rel, {})
    rows[key] = value(rows.get(key)) if callable(value) else value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1))
    return rows


def add_time(work: Path, key: str, seconds: float) -> dict:
    return update_json(work, TIMES, key, lambda old: round((old or 0) + seconds, 1))


DISK = "bench/out/gpu_profile_disk.json"


def record_disk(work: Path, stage: str) -> dict:
    """The disk after each stage: how much more data (`turns`, parts) the machine's disk can take."""
    u = shutil.disk_usage(work)
    row = {"used_gb": round(u.used / 1e9, 1), "free_gb": round(u.free / 1e9, 1)}
    return update_json(work, DISK, stage, row)[stage]


def run(work: Path, budget: float, min_left: float, until: str | None = None) -> bool:
    """Each stage in pipeline order, until the budget; True once every stage asked for is done."""
    t0 = time.time()
    todo = stages(work)
    if "start" not in (read_json(work, DISK) or {}):
        record_disk(work, "start")  # the baseline: the pipeline's own disk is used_gb minus this
    if until:
        kinds = [st.split("@")[0] for st in todo]
        if until not in kinds:
            sys.exit(f"--until {until}: no such stage (stages: {', '.join(dict.fromkeys(kinds))})")
        todo = todo[: len(kinds) - kinds[::-1].index(until)]
    for stage in todo:
        left = budget - (time.time() - t0)
        if left < min_left:
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
        keep_lock(work)
        if any("Running stage" in ln for ln in lines):
            times = add_time(work, stage, time.time() - t)
            disk = record_disk(work, stage)
            print(
                f"== {stage}: {times[stage]:.1f} s; disk {disk['used_gb']} GB used, {disk['free_gb']} free", flush=True
            )
    # committed: experiments (`exp`) start from it, and `restore` returns to it
    sh(["git", "add", "dvc.lock"], work)
    commit(work, "gpu profile: dvc.lock")
    print(f"stages done through {until}" if until else "all stages done")
    return True


RUN_LOG, RUN_PID = "bench/out/run.log", "bench/out/run.pid"


def detach(work: Path, argv: list[str], module: str = "bench.gpu_profile") -> None:
    """`python -m <module> run` (argv: its options) in a new process session, its output in
    bench/out/run.log."""
    log = work / RUN_LOG
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", module, "--workdir", str(work), "run", *argv]
    with open(log, "w") as f:
        p = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    (work / RUN_PID).write_text(str(p.pid))
    print(f"running in the background (pid {p.pid}, log {log}); follow it: python -m {module} wait")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except (ProcessLookupError, FileNotFoundError):
        return False


def running_pid(work: Path) -> int | None:
    """The pid of a detached run still going, or None."""
    path = work / RUN_PID
    pid = int(path.read_text()) if path.exists() else None
    return pid if pid is not None and alive(pid) else None


def stop(work: Path, timeout: float = 90) -> None:
    """Stop a detached run as its budget would: SIGTERM to it, which interrupts the running stage (the
    trainer finishes its step and saves a checkpoint); returns once it has exited."""
    pid = running_pid(work)
    if pid is None:
        print("no run going")
        return
    os.kill(pid, signal.SIGTERM)
    t0 = time.time()
    while alive(pid):
        if time.time() - t0 > timeout:
            os.killpg(pid, signal.SIGKILL)
            sys.exit(
                f"run {pid} did not stop in {timeout:.0f} s after SIGTERM: killed (its stage's checkpoint may be older)"
            )
        time.sleep(1)
    print(f"run {pid} stopped after {time.time() - t0:.0f} s")


def wait(work: Path, budget: float, done=("all stages done", "stages done through")) -> None:
    """Print a detached run's log as it grows until it ends (exit 0 when its log says one of `done`,
    1 otherwise) or the budget is spent (exit 3: it is still running)."""
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
    if not any(d in text for d in done):
        sys.exit("the background run ended unfinished (its log is above)")


EXPS = "bench/out/gpu_experiments.json"


def experiment(work: Path, name: str, sets: list[str], budget: float) -> None:
    """`dvc exp run -n NAME -S ...` from the committed profile (the stages it does not touch come from
    the run cache), then its metrics appended to bench/out/gpu_experiments.json. Stopped at the
    budget, it resumes (training from its checkpoint) when called again with the same arguments."""
    sh(["git", "checkout", "HEAD", "--", "params.yaml"], work)  # every experiment starts from the profile
    saved = save_baseline(work)
    t = time.time()
    cmd = ["dvc", "exp", "run", "-n", name, *[a for s in sets for a in ("-S", s)]]
    try:
        rc, lines = stream(cmd, work, f"exp-{name}", t + budget)
    except TimeoutError:
        add_time(work, f"exp:{name}", time.time() - t)
        print(f"stopped experiment {name} at the budget; run the same command again to finish it")
        rc = None
    times = add_time(work, f"exp:{name}", time.time() - t)
    if rc is not None:
        record_exp(work, name, sets, rc, times[f"exp:{name}"])
    restore(work, saved)


def record_exp(work: Path, name: str, sets: list[str], rc: int, wall_s: float | None) -> None:
    """The workspace's reports (an experiment's, run or applied) as a row of gpu_experiments.json."""
    m = work / "reports"
    row = {"name": name, "set": sets, "exit": rc, "wall_s": wall_s}
    for rel in ("evaluate.json", "train.json", "pack.json"):
        if (m / rel).exists():
            row[rel.removesuffix(".json")] = json.loads((m / rel).read_text())
    path = work / EXPS
    rows = [r for r in read_json(work, EXPS, []) if r["name"] != name]
    path.write_text(json.dumps(rows + [row], indent=1))
    ev = row.get("evaluate", {})
    print(
        f"== experiment {name} (exit {rc}, {wall_s} s): tau {ev.get('tau')}, "
        f"val tau {row.get('train', {}).get('val_simulated_tau')}",
        flush=True,
    )


QUEUED = "bench/out/gpu_queue.json"


def enqueue(work: Path, name: str, sets: list[str]) -> None:
    """`dvc exp run --queue -n NAME -S ...` from the committed profile; `queue` runs them. A name
    queued before is left as it is (a script of ablations can be called again to go on)."""
    queued = read_json(work, QUEUED, {})
    if queued.get(name) is not None:
        print(f"{name}: queued before ({' '.join(queued[name])})")
        return
    sh(["git", "checkout", "HEAD", "--", "params.yaml"], work)
    sh(["dvc", "exp", "run", "--queue", "-n", name, *[a for s in sets for a in ("-S", s)]], work)
    update_json(work, QUEUED, name, sets)
    print(f"queued {name}: {' '.join(sets)}")


def queue_status(work: Path) -> dict[str, str]:
    """{experiment name: Queued | Running | Success | Failed} from `dvc queue status`."""
    out = subprocess.run(["dvc", "queue", "status"], cwd=work, text=True, capture_output=True, check=True).stdout
    states = ("Queued", "Running", "Success", "Failed")  # rows: Task Name Created Status
    return {f[1]: f[-1] for f in (line.split() for line in out.splitlines()) if len(f) >= 4 and f[-1] in states}


def run_queue(work: Path, jobs: int, budget: float) -> None:
    """The queued experiments side by side (`dvc queue start -j JOBS`: DVC's own workers, each in a
    temporary clone whose data are links into the cache; on a GPU small drafters leave it mostly idle,
    so several train at once), polled until none is left or the budget is spent (then the workers go
    on, and the same command waits again). Each finished one is applied (`dvc exp apply`), its metrics
    recorded like `exp`'s, and the profile's workspace put back."""
    t0 = time.time()
    queued = read_json(work, QUEUED, {})
    state = queue_status(work)
    if any(v == "Queued" for v in state.values()) and not any(v == "Running" for v in state.values()):
        sh(["dvc", "queue", "start", "-j", str(jobs)], work)
    while any(v in ("Queued", "Running") for v in state.values()) and time.time() - t0 < budget:
        time.sleep(15)
        state = queue_status(work)
    add_time(work, "exp:queue", time.time() - t0)  # the side-by-side runs' wall clock, summed over calls
    print(json.dumps(state, indent=1), f"after {time.time() - t0:.0f} s", flush=True)
    done = read_json(work, EXPS, [])
    recorded = {r["name"] for r in done}
    saved = save_baseline(work)
    for name, st in state.items():
        if queued.get(name) is None or name in recorded or st not in ("Success", "Failed"):
            continue
        if st == "Failed":  # DVC keeps no results of a failed queued run (the quality gate's exit
            # too): its log is the record; `exp NAME` in the workspace keeps the metrics of a failure
            log = subprocess.run(["dvc", "queue", "logs", name], cwd=work, text=True, capture_output=True).stdout
            print(f"== experiment {name} failed:\n{log[-3000:]}")
            update_json(work, "bench/out/gpu_queue_failed.json", name, log[-6000:])
            # forgotten by the queue and by `enqueue`: the next `enqueue NAME` queues it again
            subprocess.run(["dvc", "queue", "remove", name], cwd=work, text=True, capture_output=True)
            update_json(work, QUEUED, name, None)
            continue
        sh(["dvc", "exp", "apply", name], work)
        record_exp(work, name, queued[name], 0, None)
        restore(work, saved)


def save_baseline(work: Path) -> Path:
    """A copy of the profile's own metrics and reports, which `restore` puts back after an experiment."""
    saved = work / "bench" / "out" / "baseline"
    shutil.rmtree(saved, ignore_errors=True)
    for d in ("metrics", "reports"):
        shutil.copytree(work / d, saved / d)
    return saved


def restore(work: Path, saved: Path) -> None:
    """The profile's params, dvc.lock, metrics and outputs back in the work repo."""
    sh(["git", "checkout", "HEAD", "--", "params.yaml", "dvc.lock"], work)
    for d in ("metrics", "reports"):
        shutil.rmtree(work / d)
        shutil.copytree(saved / d, work / d)
    sh(["dvc", "checkout", "--quiet"], work)


def du(path: Path) -> int:
    """Bytes on disk under path (hard links once)."""
    return int(subprocess.run(["du", "-sB1", str(path)], capture_output=True, text=True).stdout.split()[0])


def footprint(work: Path) -> dict:
    """The pipeline's disk: the workspace's data/ and the DVC cache (du, hard links counted once, as DVC
    links them), the df rise since the run started, and one `dvc status` over every stage, timed."""
    disk = read_json(work, DISK) or {}
    t = time.time()
    clean = subprocess.run(["dvc", "status", "-q"], cwd=work, capture_output=True).returncode == 0
    status_s = time.time() - t
    data, cache = du(work / "data"), du(work / ".dvc" / "cache")
    both = int(subprocess.run(["du", "-sB1", "-c", str(work / "data"), str(work / ".dvc" / "cache")],
                              capture_output=True, text=True).stdout.splitlines()[-1].split()[0])  # fmt: skip
    return {
        "workspace_data_gb": round(data / 1e9, 2),
        "dvc_cache_gb": round(cache / 1e9, 2),
        "workspace_and_cache_gb": round(both / 1e9, 2),
        "df_rise_gb": round(disk["evaluate"]["used_gb"] - disk["start"]["used_gb"], 1) if "start" in disk else None,
        "dvc_status_s": round(status_s, 2),
        "dvc_status_clean": clean,
        "link_type": subprocess.run(
            ["dvc", "config", "cache.type"], cwd=work, capture_output=True, text=True
        ).stdout.strip()
        or "dvc default (reflink, copy)",
    }


def report(work: Path, out: Path, with_drafter: bool = False) -> None:
    r = work / "reports"

    def load(rel):
        p = r / rel
        return json.loads(p.read_text()) if p.exists() else {}

    import yaml

    parts = set(yaml.safe_load((work / "params.yaml").read_text())["data"]["parts"])

    def each(stage, under=r):  # the run's parts only: reports of parts an earlier config had stay in reports/
        return {p.stem: json.loads(p.read_text()) for p in (under / stage).glob("*.json") if p.stem in parts}

    times = {k: v for k, v in json.loads((work / TIMES).read_text()).items() if not k.startswith("exp:")}
    ev, tr, pk, ev_time = load("evaluate.json"), load("train.json"), load("pack.json"), load("timing/evaluate.json")
    gen, gen_time, ext, tok = each("generate"), each("generate", r / "timing"), each("extract"), each("tokenize")
    wall = each("extract", r / "timing")  # the stage's own wall clock split: forward loop vs each fixed cost
    cut = list(each("sharegpt").values())
    by_kind = {}
    for stage, s in times.items():
        kind = stage.split("@")[0]
        by_kind[kind] = round(by_kind.get(kind, 0) + s, 1)
    res = {
        "tau": ev.get("tau"),
        "accept_per_position": ev.get("accept_rate_per_position"),
        "questions": ev.get("questions"),
        "identical_to_greedy": ev.get("identical_to_greedy"),
        "speedup": {k: v["speedup"] for k, v in ev_time.get("k", {}).items()},
        "tokens_per_s_plain": ev_time.get("tokens_per_s_plain"),
        "tokens_per_s_spec": {k: v["tokens_per_s"] for k, v in ev_time.get("k", {}).items()},
        "break_even_tau": {k: v["break_even_tau"] for k, v in ev_time.get("k", {}).items()},
        "max_new_tokens": ev.get("max_new_tokens"),
        "specforge_tau_ratio": None,
        "wall_s": {"total": round(sum(times.values()), 1), **by_kind},
        "wall_s_per_stage": times,
        "disk_after_stage": read_json(work, DISK),
        "conversations": sum(c.get("conversations", 0) for c in cut),
        "samples": sum(g.get("conversations_kept", g.get("conversations", 0)) for g in gen.values()),
        "generate": {
            "turns_regenerated": sum(g.get("regenerated", 0) for g in gen.values()),
            "turns_total": sum(g.get("assistant_turns", 0) for g in gen.values()),
            "cut_at_max_tokens": sum(g.get("cut_at_max_tokens", 0) for g in gen.values()),
            "cut_at_context": sum(g.get("cut_at_context", 0) for g in gen.values()),
            "skipped_context": sum(g.get("skipped_context", 0) for g in gen.values()),
            "skipped_empty": sum(g.get("skipped_empty", 0) for g in gen.values()),
            "generated_tokens": sum(g.get("generated_tokens", 0) for g in gen.values()),
            "decode_s": round(sum(g.get("decode_s", 0) for g in gen_time.values()), 1),
        },
        "tokenized_tokens": sum(t.get("tokens", 0) for t in tok.values()),
        "loss_tokens": sum(t.get("loss_tokens", 0) for t in tok.values()),
        "extract": {
            k: {
                "gate_passed": e.get("validation", {}).get("passed"),
                **{f: wall.get(k, {}).get(f) for f in ("tokens_per_s", "wall_s", "forward_s", "fixed_cost")},
            }
            for k, e in ext.items()
        },
        "train_tokens": pk.get("train_tokens"),
        "pack": pk,
        "train": {
            k: tr.get(k)
            for k in (
                "epochs",
                "steps",
                "train_loss",
                "val_loss",
                "val_acc_per_step",
                "val_simulated_tau",
            )
        },
    }
    res["train"]["tokens_per_s"] = load("timing/train.json").get("tokens_per_s")
    res["tree"] = {
        name: {
            "tau": ev["tau"][name],
            "identical_to_greedy": ev["identical_to_greedy"][name],
            "accept_per_depth": ev["accept_rate_per_position"][name],
            "speedup": t["speedup"],
            "tokens_per_s": t["tokens_per_s"],
        }
        for name, t in ev_time.get("tree", {}).items()
    }
    res["best_k"], res["best_tree"] = ev_time.get("best_k"), ev_time.get("best_tree")
    res["footprint"] = footprint(work)
    g = res["generate"]
    g["tokens_per_s"] = round(g["generated_tokens"] / g["decode_s"], 1) if g["decode_s"] else None
    out.mkdir(parents=True, exist_ok=True)
    if (work / EXPS).exists():
        res["experiments"] = [
            {
                "name": r["name"],
                "set": r["set"],
                "exit": r["exit"],
                "wall_s": r["wall_s"],
                "tau": r.get("evaluate", {}).get("tau"),
                "accept_per_position": r.get("evaluate", {}).get("accept_rate_per_position"),
                "identical_to_greedy": r.get("evaluate", {}).get("identical_to_greedy"),
                "val_simulated_tau": r.get("train", {}).get("val_simulated_tau"),
                "val_loss": r.get("train", {}).get("val_loss"),
                "train_tokens": r.get("pack", {}).get("train_tokens"),
            }
            for r in json.loads((work / EXPS).read_text())
        ]
    (out / "gpu_profile.json").write_text(json.dumps(res, indent=1) + "\n")
    for rel in ("evaluate.json", "train.json", "pack.json", "evaluate_questions.json", "timing/evaluate.json"):
        if (r / rel).exists():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(r / rel, out / rel)
    if with_drafter and (work / "data" / "drafter" / "config.json").exists():  # ~45 MB: to serve it elsewhere
        shutil.copytree(work / "data" / "drafter", out / "drafter", dirs_exist_ok=True)
    with open(out / "stage_logs.txt", "w") as f:  # the end of each stage's output
        for log in sorted((work / "bench" / "out" / "logs").glob("*.log")):
            f.write(f"==== {log.stem}\n" + "".join(log.read_text(errors="replace").splitlines(True)[-25:]))
    print(json.dumps(res, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path.home() / "run")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup")
    s.add_argument("--profile", default="gpu", help="profiles/<name>.yaml, or default: params.yaml unchanged")
    s.add_argument("-S", dest="sets", action="append", default=[], help="section.key=yaml value, after the profile")
    r = sub.add_parser("run")
    r.add_argument("--budget", type=float, default=540)
    r.add_argument("--min-left", type=float, default=60, help="start no stage with less than this left")
    r.add_argument("--until", help="the last stage to run (its @parts included), e.g. pack")
    r.add_argument("--detach", action="store_true", help="in the background, outliving this call; then `wait`")
    w = sub.add_parser("wait", help="follow a `run --detach` until it ends or the budget is spent")
    w.add_argument("--budget", type=float, default=560)
    e = sub.add_parser("exp", help="one ablation as a DVC experiment, from the committed profile")
    e.add_argument("name")
    e.add_argument("-S", dest="sets", action="append", default=[], help="section.key=yaml value (dvc exp run -S)")
    e.add_argument("--budget", type=float, default=540)
    q = sub.add_parser("enqueue", help="queue an ablation (dvc exp run --queue) for `queue`")
    q.add_argument("name")
    q.add_argument("-S", dest="sets", action="append", default=[], help="section.key=yaml value (dvc exp run -S)")
    r2 = sub.add_parser("queue", help="run the queued ablations side by side (dvc queue start -j JOBS)")
    r2.add_argument("--jobs", type=int, default=4)
    r2.add_argument("--budget", type=float, default=540)
    o = sub.add_parser("report")
    o.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    o.add_argument("--with-drafter", action="store_true", help="also copy data/drafter (~45 MB) into --out")
    a = ap.parse_args()
    if a.cmd == "setup":
        setup(a.workdir, a.profile, a.sets)
    elif a.cmd == "run" and a.detach:
        until = ["--until", a.until] if a.until else []
        detach(a.workdir, ["--budget", str(a.budget), "--min-left", str(a.min_left), *until])
    elif a.cmd == "run":
        run(a.workdir, a.budget, a.min_left, a.until)
    elif a.cmd == "wait":
        wait(a.workdir, a.budget)
    elif a.cmd == "exp":
        experiment(a.workdir, a.name, a.sets, a.budget)
    elif a.cmd == "enqueue":
        enqueue(a.workdir, a.name, a.sets)
    elif a.cmd == "queue":
        run_queue(a.workdir, a.jobs, a.budget)
    else:
        report(a.workdir, a.out, a.with_drafter)


if __name__ == "__main__":
    main()
