# dsr1kit: two commands do all the set-up on a fresh Debian machine with Python 3.11.
#   make demo   every notebook on the embedded tiny model (CPU), reports under runs/
#   make test   the test suite
# Both create .venv (pip, pinned CPU lock in requirements/cpu.txt) and install the
# Debian packages the tests need when missing; re-running them skips finished steps.

PYTHON  ?= $(shell command -v python3.11 || command -v python3)
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
DEBS    :=
PYTEST_ARGS ?=

.PHONY: demo test venv sysdeps lab clean-runs data

demo: venv
	$(BIN)/dsr1kit demo

test: venv sysdeps
	$(BIN)/python -m pytest $(PYTEST_ARGS)

venv: $(STAMP)

$(STAMP): requirements/cpu.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -r requirements/cpu.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	@touch $@

sysdeps:
	@scripts/install_sysdeps.sh $(DEBS)

data: venv
	$(BIN)/python -m dsr1kit.data.synthetic data

clean-runs:
	rm -rf runs
