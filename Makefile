# Two entry points, both working on a fresh clone:
#   make demo   set up .venv and run the quickstart notebook in a real Jupyter kernel
#   make test   set up .venv (and what the browser tests need) and run every test
#   make lint   linters, and the documentation site built with --strict
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch that lies on this machine's disk; installing it first keeps
# "torch>=2.6.0" from pulling a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup demo test test-quick test-xla lint docs course clean browser extension

# uv installs the Python dependencies (in parallel, seconds where pip took minutes); pip
# installs torch alone, as only pip looks in the machine's own wheel folder for the CPU
# build. TORCH_PIN rides along in every uv install: a dependency asking for another torch
# then fails the install instead of pulling a CUDA build.
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "uv>=0.4"
UV_INSTALL = $(BIN)/uv pip install -q --python $(BIN)/python "$(TORCH_PIN)"

# The demo needs the package and a kernel only: no lab extension build (SKIP_JUPYTER_BUILDER
# skips its npm step), no test, lint or docs tools.
$(VENV)/.demo-installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	SKIP_JUPYTER_BUILDER=1 $(UV_INSTALL) -e ".[demo]"
	touch $@

# Everything else, then the lab extension: built with the jlpm that JupyterLab brings, and
# the package installed once more so that Jupyter's data folder holds the built extension.
BUILD_EXTENSION = cd extension && PATH="$(CURDIR)/$(BIN):$$PATH" jlpm install \
	&& PATH="$(CURDIR)/$(BIN):$$PATH" jlpm build:prod && cd .. \
	&& $(UV_INSTALL) --no-deps --reinstall-package notebook-launcher -e .
$(VENV)/.installed: $(VENV)/.demo-installed
	SKIP_JUPYTER_BUILDER=1 $(UV_INSTALL) -e ".[test,dev,docs]"
	$(BUILD_EXTENSION)
	touch $@

setup: $(VENV)/.installed

demo: $(VENV)/.demo-installed
	$(BIN)/python examples/run_notebook.py examples/01_quickstart.ipynb

# The quick tier, for work on the Python side: no lab extension build (so no node), no
# root, browser, Ray cluster or GPU; the tests that drive a real kernel, a browser or Ray,
# and those marked slow, are left to `make test`.
$(VENV)/.quick-installed: $(VENV)/.demo-installed
	SKIP_JUPYTER_BUILDER=1 $(UV_INSTALL) -e ".[test,dev]"
	touch $@

test-quick: $(VENV)/.quick-installed
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m "not kernel and not ray and not slow and not xla" \
		--ignore=tests/browser --durations=10 $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

# The sidebar's browser tests drive Debian's chromium through Playwright (never a browser
# downloaded by Playwright); installing it needs root, as on CI.
browser:
	@command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

# The install above builds the lab extension once; this rebuilds it after TypeScript changes.
extension: setup
	$(BUILD_EXTENSION)

# Most tests wait (for ranks, kernels, a server, a browser), so they run in TEST_WORKERS
# processes at once; tests/conftest.py keeps the ones that share a kernel, a server or a
# cluster in one worker, and hands out those groups first, the longest leading (hence
# --no-loadscope-reorder). The 25 slowest tests and the total close the run.
# pytest exits 5 when it collected no test: that is a failure here, not a pass.
# NOTEBOOK_LAUNCHER_BROWSER_TESTS=1 makes the browser tests fail, not skip, without chromium.
TEST_WORKERS ?= 4
test: setup browser
	NOTEBOOK_LAUNCHER_BROWSER_TESTS=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder \
		--durations=25 $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

# Opt-in: the real torch_xla on the CPU (PJRT_DEVICE=CPU). torch_xla needs its own torch
# (a CUDA build of torch 2.9 from PyPI: ~4 GB, ~3 min), so it gets a venv of its own; the
# package runs from this checkout (PYTHONPATH), which needs no lab extension build.
# The pair is Colab's TPU runtime's: torch 2.9.0 with torch_xla 2.9.0.
XLA_VENV := .venv-xla
XLA_PINS ?= "torch-xla==2.9.0" "torch==2.9.0"
$(XLA_VENV)/.installed:
	$(PYTHON) -m venv $(XLA_VENV)
	$(XLA_VENV)/bin/python -m pip install -q --upgrade pip
	$(XLA_VENV)/bin/python -m pip install -q $(XLA_PINS) "cloudpickle>=2.2" "tqdm>=4.60" \
		"jupyter_core>=5" "jupyter_server>=2" "pytest>=8" "pytest-timeout>=2.3" "psutil>=5.9"
	touch $@

test-xla: $(XLA_VENV)/.installed
	PYTHONPATH=$(CURDIR) PJRT_DEVICE=CPU $(XLA_VENV)/bin/python -m pytest -m xla -s tests/tpu/test_tpu_real_xla.py

# The runtimes users cannot change, each in a venv of its own under .compat/:
# Colab's and Kaggle's pins and the oldest declared floors. The package's wheel, built once
# from this checkout (the lab extension prebuilt by setup: no node), installs into each
# without moving a pin, then the kernel-facing tests of compat/tests.txt run there. The
# environments are built in parallel and reused while their pins and the wheel are unchanged.
COMPAT_ENVS ?= colab kaggle oldest
COMPAT_PYTEST_ARGS ?=
.PHONY: test-compat
test-compat: setup
	@test -f notebook_launcher/labextension/static/style.js || { \
		echo "the lab extension is not built: make extension"; exit 1; }
	rm -rf .compat/dist
	SKIP_JUPYTER_BUILDER=1 $(BIN)/uv build -q --wheel --python $(BIN)/python --out-dir .compat/dist .
	$(BIN)/python compat/run.py $(COMPAT_ENVS) --wheel .compat/dist/*.whl --uv $(BIN)/uv \
		-- $(COMPAT_PYTEST_ARGS)

# Python (ruff's linter and formatter, mypy) and the extension's TypeScript (eslint,
# prettier), as JupyterLab extensions lint it; jlpm comes with the test dependencies (jupyterlab).
lint: setup docs
	$(BIN)/ruff check notebook_launcher tests benchmarks examples docs/hooks compat
	$(BIN)/ruff format --check notebook_launcher tests benchmarks examples docs/hooks compat
	$(BIN)/mypy
	cd extension && PATH="$(CURDIR)/$(BIN):$$PATH" jlpm install && PATH="$(CURDIR)/$(BIN):$$PATH" jlpm lint:check

# The documentation site, into site/ (ignored by git). Not --quiet: it hides the warnings
# that --strict counts, and the build then passes. --strict: a broken link, a page left
# out of the nav or an API reference that does not resolve fails the build. The Python
# examples of the pages run in `make test` (tests/test_docs.py).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The course as the docs site shows it: each notebook of examples/course executed (2 CPU
# ranks, about a minute each) into docs/course, outputs and pictures kept. Rerun after
# changing a notebook: tests/test_course.py fails while a stored copy is stale. The
# deliberate errors of the failures notebook are kept as outputs (their cells are tagged
# raises-exception); any other error stops it.
course: setup
	mkdir -p docs/course
	cd examples/course && for notebook in *.ipynb; do \
		PYTHONPATH=$(CURDIR) $(CURDIR)/$(BIN)/jupyter nbconvert --to notebook --execute \
			--ExecutePreprocessor.timeout=300 --output-dir $(CURDIR)/docs/course $$notebook || exit 1; \
	done

clean:
	rm -rf $(VENV) $(XLA_VENV) .compat build dist site *.egg-info
