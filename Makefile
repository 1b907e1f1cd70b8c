# Two commands for a new user: `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup run test test-all clean

# The stamp is rebuilt only when a requirements file changes, so repeated calls are instant.
$(STAMP): requirements.txt requirements-test.txt requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-test.txt -c requirements.lock
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(PY) launch.py --config=configs/tiny_cpu.py --mode=rl

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# Also runs tests marked slow.
test-all: $(STAMP)
	$(PY) -m pytest --run-slow $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
