# The two commands a new user types:
#   make bench   run the default experiment on the embedded default model; prints the HTML report path
#   make test    lint, type-check and run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
SETUP_STAMP := $(VENV)/.servelab-setup
TEST_STAMP := $(VENV)/.servelab-test-setup
PYTEST_ARGS ?=

.PHONY: setup bench test lint typecheck clean

$(SETUP_STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

$(TEST_STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh --test
	touch $@ $(SETUP_STAMP)

setup: $(SETUP_STAMP)

bench: $(SETUP_STAMP)
	$(VENV)/bin/servelab-run

lint: $(TEST_STAMP)
	$(PY) -m ruff check engine workloads profiling reports tests benchmarks

typecheck: $(TEST_STAMP)
	$(PY) -m mypy

test: $(TEST_STAMP) lint typecheck
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf runs outputs multirun test-output .pytest_cache .mypy_cache .ruff_cache
