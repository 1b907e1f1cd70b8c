# Two commands for a new user: `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# --no-compile: byte-compiling every installed module took about half of a clean install when
# TensorFlow was among them (JetStream's seqio, now left out); Python compiles on first import.
PIP := $(PY) -m pip install -q --no-compile --disable-pip-version-check
# ... and keeps what it compiled (in __pycache__, which git ignores) unless the environment sets
# PYTHONDONTWRITEBYTECODE: then every Python process compiles every module it imports again,
# seconds of each launch's, test worker's and benchmark child's start. The suite starts many such
# processes, so the targets here let Python keep its bytecode. Measured on a 2-core AMD EPYC:
# tests/benchmarks/test_accelerator.py with tests/test_launch.py 192 -> 82 s.
unexport PYTHONDONTWRITEBYTECODE
# google-jetstream is installed with --no-deps (requirements-nodeps.txt): the packages it declares
# but does not need at run time (seqio and with it TensorFlow; blobfile, coverage, parameterized)
# are deliberately absent, and every later pip install reports them as an "ERROR" of its
# dependency resolver although the install succeeded. This filter drops exactly those lines (and
# the header, unless another conflict follows it); any other message passes through.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PIP_FILTER := 2>&1 | awk '/^ERROR: pip.s dependency resolver does not currently take into account/ {hdr = $$0; next} \
  /^google-jetstream [0-9.]+ requires (blobfile|coverage|parameterized|seqio), which is not installed[.]$$/ {next} \
  hdr != "" && / (requires|has requirement) / {print hdr; hdr = ""} {print}'
# `make run` needs the runtime dependencies only; `make test` adds the test ones (torch and
# transformers as the numerical reference, the notebook runner, ruff: `make test` and
# `make test-all` run `ruff check` first, its rules in pyproject.toml). Each stamp is rebuilt
# only when its requirements change, so repeated calls are instant.
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
COMPILE_STAMP := $(VENV)/.installed-compile
PYTEST_ARGS ?=
# The suite runs in two pytest processes (pytest-xdist), one file at a time each: the tests are
# mostly single-threaded XLA compiles, Python and servers waiting on each other, so two processes
# on 2 cores finish in ~60% of one's time. A file stays in one process, so module fixtures (a
# served engine, the end-to-end runs) are built once; tests/conftest.py sends the longest files
# out first. PYTEST_WORKERS=0 runs everything in this process.
PYTEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),-p no:xdist,-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder)

.PHONY: setup setup-compile run test test-all clean

$(RUN_STAMP): requirements.txt requirements-nodeps.txt requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "pip install -r requirements.txt, then --no-deps -r requirements-nodeps.txt (into $(VENV))"
	@$(PIP) -r requirements.txt -c requirements.lock $(PIP_FILTER)
	@$(PIP) --no-deps -r requirements-nodeps.txt -c requirements.lock $(PIP_FILTER)
	touch $(RUN_STAMP)

# The TPU compiler (libtpu, ~0.7 GB) into .venv and XLA:GPU (the CUDA plugin and ptxas, ~0.6 GB) beside
# it in .venv/gpu-compiler, for --mode=compile (requirements-compile*.txt say why apart).
$(COMPILE_STAMP): $(RUN_STAMP) requirements-compile.txt requirements-compile-gpu.txt
	@echo "pip install -r requirements-compile.txt (into $(VENV)), -r requirements-compile-gpu.txt (into $(VENV)/gpu-compiler)"
	@$(PIP) -r requirements-compile.txt -c requirements.lock $(PIP_FILTER)
	@$(PIP) --no-deps --upgrade --target $(VENV)/gpu-compiler -r requirements-compile-gpu.txt $(PIP_FILTER)
	touch $(COMPILE_STAMP)

setup-compile: $(COMPILE_STAMP)

$(TEST_STAMP): $(RUN_STAMP) $(COMPILE_STAMP) requirements-test.txt
	@echo "pip install -r requirements-test.txt (into $(VENV))"
	@$(PIP) -r requirements-test.txt -c requirements.lock $(PIP_FILTER)
	touch $(TEST_STAMP)

setup: $(TEST_STAMP)

run: $(RUN_STAMP)
	$(PY) launch.py --config=configs/tiny_cpu.py --mode=rl

test: $(TEST_STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

# Everything, the tests marked slow included (what CI runs: .ci/run).
test-all: $(TEST_STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest --run-slow $(XDIST) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
