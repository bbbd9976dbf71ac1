# minirt: `make run` serves SmolLM2-135M-Instruct (fetched once; offline the built-in tiny model), `make test` runs every check.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: install run test lint typecheck pytest test-slow clean

$(STAMP): pyproject.toml setup.py $(wildcard gpu/csrc/*)
	@start=$$(date +%s); \
	test -x $(PY) || python3 -m venv $(VENV); \
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"; \
	$(PY) -m pip install -q "setuptools>=70.1" && \
	$(PY) -m pip install -q --no-build-isolation -e ".[dev]" && \
	$(PY) -c "from gpu import kernels as k; o = k.library(); print('minirt: kernels', ' '.join(o.isas()), '- this CPU runs', o.isa())" && \
	touch $(STAMP) && \
	echo "minirt: install took $$(( $$(date +%s) - start ))s"

install: $(STAMP)

run: install
	$(VENV)/bin/minirt up

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install
	$(VENV)/bin/mypy messages actors gpu tokenizer_svc minirt

pytest: install
	$(VENV)/bin/pytest $(PYTEST_ARGS)

test: lint typecheck pytest

# The long soak and other slow tests (deselected by default); .ci/run runs them after `make test`.
test-slow: install
	$(VENV)/bin/pytest -m slow $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .minirt .pytest_cache .mypy_cache .ruff_cache
