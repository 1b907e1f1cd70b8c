# Two commands for a new user: `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# --no-compile: byte-compiling every installed module took about half of a clean install when
# TensorFlow was among them (JetStream's seqio, now left out); Python compiles on first import.
PIP := $(PY) -m pip install -q --no-compile --disable-pip-version-check
# `make run` needs the runtime dependencies only; `make test` adds the test ones (torch and
# transformers as the numerical reference, the notebook runner). Each stamp is rebuilt only
# when its requirements change, so repeated calls are instant.
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
PYTEST_ARGS ?=

.PHONY: setup run test test-all clean

$(RUN_STAMP): requirements.txt requirements-nodeps.txt requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -r requirements.txt -c requirements.lock
	$(PIP) --no-deps -r requirements-nodeps.txt -c requirements.lock
	touch $(RUN_STAMP)

$(TEST_STAMP): $(RUN_STAMP) requirements-test.txt
	$(PIP) -r requirements-test.txt -c requirements.lock
	touch $(TEST_STAMP)

setup: $(TEST_STAMP)

run: $(RUN_STAMP)
	$(PY) launch.py --config=configs/tiny_cpu.py --mode=rl

test: $(TEST_STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# Also runs tests marked slow.
test-all: $(TEST_STAMP)
	$(PY) -m pytest --run-slow $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
