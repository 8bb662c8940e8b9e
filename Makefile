# The workbook's commands: `make run` (all notebooks, headless, auto-detected profile; one line per
# notebook, VERBOSE=1 prints every cell), `make test` (the whole suite, as CI runs it) and
# `make test-fast` (the unit tier: no notebook, multi-process, browser or slow test). Each creates
# .venv and installs requirements.txt + the package when needed.
PYTHON ?= python3
VENV ?= .venv
PARAMS ?= auto
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# tests/test_browser.py drives Debian's chromium (Playwright's own browser download cannot work on
# a closed network). BROWSER_TESTS=0 skips installing it; the browser test then skips itself.
CHROMIUM := /usr/bin/chromium
BROWSER_TESTS ?= 1
# The unit tier `make test-fast` selects (pyproject.toml says what each marker means).
FAST_TIER := not notebook and not multiprocess and not browser and not slow

.PHONY: setup chromium run test test-fast lab clean-venv

setup: $(STAMP)

# Re-install only when requirements or the package metadata change.
$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(STAMP)

chromium: $(CHROMIUM)

# Installed once, as root (CI), non-interactively; anyone else gets told what to run.
$(CHROMIUM):
	@if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	  echo "make test: $(CHROMIUM) is missing; the browser test (tests/test_browser.py) needs Debian's chromium." >&2; \
	  echo "  Install it once: sudo apt-get install chromium   (or run make test as root: it installs it)" >&2; \
	  echo "  Or run the other tests without it: make test BROWSER_TESTS=0" >&2; \
	  exit 1; \
	fi
	DEBIAN_FRONTEND=noninteractive apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium
	test -x $(CHROMIUM)

run: setup
	$(BIN)/workbook run --params $(PARAMS)$(if $(filter 1,$(VERBOSE)), --verbose)

test: setup $(if $(filter 0,$(BROWSER_TESTS)),,chromium)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -m "$(FAST_TIER)" $(PYTEST_ARGS)

# JupyterLab refuses to start as root (the usual user in a rented GPU container) without --allow-root.
LAB_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root)

lab: setup
	$(BIN)/jupyter lab --notebook-dir=. $(LAB_ARGS) notebooks/

clean-venv:
	rm -rf $(VENV)
