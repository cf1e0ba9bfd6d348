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
.PHONY: help install demo prepare-data test test-fast test-faults bench-prepare bench-data bench-train clean

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  make %-15s %s\n", $$1, $$2}'

$(STAMP): requirements.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/python -m pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/python -m pip install -q -r requirements.txt -e '.[test]'
	@touch $(STAMP)

install: $(STAMP) ## create .venv and install olmo-ds with its test dependencies

demo: $(STAMP) ## the whole pipeline on an embedded corpus: tokenizer, shards, 2-rank ZeRO-3 pretraining, eval
	PATH=$(abspath $(BIN)):$$PATH bash scripts/demo.sh

prepare-data: $(STAMP) ## raw text → validated token shards (INPUT=, TOKENIZER=, OUTPUT=, WORKERS=)
	$(BIN)/python scripts/prepare_data.py --input $(INPUT) --tokenizer $(TOKENIZER) --output $(OUTPUT) --workers $(WORKERS) $(PREPARE_ARGS)
	$(BIN)/python scripts/validate_shards.py $(OUTPUT) --tokenizer $(TOKENIZER)

test: $(STAMP) ## run the test suite (CPU; real DeepSpeed with 2 ranks)
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python -m pytest -q tests

test-fast: $(STAMP) ## the test suite without the multi-rank DeepSpeed runs
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python -m pytest -q -m "not multirank" tests

test-faults: $(STAMP) ## fault injection (kills, preemption, disk full, rank death, bad input), full trials; ends with the reliability table
	PATH=$(abspath $(BIN)):$$PATH OLMO_DS_FAULT_TRIALS=full $(BIN)/python -m pytest -q tests/faults $$($(BIN)/python tests/faults/coverage.py)

bench-prepare: $(STAMP) ## data preparation throughput (tokens/s, MB/s, RSS) at 1 and 2 workers
	$(BIN)/python scripts/bench_prepare.py

bench-data: $(STAMP) ## data loader throughput per rank
	$(BIN)/python scripts/bench_data.py

bench-train: $(STAMP) ## training throughput, MFU and memory (GPU: olmo2-1b; CPU: tiny)
	$(BIN)/python scripts/bench_train.py

clean: ## remove demo outputs (keeps .venv)
	rm -rf data/demo runs/demo
