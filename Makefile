# The README's commands. Each creates or reuses .venv and installs what it needs.
#   make demo   the main job end to end (CPU by default)
#   make test   all tests
#   make bench  microbenchmarks (python bench/run.py)
#   make hf-table  rerun the transformers family tests and regenerate the README table
# GROUPED_EP_CUDA=0 builds the CPU kernels only (fast, for iteration).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export MAX_JOBS ?= 2
export PYTHONUNBUFFERED := 1
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH),)
PYTEST_ARGS ?=

.PHONY: venv cutlass build test demo bench lint clean hf-table

$(VENV)/.deps: requirements-dev.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-dev.txt
	@touch $@

venv: $(VENV)/.deps

third_party/cutlass/.version: third_party/fetch_cutlass.py | $(VENV)/.deps
	$(PY) third_party/fetch_cutlass.py

cutlass: third_party/cutlass/.version

build: venv $(if $(filter 0,$(GROUPED_EP_CUDA)),,cutlass)
	$(PY) setup.py -q build_ext --inplace

test: build
	$(PY) -m ruff check grouped_ep tests bench tools setup.py third_party/fetch_cutlass.py
	$(PY) -m pytest -q --junitxml=build/test-results.xml $(PYTEST_ARGS) tests

demo: build
	$(PY) -m grouped_ep.demo $(DEMO_ARGS)

bench: build
	$(PY) bench/run.py $(BENCH_ARGS)

# The README's transformers compatibility table, from a run of the family tests.
hf-table: build
	$(PY) tools/hf_table.py --run

lint: venv
	$(PY) -m ruff check grouped_ep tests bench tools setup.py third_party/fetch_cutlass.py
	$(PY) -m ruff format --check grouped_ep tests bench tools setup.py third_party/fetch_cutlass.py

clean:
	rm -rf build grouped_ep/_C*.so
