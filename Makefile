# Two entry points for a fresh machine (see README.md):
#   make demo   install into .venv and run `vidsparse demo`
#   make test   install into .venv and run the test suite
#   make install   the install alone (CI installs its two toolchains first, then tests both)
#   make test-fast   the same without the tests marked slow (under 3 minutes on 2 cores)
# TORCH picks the PyTorch build: the default is a CPU-friendly pin; on a GPU machine use e.g.
#   make demo TORCH=torch
# CONSTRAINTS names a pip constraints file for the install (CI's toolchains: .ci/constraints-*.txt).
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
CONSTRAINTS ?=
BIN     = $(VENV)/bin

# The install stamp holds the TORCH (and CONSTRAINTS) it was made with: a different value (or a
# newer pyproject.toml or constraints file) reinstalls, and --upgrade makes pip replace a torch
# already there.
STAMP   = $(BIN)/.vidsparse-installed
INSTALLED_WITH = $(strip $(TORCH) $(CONSTRAINTS))

.PHONY: install demo test test-fast lint clean FORCE

ifneq ($(strip $(shell cat $(STAMP) 2>/dev/null)),$(INSTALLED_WITH))
$(STAMP): FORCE
endif

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --upgrade$(if $(CONSTRAINTS), -c "$(CONSTRAINTS)") "$(TORCH)" -e ".[test]"
	printf '%s\n' "$(INSTALLED_WITH)" > $@

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/vidsparse demo --out out/demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

# Every test file keeps at least one unmarked test, so every module is still exercised.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) out build *.egg-info src/*.egg-info
