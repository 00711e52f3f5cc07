# Quick start: `make serve` and `make test`. Each sets itself up (virtualenv,
# install, default model fetch) and caches that work after the first run.
# `make serve` installs only what serving needs (pyproject's dependencies);
# `make test` (and `make install`, for development) adds the test extras on top.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: serve test install model bench gpu-check docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	touch $(STAMP)

# the dashboard's browser test drives the system Chromium: installed through apt where
# it is missing and apt can (as root, or with password-less sudo); else that test skips
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo -n)

$(TEST_STAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install -q -e '.[test]'
	@command -v chromedriver >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1 || \
	  timeout 600 $(SUDO) apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	  echo "note: Chromium could not be installed (apt install chromium chromium-driver):" \
	       "the dashboard's browser test will be skipped"
	touch $(TEST_STAMP)

install: $(TEST_STAMP)

model: $(STAMP)
	$(BIN)/pantheon models fetch-default

serve: model
	$(BIN)/pantheon serve $(ARGS)

# two worker processes, each test file whole in one of them (its module fixtures shared):
# the suite's many waits on real processes overlap (~5 min on 2 cores, ~9 in one process)
TEST_WORKERS ?= 2
test: $(TEST_STAMP) model
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

bench: model
	$(BIN)/pantheon bench engine

# the reference in docs/ as a site (MkDocs, Material theme) in site/
docs: $(TEST_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# On a machine with an NVIDIA GPU: CuPy, the gpu tests, both benchmarks, one JSON line
gpu-check: $(TEST_STAMP) model
	$(BIN)/python -m pantheon.bench.gpu_check

clean:
	rm -rf $(VENV) build site *.egg-info
