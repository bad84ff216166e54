# `make demo` and `make test` work on a fresh machine: they create .venv and install everything.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup demo test bench-transport reproduce clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[all]'
	touch $(STAMP)

demo: setup
	$(PY) -m redsock demo

test: setup
	$(PY) -m pytest -q

bench-transport: setup
	$(PY) -m redsock bench transport --local

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
