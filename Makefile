# Two commands do all the set-up on a fresh Debian 12 machine (run as root):
#   make run   - install, then run a real example in a bubblewrap sandbox
#   make test  - install, then lint, type-check and run the test suite (what CI runs)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SYSTEM_PACKAGES := bubblewrap util-linux e2fsprogs libseccomp2 procps python3

.PHONY: run test check lint typecheck pytest test-hostile bench doctor system venv clean

run: venv
	$(PY) examples/quickstart.py

test: venv check pytest

# System packages the sandboxes need; apt only runs when one is missing.
system:
	@missing=""; for p in $(SYSTEM_PACKAGES); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: system $(VENV)/.installed

check: lint typecheck

lint: venv
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples

typecheck: venv
	$(VENV)/bin/mypy

pytest: venv
	$(VENV)/bin/pytest -q

# Only the escape and exhaustion programs (they are also part of `make test`).
test-hostile: venv
	$(VENV)/bin/pytest -q -m hostile

bench: venv
	$(PY) bench/bench_core.py --rounds 5 --output BENCHMARKS.md
	$(PY) bench/bench_server.py --rounds 3 --output BENCHMARKS.md

doctor: venv
	$(VENV)/bin/agent-sandbox doctor

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info src/*.egg-info
