# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test proptest lint clean

$(STAMP): pyproject.toml $(wildcard amxopt/ops/csrc/*)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: the CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,bench]'
	# Builds amxopt's C++ kernels (amxopt/ops/csrc -> amxopt/ops/_build) and shows which provider runs.
	$(BIN)/amxopt info
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python tools/demo.py

lint: $(STAMP)
	$(BIN)/ruff check amxopt tests tools

test: $(STAMP) lint
	$(BIN)/python -m pytest tests

# Whole-model and random-graph properties at the nightly size (300 examples per family; hours).
proptest: $(STAMP)
	HYPOTHESIS_PROFILE=nightly $(BIN)/python -m pytest tests/models/test_model_properties.py

clean:
	rm -rf $(VENV) build *.egg-info
