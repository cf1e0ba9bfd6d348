# olmo-ds — every target sets up what it needs: a fresh clone needs only `make demo` or `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU machines this project is developed on have torch 2.13.0 (CPU build) on local disk;
# PyPI's torch 2.13.0 for Linux is a CUDA build, so the same pin serves GPU machines. Override
# with `make TORCH_SPEC='torch==X' ...` or TORCH_SPEC= to keep an existing torch.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# OFFLINE=1: use the environment that is already there (`python` on PATH, olmo_ds importable from this
# checkout) and install nothing, for hosts that cannot reach a package registry (the GPU host).
OFFLINE ?=
ifeq ($(OFFLINE),)
SETUP := $(STAMP)
PY := $(BIN)/python
RUN := PATH=$(abspath $(BIN)):$$PATH
else
SETUP :=
PY := python
RUN := PYTHONPATH=$(CURDIR):$$PYTHONPATH
endif
# Extra pytest arguments, e.g. PYTEST_ARGS="-x -k resume".
PYTEST_ARGS ?=
# The CPU tiers (test, test-fast, test-slow) run on pytest-xdist workers (the `test` extra installs it): one per core,
# at least 2, at most 8. A file's tests stay on one worker (--dist loadfile), so module fixtures are made once and
# the docs' blocks run in order. TEST_WORKERS=0: every test in the pytest process itself.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -lt 2 ] && n=2; [ $$n -gt 8 ] && n=8; echo $$n)
XDIST = $$($(PY) -c "import xdist" 2>/dev/null && echo "-n $(TEST_WORKERS) --dist loadfile")

# Targets that start DeepSpeed put .venv/bin first on PATH: its ninja must be the one that built the
# cached ops, or DeepSpeed rebuilds them (another ninja reads the build log as stale).

# Demo paths (the defaults of prepare-data and eval; override on the command line).
DEMO_DIR ?= data/demo
INPUT ?= $(DEMO_DIR)/raw
TOKENIZER ?= $(DEMO_DIR)/tokenizer.json
OUTPUT ?= $(DEMO_DIR)/shards
WORKERS ?= 2
PREPARE_ARGS ?=
RUN_DIR ?= runs/demo

.DEFAULT_GOAL := help
.PHONY: help install hostfile demo prepare-data test test-fast test-gpu test-slow test-faults bench-prepare bench-data bench-train bench-checkpoint bench-eval flash-attn clean

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  make %-15s %s\n", $$1, $$2}'

$(STAMP): requirements.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/python -m pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/python -m pip install -q -r requirements.txt -e '.[test]'
	@touch $(STAMP)

install: $(STAMP) ## create .venv and install olmo-ds with its test dependencies

hostfile: $(SETUP) ## write ./hostfile for this machine (slots = visible GPUs, 2 without; Slurm: one line per node); FORCE=1 replaces one
	$(RUN) $(PY) scripts/make_hostfile.py $(if $(FORCE),--force)

demo: $(SETUP) ## the whole pipeline on an embedded corpus: tokenizer, shards, 2-rank ZeRO-3 pretraining, eval
	$(RUN) bash scripts/demo.sh

# prepare_data.py validates its output at the end (each shard as checked by the process that wrote it);
# `python scripts/validate_shards.py OUTPUT --tokenizer TOKENIZER` reads every shard again.
prepare-data: $(SETUP) ## raw text → validated token shards (INPUT=, TOKENIZER=, OUTPUT=, WORKERS=)
	$(RUN) $(PY) scripts/prepare_data.py --input $(INPUT) --tokenizer $(TOKENIZER) --output $(OUTPUT) --workers $(WORKERS) $(PREPARE_ARGS)

test: $(SETUP) ## run the test suite on CPU, on GPU hosts too (real DeepSpeed with 2 CPU ranks); OFFLINE=1 installs nothing
	$(RUN) $(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS) tests

test-fast: $(SETUP) ## the test suite without the multi-rank DeepSpeed runs
	$(RUN) $(PY) -m pytest -q -m "not multirank" $(XDIST) $(PYTEST_ARGS) tests

test-slow: $(SETUP) ## every test of the sampled slow tier (make test draws one in five of them per run)
	$(RUN) OLMO_DS_SLOW_TESTS=all $(PY) -m pytest -q -m slow $(XDIST) $(PYTEST_ARGS) tests

test-gpu: $(SETUP) ## the GPU tier (bf16 on CUDA, compiled blocks under ZeRO-3, resume, attention kernels); needs a CUDA GPU
	$(RUN) OLMO_DS_TEST_DEVICE=cuda $(PY) -m pytest -q -m gpu $(PYTEST_ARGS) tests

test-faults: $(SETUP) ## fault injection (kills, preemption, disk full, rank death, bad input), full trials; ends with the reliability table
	$(RUN) OLMO_DS_FAULT_TRIALS=full OLMO_DS_SLOW_TESTS=all $(PY) -m pytest -q tests/faults $$($(PY) tests/faults/coverage.py)

# Arguments for bench-prepare, e.g. BENCH_PREPARE_ARGS="--many-files" (>= 2 GB of .json.gz in 128 files, 1 worker against all cores).
BENCH_PREPARE_ARGS ?=

bench-prepare: $(SETUP) ## data preparation throughput (tokens/s, MB/s, RSS) at 1 and 2 workers; BENCH_PREPARE_ARGS="--many-files": a corpus of many .json.gz files
	$(RUN) $(PY) scripts/bench_prepare.py $(BENCH_PREPARE_ARGS)

bench-data: $(SETUP) ## data loader throughput per rank
	$(RUN) $(PY) scripts/bench_data.py

bench-train: $(SETUP) ## training throughput, MFU and memory (GPU: olmo2-1b; CPU: tiny)
	$(RUN) $(PY) scripts/bench_train.py

bench-checkpoint: $(SETUP) ## how long a checkpoint blocks training (blocking vs background save) beside a raw write of its bytes
	$(RUN) $(PY) scripts/bench_checkpoint.py

bench-eval: $(SETUP) ## evaluation speed, batching exact vs packed: multiple choice, perplexity, in the loop (GPU: olmo2-1b; CPU: tiny)
	$(RUN) $(PY) scripts/bench_eval.py

# FLASH_ATTN_SRC=DIR: a flash-attention checkout (with csrc/cutlass) to build from instead of cloning; MAX_JOBS=N overrides
# the parallel nvcc jobs sized from free memory. The log goes to build/flash-attn.log.
flash-attn: $(SETUP) ## build FlashAttention-3 for this machine's Hopper GPU, install it, check it runs (attention_backend flash_attn3)
	$(RUN) $(PY) scripts/build_flash_attn.py $(if $(FLASH_ATTN_SRC),--src $(FLASH_ATTN_SRC))

clean: ## remove demo outputs (keeps .venv)
	rm -rf data/demo runs/demo
