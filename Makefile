# The workbook's two commands: `make run` (all notebooks, headless, auto-detected profile) and
# `make test`. Both create .venv and install requirements.txt + the package when needed.
PYTHON ?= python3
VENV ?= .venv
PARAMS ?= auto
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test lab clean-venv

setup: $(STAMP)

# Re-install only when requirements or the package metadata change.
$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(STAMP)

run: setup
	$(BIN)/workbook run --params $(PARAMS)

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lab: setup
	$(BIN)/jupyter lab --notebook-dir=. notebooks/

clean-venv:
	rm -rf $(VENV)
