# `make demo` and `make test` work on a fresh machine: they create .venv and install everything.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup demo lint test docs compat bench-transport reproduce faults clean

setup: $(STAMP)

# Open MPI is the peer `bench allreduce --peer mpi` (and its test) measures against: installed
# with apt where this runs as root and mpirun is missing; elsewhere that one test is skipped.
$(STAMP): pyproject.toml
	@command -v mpirun >/dev/null || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null || \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null; } || \
		echo "note: Open MPI could not be installed: bench allreduce --peer mpi will not run"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[all]'
	touch $(STAMP)

demo: setup
	mkdir -p out
	$(PY) -m redsock bench allreduce --nprocs 4 -b 16 -e 64M -f 4 --algo auto,gloo --check \
		--json out/allreduce.json --plot out/allreduce.png

# The layers and no-cycles contracts (import-linter), style and import order (ruff), types (mypy);
# their settings, and the few deliberate exceptions, are in pyproject.toml.
lint: setup
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q

# The docs site in site/ (mkdocs.yml); --strict: a broken link or a reference entry that fails is an error.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# torch's own distributed test suite on redsock next to gloo, world sizes 2 and 3 (tests/compat/compat.py).
compat: setup
	$(PY) tests/compat/compat.py --world-sizes 2,3 --out out/compat

bench-transport: setup
	$(PY) -m redsock bench transport --local

# Measures the seed's claims in the emulated testbed (root) and writes docs/results.md, docs/results/.
# make reproduce: full, 12-26 minutes on 2 cores; make reproduce QUICK=1: about 2.5 minutes.
reproduce: setup
	$(PY) -m redsock reproduce $(if $(filter 1 yes true,$(QUICK)),--quick)

clean:
	rm -rf $(VENV) build site src/*.egg-info .pytest_cache .mypy_cache .ruff_cache .import_linter_cache

# The whole fault matrix of issue 38 (root, about 10 minutes on 2 cores): every cell as expected.
faults: setup
	REDSOCK_FAULTS_FULL=1 $(PY) -m pytest -q -s tests/test_faults.py
