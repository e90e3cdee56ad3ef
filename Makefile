# The two commands of the README: `make demo` and `make test`. Both set everything up
# on a fresh clone: a virtual environment in .venv, PyTorch's CPU wheel first (a bare
# `torch` requirement would pull gigabytes of CUDA wheels), then the package.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.rapydli-installed
TEST_STAMP := $(VENV)/.rapydli-test-installed
# Keep tool caches inside the checkout so nothing lands in the home directory.
export YARN_CACHE_FOLDER := $(CURDIR)/build/yarn-cache
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test check install install-test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# The editable install builds the lab extension (jlpm install && jlpm build through
# hatch-jupyter-builder) and copies it into the venv, so its sources are prerequisites.
LAB_SOURCES := $(wildcard extensions/rapydli-lab/src/*.ts extensions/rapydli-lab/style/*) \
	extensions/rapydli-lab/package.json extensions/rapydli-lab/yarn.lock

# `make demo` installs what the demo runs on (the runtime and the MPICH wheel); `make test`
# adds the test extra (triton, playwright, pytest, ruff, mypy) on top.
$(STAMP): pyproject.toml $(LAB_SOURCES) | $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) show -q torch >/dev/null 2>&1 || $(PIP) install -q "$(TORCH_SPEC)" || $(PIP) install -q torch --index-url https://download.pytorch.org/whl/cpu
	$(PIP) install -q -e '.[mpich]'
	touch $@

$(TEST_STAMP): $(STAMP)
	$(PIP) install -q -e '.[mpich,test]'
	touch $@

install: $(STAMP)

install-test: $(TEST_STAMP)

demo: install
	mkdir -p outputs
	$(VENV)/bin/papermill --engine rapydli --cwd notebooks notebooks/01-quickstart.ipynb outputs/01-quickstart.ipynb -k python3
	@echo
	@echo "Executed notebook: $(CURDIR)/outputs/01-quickstart.ipynb"

# Lint (ruff: pyflakes, bugbear, import order) and types (mypy) before the tests.
check: install-test
	$(VENV)/bin/ruff check rapydli tests
	$(VENV)/bin/mypy

test: check
	$(PY) -m pytest $(PYTEST_ARGS)

bench: install
	mkdir -p bench-results
	$(VENV)/bin/rapydli bench magics -n 2 --json bench-results/magics.json
	$(VENV)/bin/rapydli bench allreduce -n 2 --json bench-results/allreduce.json
	$(VENV)/bin/rapydli bench trainer -n 2 --json bench-results/trainer.json
	$(VENV)/bin/rapydli bench loader --json bench-results/loader.json
	$(VENV)/bin/rapydli bench conv --json bench-results/conv.json
	$(VENV)/bin/rapydli bench pipeline --json bench-results/pipeline.json
	$(VENV)/bin/rapydli bench parallel --json bench-results/parallel.json
	$(VENV)/bin/rapydli bench live -n 2 --json bench-results/live.json

clean:
	rm -rf outputs build bench-results .pytest_cache
