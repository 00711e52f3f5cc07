# Quick start: `make serve` and `make test`. Each sets itself up (virtualenv,
# install, default model fetch) and caches that work after the first run.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test install model bench gpu-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(BIN)/pantheon models fetch-default

serve: model
	$(BIN)/pantheon serve $(ARGS)

test: model
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: model
	$(BIN)/pantheon bench engine

# On a machine with an NVIDIA GPU: CuPy, the gpu tests, both benchmarks, one JSON line
gpu-check: model
	$(BIN)/python -m pantheon.bench.gpu_check

clean:
	rm -rf $(VENV) build *.egg-info
