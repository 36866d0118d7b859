# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
SHELL   := /bin/bash
.SHELLFLAGS := -o pipefail -c

.PHONY: demo test proptest bench lint clean

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

# Two pytest workers (pytest-xdist), a test file each at a time (module fixtures built once):
# 1.5x faster on 2 cores. TEST_JOBS=1 runs in one process.
TEST_JOBS ?= 2
test: $(STAMP) lint
	$(BIN)/python -m pytest tests $(if $(filter 1,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadfile)

# Whole-model and random-graph properties at the nightly size (300 examples per family; hours).
proptest: $(STAMP)
	HYPOTHESIS_PROFILE=nightly $(BIN)/python -m pytest tests/models/test_model_properties.py

# Every benchmark beside its baselines (eager fp32/bf16, torch.compile), each one's text and JSON kept
# in $(BENCH_OUT), and where each model's time goes (amxopt profile): the first thing to run on a CPU whose numbers are missing (an AMX Xeon above all).
# On AMX both GEMM schedules run (bench_ops' native[amx/rows]; bench_models --pinned-schedules).
BENCH_OUT ?= bench-results/$(shell date +%Y%m%d-%H%M)
AMX_ONLY := from amxopt.ops import native; print('--pinned-schedules' if native.active_tier() == 'amx' else '')
bench: $(STAMP)
	mkdir -p $(BENCH_OUT)
	$(BIN)/amxopt info | tee $(BENCH_OUT)/info.txt
	$(BIN)/python tools/bench_ops.py --json $(BENCH_OUT)/ops.json | tee $(BENCH_OUT)/ops.txt
	$(BIN)/python tools/bench_models.py $$($(BIN)/python -c "$(AMX_ONLY)") --json $(BENCH_OUT)/models.json \
		| tee $(BENCH_OUT)/models.txt
	for m in "qwen3-vl-2b-vision --size 448" "qwen3-omni-audio --size 30" "wan2.1-t2v-1.3b --size 5,32,32,512"; do \
		$(BIN)/amxopt profile $$m --by-shape --json $(BENCH_OUT)/profile-$${m%% *}.json \
			| tee $(BENCH_OUT)/profile-$${m%% *}.txt || exit 1; \
	done
	$(BIN)/python tools/bench_load.py --json $(BENCH_OUT)/load.json | tee $(BENCH_OUT)/load.txt
	$(BIN)/python tools/bench_tp.py | tee $(BENCH_OUT)/tp.txt

clean:
	rm -rf $(VENV) build *.egg-info
