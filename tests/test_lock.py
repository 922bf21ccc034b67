"""The committed dvc.lock is what the committed code and params make: no stage's code or params deps
differ from the lock, as `dvc status` sees them. A change to a stage's code or params that lands
without `make repro` (and the lock and metrics it writes) fails here."""

import json
import shutil
import subprocess
from pathlib import Path

import yaml

from .conftest import REPO, sh


def git_tracked(repo: Path, path: str) -> bool:
    """A file in git, or a directory with files in git. The .gitignore that DVC writes into a
    directory of outputs (data/hidden, reports/tokenize) does not make that directory code."""
    listed = subprocess.run(["git", "ls-files", "--", path], cwd=repo, capture_output=True, text=True).stdout
    return any(Path(f).name != ".gitignore" for f in listed.splitlines())


def stale_deps(repo: Path) -> dict[str, list[str]]:
    """stage -> its code and params deps that differ from dvc.lock. Data deps (outputs of other
    stages, absent from a clone without the DVC cache) are not code: they are left out."""
    status = json.loads(sh("dvc status --json", repo).stdout or "{}")
    stale = {}
    for stage, changes in status.items():
        found = []
        for change in changes if isinstance(changes, list) else [changes]:
            if not isinstance(change, dict):
                found.append(str(change))  # e.g. "changed command", or a stage the lock does not have
                continue
            for path, what in change.get("changed deps", {}).items():
                if isinstance(what, dict):  # params.yaml: {key: modified | new | deleted}
                    found += [f"{path}:{k} {v}" for k, v in what.items()]
                elif git_tracked(repo, path):
                    found.append(f"{path} {what}")
        if found:
            stale[stage] = found
    return stale


def test_committed_lock_matches_the_code_and_params():
    stale = stale_deps(REPO)
    assert not stale, (
        "dvc.lock is stale against the code or params of these stages (run `make repro`, then commit "
        f"dvc.lock, metrics/ and reports/ with the change): {json.dumps(stale, indent=1)}"
    )


def test_the_check_sees_a_changed_stage_file_and_a_changed_param(tmp_path):
    """The check above is not vacuous: in a copy of the repository, an edit to a stage's code and
    one to a tracked param are both reported, and nothing else is."""
    repo = tmp_path / "repo"
    listing = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    files = subprocess.run(listing, cwd=REPO, capture_output=True, text=True).stdout.split("\0")
    for f in filter(None, files):  # the working tree as tested above, without the data
        if (REPO / f).is_file() and not f.startswith("data/"):
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, repo / f)
    sh("git init -q && git add -A && git -c user.email=t@t -c user.name=t commit -qm copy", repo)
    assert stale_deps(repo) == {}, "a copy without the DVC cache (as CI's clean clone) is not stale"
    with open(repo / "stages/tokenize.py", "a") as f:
        f.write("\n# an edit\n")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["train"]["lr"] = params["train"]["lr"] * 2
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    stale = stale_deps(repo)
    assert "stages/tokenize.py modified" in stale["tokenize@sharegpt-000"], stale
    assert "params.yaml:train modified" in stale["train"], stale  # dvc.yaml tracks the section whole
    assert set(stale) <= {"train", *(s for s in stale if s.startswith("tokenize@"))}, stale
