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

.PHONY: demo test check install install-test bench clean gpu-wheels gpu-check conformance tour

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
	$(VENV)/bin/papermill --cwd notebooks notebooks/01-quickstart.ipynb outputs/01-quickstart.ipynb -k python3
	@echo
	@echo "Executed notebook: $(CURDIR)/outputs/01-quickstart.ipynb"

# Lint (ruff: pyflakes, bugbear, import order) and types (mypy) before the tests.
check: install-test
	$(VENV)/bin/ruff check rapydli tests
	$(VENV)/bin/ruff format --check rapydli tests
	$(VENV)/bin/mypy

# Three pytest-xdist workers on two cores: much of the suite waits (engines, kernels, a browser, Slurm) rather
# than computes. A test file runs in one worker; the files using what the machine has one of
# (namespace hosts, local Slurm, the browser's JupyterLab) in one worker, in turn (tests/conftest.py).
# Tests marked `alone` (the autotuner's, and one comparing the speed of ranks) time things against each
# other: they run afterwards, with nothing beside them.
TEST_WORKERS ?= 3

test: check
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not alone and not matrix and not tour" $(PYTEST_ARGS)
	$(PY) -m pytest -m alone $(PYTEST_ARGS) || [ $$? -eq 5 ]  # 5: PYTEST_ARGS left none of them

# The conformance matrix (tests/test_conformance.py, marked `matrix`): every architecture of
# tests/library_models.py in every layout, two workers, then the README's table checked
# against the results (CI runs it after `make test`).
conformance: install-test
	rm -rf build/conformance
	$(PY) -m pytest -n 2 -m matrix -k "not readme" tests/test_conformance.py $(PYTEST_ARGS)
	RAPYDLI_MATRIX_TABLE=1 $(PY) -m pytest -m matrix -k readme tests/test_conformance.py

# Every tour notebook as a newcomer runs it: in a fresh `make demo` environment ($(DEMO_VENV): the runtime,
# none of the test extras), by plain papermill with its default parameters; each then exported by nbconvert
# and opened offline in Chromium (tests/tour_check.py). Fails on a cell error, a notebook over 1 MiB or a
# figure that does not show. 09 runs where a Slurm answers. Then the tests marked `tour` check what those executed
# notebooks show (each tour notebook runs once in CI: here, not also in `make test`). CI runs it after `make conformance`.
DEMO_VENV ?= build/demo-venv

tour: install-test
	$(MAKE) install VENV=$(DEMO_VENV)
	$(PY) tests/tour_check.py --python $(DEMO_VENV)/bin/python --out build/tour
	RAPYDLI_TOUR_DIR=$(CURDIR)/build/tour $(PY) -m pytest -m tour $(PYTEST_ARGS)

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
	$(VENV)/bin/rapydli bench model -n 2 --json bench-results/model.json
	$(VENV)/bin/rapydli bench recovery -n 2 --json bench-results/recovery.json

# The GPU check (README, "Development"): `make gpu-wheels` here downloads what the GPU
# machine's image lacks (the MPICH wheel with mpiexec and libmpi, mpi4py for its Python
# 3.12) into .whl/; `make gpu-check OUT=dir` there runs the GPU tests and `rapydli bench
# gpu` with the image's python3 and writes dir/summary.json; DRY_RUN=1 lists what would
# be carried and run.
GPU_WHEELS ?= mpich==5.0.2 mpi4py==4.1.2
GPU_PLATFORMS := $(foreach p,manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_5_x86_64,--platform $(p))
OUT ?= gpu-check-out

gpu-wheels: | $(PY)
	mkdir -p .whl
	$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $(GPU_PLATFORMS) -d .whl $(GPU_WHEELS)

gpu-check:
	python3 tests/gpu_check.py --out "$(OUT)" $(if $(DRY_RUN),--dry-run,)

clean:
	rm -rf outputs build bench-results .pytest_cache gpu-check-out
