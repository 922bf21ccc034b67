"""Share extracted states through real DVC remotes on 127.0.0.1: push from clone A (with the
run-cache), pull into a fresh clone B, byte-identical stores, and no extraction in B."""

import hashlib
import shutil

import pytest

from .conftest import commit, make_clone, ran, sh, tiny_params
from .servers import S3Server, SSHServer, sshd_binary

pytestmark = pytest.mark.slow


def tree_digest(root):
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def produced(tmp_path_factory, smollm2):
    repo = make_clone(
        tmp_path_factory.mktemp("remote") / "a", tiny_params(("r-a", "r-b"), per_part=3, local_target=True)
    )
    sh("dvc repro pack", repo)
    commit(repo, "extracted")
    return repo


@pytest.fixture(params=["ssh", "s3"])
def remote(request, tmp_path):
    if request.param == "ssh":
        if not sshd_binary():
            pytest.skip("openssh-server is not installed (make test installs it)")
        server = SSHServer(tmp_path)
        (tmp_path / "store").mkdir()
        add = [f"dvc remote add -d shared {server.url(tmp_path / 'store')}"]
        local = [f"dvc remote modify --local shared keyfile {server.key}"]
        env = {}
    else:
        server = S3Server(tmp_path)
        add = [
            f"dvc remote add -d shared s3://{server.bucket}/cache",
            f"dvc remote modify shared endpointurl {server.endpoint}",
        ]
        local, env = [], S3Server.env
    yield add, local, env
    server.stop()


def test_push_then_pull_into_fresh_clone_runs_no_extraction(produced, remote, tmp_path):
    add, local, env = remote
    a = tmp_path / "a"
    shutil.copytree(produced, a, symlinks=True)
    for c in add + local:
        sh(c, a)
    commit(a, "remote")  # .dvc/config is shared; secrets (keyfile) stay in config.local
    assert "keyfile" not in (a / ".dvc/config").read_text()
    sh("dvc push --run-cache", a, env_extra=env)

    b = tmp_path / "b"
    sh(f"git clone -q {a} {b}", tmp_path)
    for c in local:
        sh(c, b)
    assert not (b / "data/hidden/r-a").exists()
    sh("dvc pull --with-deps pack", b, env_extra=env)  # train/evaluate never ran in this clone
    for part in ("r-a", "r-b"):
        assert tree_digest(b / "data/hidden" / part) == tree_digest(a / "data/hidden" / part)
    assert "up to date" in sh("dvc status pack", b).stdout
    out = sh("dvc repro pack", b, env_extra=env).stdout
    assert not {s for s in ran(out) if s.startswith(("extract", "teacher", "tokenize", "target"))}, out


@pytest.mark.parametrize("remote", ["s3"], indirect=True)
def test_parts_extracted_on_two_machines_meet_in_a_third_clone(remote, smollm2, tmp_path):
    """DVC as the coordinator of parts across machines: A extracts one part and B the other, each
    pushing its run-cache; a third clone pulls and runs the whole pipeline without extracting."""
    add, local, env = remote
    origin = make_clone(tmp_path / "origin", tiny_params(("m-a", "m-b"), per_part=3, local_target=True))
    for c in add:
        sh(c, origin)
    commit(origin, "shared remote")
    machines = {}
    for name, part in (("a", "m-a"), ("b", "m-b")):
        repo = tmp_path / name
        sh(f"git clone -q {origin} {repo}", tmp_path)
        for c in local:
            sh(c, repo)
        out = sh(f"dvc repro teacher@{part}", repo, env_extra=env).stdout  # every read of the part's states
        assert {f"extract@{part}", f"teacher@{part}"} <= ran(out) and not {
            s for s in ran(out) if s.startswith(("extract@m-", "teacher@m-")) and part not in s
        }
        sh("dvc push --run-cache", repo, env_extra=env)
        machines[part] = repo

    c = tmp_path / "c"
    sh(f"git clone -q {origin} {c}", tmp_path)
    for cmd in local:
        sh(cmd, c)
    sh("dvc fetch --run-cache", c, env_extra=env)  # the runs and their outputs into the cache; no checkout
    out = sh("dvc repro --pull", c, env_extra=env).stdout  # restored from the run-cache: "is cached"
    # target reruns (its report is in git, so DVC cannot restore the run: a fingerprint, the same bytes); every part's
    # stages come from A's and B's runs
    assert ran(out) == {"target", "pack", "train", "evaluate"}, out
    for part, repo in machines.items():
        assert tree_digest(c / "data/hidden" / part) == tree_digest(repo / "data/hidden" / part)
