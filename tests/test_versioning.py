"""Data versioning on real DVC: incremental parts, edits, invalidation, and identical training data
to a clean rebuild. The README's "Versioning" lines."""

import shutil

import pyarrow.parquet as pq
import pytest

from eaglenest.store.hidden_store import HiddenStore, verify_store

from .conftest import commit, make_clone, ran, sh, tiny_params, write_params

pytestmark = pytest.mark.slow

PARTS = ("v-a", "v-b", "v-c")


def packed_index(repo):
    """Sample keys and digests in the canonical packed order."""
    t = pq.read_table(repo / "data/packed/index.parquet")
    return list(zip(t.column("key").to_pylist(), t.column("digest").to_pylist(), t.column("split").to_pylist()))


@pytest.fixture(scope="module")
def base(tmp_path_factory, smollm2):
    repo = make_clone(tmp_path_factory.mktemp("ver") / "base", tiny_params(PARTS[:2], per_part=3, local_target=True))
    sh("dvc repro pack", repo)
    commit(repo, "two parts")
    return repo


@pytest.fixture
def repo(base, tmp_path):
    dst = tmp_path / "repo"
    shutil.copytree(base, dst, symlinks=True)
    return dst


def clean_rebuild(tmp_path, params):
    fresh = make_clone(tmp_path / "fresh", params)
    sh("dvc repro pack", fresh)
    return fresh


def test_add_a_part_extracts_only_that_part(repo, tmp_path):
    params = tiny_params(PARTS, per_part=3, local_target=True)
    write_params(repo, params)
    out = sh("dvc repro pack", repo).stdout
    assert ran(out) == {"sharegpt@v-c", "generate@v-c", "tokenize@v-c", "extract@v-c", "teacher@v-c", "pack"}
    assert packed_index(repo) == packed_index(clean_rebuild(tmp_path, params))


def test_edit_one_part_reruns_only_that_part(repo, tmp_path):
    params = tiny_params(PARTS[:2], per_part=3, local_target=True)
    params["data"]["sharegpt"]["v-b"]["count"] = 2  # the part's content changes
    write_params(repo, params)
    out = sh("dvc repro pack", repo).stdout
    assert ran(out) == {"sharegpt@v-b", "generate@v-b", "tokenize@v-b", "extract@v-b", "teacher@v-b", "pack"}
    assert packed_index(repo) == packed_index(clean_rebuild(tmp_path, params))


def test_invalidate_by_extractor_fingerprint_and_revision(repo):
    fp = HiddenStore(repo / "data/hidden/v-a").attrs["extractor_fingerprint"]
    listing = sh("eaglenest invalidate", repo).stdout
    assert fp[:16] in listing and "data/hidden/v-a" in listing and "data/hidden/v-b" in listing
    out = sh(f"eaglenest invalidate {fp[:12]} --run", repo).stdout
    assert "made 2 part(s): v-a, v-b" in out
    before = packed_index(repo)
    out = sh("dvc repro pack", repo).stdout
    assert ran(out) <= {"pack"}
    assert packed_index(repo) == before  # the same extractor reproduces the same bytes

    # bumping extract.revision invalidates every part; the old versions stay in the cache
    params = tiny_params(PARTS[:2], per_part=3, local_target=True)
    params["extract"]["revision"] = 1
    write_params(repo, params)
    out = sh("dvc repro pack", repo).stdout
    assert ran(out) == {"extract@v-a", "extract@v-b", "teacher@v-a", "teacher@v-b", "pack"}
    new_fp = HiddenStore(repo / "data/hidden/v-a").attrs["extractor_fingerprint"]
    assert new_fp != fp
    commit(repo, "revision 1")
    sh("git checkout -q HEAD~1 -- dvc.lock params.yaml && dvc checkout -q data/hidden/v-a data/hidden/v-b", repo)
    assert HiddenStore(repo / "data/hidden/v-a").attrs["extractor_fingerprint"] == fp
    assert verify_store(repo / "data/hidden/v-a", progress=False) == []
