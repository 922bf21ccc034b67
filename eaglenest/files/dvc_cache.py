"""The DVC cache objects behind a workspace's outputs, checked against the md5 they are named by.

DVC links outputs to its cache (`cache.type: hardlink,symlink` here): a program that rewrites an
output in place rewrites the cache object too, and DVC, which trusts its own hashes, still reports
the workspace as up to date and would push the bad bytes. This reads every object that `dvc.lock`
and the `.dvc` files name (a directory's listing and each file in it) and names those whose bytes
no longer hash to their name. Objects not in the cache (never pulled) are counted, not failed."""

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from eaglenest.runtime.errors import EaglenestError


@dataclass
class CacheCheck:
    checked: int = 0
    bytes: int = 0
    absent: int = 0
    corrupt: list[str] = field(default_factory=list)  # "<output>[/<file>]: object <path> has md5 <x>"


def tracked_outputs(repo: Path) -> tuple[Path, list[tuple[str, str]]]:
    """(the cache's md5 folder, [(output path, md5)]) for every cached output of the repository's
    pipeline and `.dvc` files, as DVC's own index reads them (DVC 3 md5 hashes; `cache: false`
    outputs have no object)."""
    from dvc.repo import Repo

    try:
        with Repo(str(repo)) as r:
            outs = [
                (str(o.def_path), o.hash_info.value)
                for o in r.index.outs
                if o.use_cache and o.hash_info and o.hash_info.name == "md5" and o.hash_info.value
            ]
            return Path(r.cache.local.path), outs
    except Exception as e:  # not a DVC repository, a broken dvc.yaml or lock: DVC's own words, one line
        raise EaglenestError(f"{repo}: cannot read the DVC repository ({' '.join(str(e).split())})") from None


def md5_file(path: Path, bar=None) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
            if bar is not None:
                bar.update(len(block))
    return h.hexdigest()


def check_cache(repo: Path, progress: bool = True) -> CacheCheck:
    """Every cache object of the workspace's outputs re-hashed; corrupt ones named."""
    root, outs = tracked_outputs(repo)
    result = CacheCheck()
    objects: list[tuple[str, str]] = []  # (what it is, md5)
    for out, md5 in outs:
        objects.append((out, md5))
        if md5.endswith(".dir"):
            obj = root / md5[:2] / md5[2:]
            if obj.is_file():
                try:
                    entries = json.loads(obj.read_text())
                    objects += [(f"{out}/{e['relpath']}", e["md5"]) for e in entries]
                except (ValueError, KeyError, TypeError):
                    pass  # the listing's own md5 check below names it
    present = [(what, md5, root / md5[:2] / md5[2:]) for what, md5 in objects]
    result.absent = sum(1 for _, _, obj in present if not obj.is_file())
    present = [p for p in present if p[2].is_file()]
    total = sum(obj.stat().st_size for _, _, obj in present)
    with tqdm(total=total, unit="B", unit_scale=True, desc="DVC cache", disable=not progress) as bar:
        for what, md5, obj in present:
            got = md5_file(obj, bar)
            result.checked += 1
            result.bytes += obj.stat().st_size
            if got != md5.removesuffix(".dir"):
                result.corrupt.append(f"{what}: cache object {obj} has md5 {got}, not {md5.removesuffix('.dir')}")
    return result
