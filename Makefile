# Two entry points, both working on a fresh clone:
#   make demo   set up .venv and run the quickstart notebook in a real Jupyter kernel
#   make test   set up .venv (and what the browser tests need) and run every test
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch that lies on this machine's disk; installing it first keeps
# "torch>=2.4" from pulling a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup demo test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[test,dev]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/python examples/run_notebook.py examples/01_quickstart.ipynb

# pytest exits 5 when it collected no test: that is a failure here, not a pass.
test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

lint: setup
	$(BIN)/ruff check notebook_launcher tests benchmarks examples
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build dist *.egg-info
