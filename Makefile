# Quick start: `make demo` (installs, starts the local stack, runs the sample DAGs through
# DRLExecutor; ONCE=1 exits after the runs) and `make test` (installs, runs ruff, mypy, pytest
# with every service the tests need, started and stopped by the test harness).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed

.PHONY: install system-deps demo up down status test lint typecheck unit bench clean

$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(PIP) || $(PYTHON) -m venv --clear $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e ".[policy,trainer,dev]"
	touch $(STAMP)

# system-deps first: on Debian, python3 -m venv needs python3-venv (ensurepip)
install: system-deps $(STAMP)

system-deps:
	@bash scripts/system-deps.sh

up: install
	$(PY) scripts/localstack.py up

demo: up
	$(PY) scripts/demo.py $(if $(ONCE),--once,)

down:
	@if [ -x $(PY) ]; then $(PY) scripts/localstack.py down; else echo "nothing to stop"; fi

status:
	$(PY) scripts/localstack.py status

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(VENV)/bin/pytest -m "not integration" -q

test: install lint typecheck
	$(VENV)/bin/pytest -q

# the test stack too: an interrupted make test leaves it running (found by review)
clean: down
	@if [ -x $(PY) ]; then DRL_STACK_DIR=.stack-test $(PY) scripts/localstack.py down; fi
	rm -rf .stack .stack-test $(VENV)
