# One command to set up and train the demo, one to set up and test.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# Where pip may take torch from besides PyPI (torch's version is pinned in constraints-cpu.txt). By
# default: nowhere else when this machine already has a wheel of that version (pip's find-links) or a
# GPU (nvidia-smi runs; PyPI's Linux build is the CUDA one); otherwise PyTorch's CPU index, whose CPU
# build is a few hundred MB instead of several GB. `make setup TORCH_INDEX=URL` picks another index
# (e.g. https://download.pytorch.org/whl/cu126); `make setup TORCH_INDEX=` uses PyPI only. Evaluated
# once, only when the environment is (re)built, with the virtual environment's pip.
CPU_INDEX   := https://download.pytorch.org/whl/cpu
TORCH_INDEX ?= $(shell command -v nvidia-smi >/dev/null || $(PY) -m pip install -q --dry-run --no-index --no-deps \
	-c constraints-cpu.txt torch >/dev/null 2>&1 || echo $(CPU_INDEX))

.PHONY: help setup demo sweep test test-all test-fast bench bench-gpu docs clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# uv installs what pip would, several times faster (about a minute instead of 3 on 2 cores); it reads pip's
# find-links, takes each package from whichever index has its best version, and compiles bytecode, as pip does
# (without it, where PYTHONDONTWRITEBYTECODE is set, every process would compile torch's sources again).
# uv -q says nothing while it works: a line every 10 s says the install goes on.
$(STAMP): pyproject.toml constraints-cpu.txt | $(PY)
	@echo "setup: installing torch and every extra into $(VENV) (about a minute; a line every 10 s until done)"
	$(PY) -m pip install -q uv
	@index='$(TORCH_INDEX)'; set -x; \
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) -c constraints-cpu.txt \
	  $${PIP_FIND_LINKS:+--find-links "$$PIP_FIND_LINKS"} \
	  $${index:+--extra-index-url "$$index" --index-strategy unsafe-best-match} -e '.[dev,deepspeed,tracking,hf,eval]' & \
	{ set +x; } 2>/dev/null; pid=$$!; s=0; \
	while sleep 1 && kill -0 $$pid 2>/dev/null; do \
	  s=$$((s + 1)); [ $$((s % 10)) -ne 0 ] || echo "setup: still installing ($$s s)"; done; \
	wait $$pid
	touch $(STAMP)

setup: $(STAMP)  ## .venv with torch, every extra and this checkout (about a minute)

demo: $(STAMP)  ## train the tiny GPT on the built-in corpus (1-2 minutes)
	$(PY) launch/run.py --config configs/demo.toml --run-dir runs/demo-$$(date +%Y%m%d-%H%M%S)

# The lab's own science, end to end: search and sweep (resumed if interrupted), fit, verify at a held-out budget.
SWEEP_FILE   ?= sweeps/tiny_isoflop.toml
SWEEP_DIR    ?= runs/sweeps/tiny-isoflop
VERIFY_FLOPS ?= 8e12
# Fit and verify both leave out the runs a first fit flags as outliers (the report lists them), so that the
# law in the fit's report is the one verify tests; a fit that identifies no law (exit 3) still writes its report,
# unless it has fewer than 3 budgets and no approach could be identified even before the bootstrap (two lines say so).
sweep: $(STAMP)  ## the default sweep: search, runs, fit and verify (about 50 minutes on 2 cores)
	$(PY) -m sweeps run $(SWEEP_FILE) --folder $(SWEEP_DIR)
	-$(PY) -m analysis fit $(SWEEP_DIR) --out $(SWEEP_DIR)/fit --drop-outliers
	$(PY) -m sweeps verify $(SWEEP_DIR) --budget $(VERIFY_FLOPS) --drop-outliers

# What CI runs (.ci/run), under 10 minutes on 2 cores: every test but the long scenarios.
test: $(STAMP)  ## what CI runs: every test but the long scenarios (under 10 minutes)
	$(PY) -m pytest -q -m "not long" --durations=10

# The whole suite (about 35 minutes on 2 cores): before landing a change to launchers, sweeps or checkpoints.
test-all: $(STAMP)  ## every test, the long scenarios too (about 35 minutes)
	$(PY) -m pytest -q --durations=10

# The edit loop (under a minute on 2 cores): every test but those marked slow (launchers, many runs) or long.
test-fast: $(STAMP)  ## the edit loop: every test not marked slow or long (about a minute)
	$(PY) -m pytest -q -m "not slow and not long"

bench: $(STAMP)  ## tokens/s and MFU of the default model
	$(PY) launch/bench.py

# On a machine with one CUDA GPU (about 10 minutes): the paths no CPU run reaches, in benchmarks/gpu/results.{json,md}.
bench-gpu: $(STAMP)  ## on a CUDA GPU: GPT-2 124M and the strategies under torchrun
	$(PY) -m lab bench-gpu --out benchmarks/gpu/results.json

# The option reference, generated from the config dataclasses (a test holds it current).
docs: $(STAMP)  ## regenerate docs/options.md from the config
	$(PY) -m lab options --out docs/options.md

clean:  ## remove .venv, runs/ and prepared data
	rm -rf $(VENV) runs data/prepared demo-sweep demo-fit

help:  ## list these targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## (.*)/  \1\t\2/' | expand -t 14
