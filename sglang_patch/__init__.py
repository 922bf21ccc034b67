"""Code that runs inside an SGLang server: the hidden-state capture plugin (`plugin`, `capture`),
its launcher (`python -m sglang_patch.launch`) and a CPU-only stand-in for SGLang's kernel package.

Nothing here imports eaglenest's heavy dependencies (zarr, dvc): it is installed `--no-deps` into
the server's own virtual environment (`make sglang-env`)."""
