# Two entry points for a fresh machine (see README.md):
#   make demo   install into .venv and run `vidsparse demo`
#   make test   install into .venv and run the test suite
#   make test-fast   the same without the tests marked slow (under 3 minutes on 2 cores)
# TORCH picks the PyTorch build: the default is a CPU-friendly pin; on a GPU machine use e.g.
#   make demo TORCH=torch
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN     = $(VENV)/bin

.PHONY: demo test test-fast lint clean

$(BIN)/.vidsparse-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)" -e ".[test,plots]"
	touch $@

demo: $(BIN)/.vidsparse-installed
	$(BIN)/vidsparse demo --out out/demo

test: $(BIN)/.vidsparse-installed
	$(BIN)/python -m pytest -q

# Every test file keeps at least one unmarked test, so every module is still exercised.
test-fast: $(BIN)/.vidsparse-installed
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(BIN)/.vidsparse-installed
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) out build *.egg-info src/*.egg-info
