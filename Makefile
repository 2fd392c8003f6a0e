# The two set-up commands of README.md: `make demo` (the main job) and `make test` (every test).
# Both create a virtualenv in .venv with the project and its dev tools on first use.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint typecheck unit integration crd golden clean

$(BIN)/xpyd: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

demo: $(BIN)/xpyd
	$(BIN)/python scripts/demo.py

test: lint typecheck
	$(BIN)/python -m pytest

lint: $(BIN)/xpyd
	$(BIN)/ruff check .

typecheck: $(BIN)/xpyd
	$(BIN)/mypy

unit: $(BIN)/xpyd
	$(BIN)/python -m pytest -m unit

integration: $(BIN)/xpyd
	$(BIN)/python -m pytest -m integration

# Regenerate what is generated from the models and templates (tests fail when they are stale).
crd: $(BIN)/xpyd
	$(BIN)/xpyd crd > crds/xpyd.io_disaggregatedservings.yaml

golden: $(BIN)/xpyd
	XPYD_UPDATE_GOLDEN=1 $(BIN)/python -m pytest -q tests/unit/test_render.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
