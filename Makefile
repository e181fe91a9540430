# Two commands set everything up on a fresh machine: `make test` and `make demo`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch 2.13.0 installs quickly from local wheels here; on a CUDA machine pick your own,
# e.g. `make test TORCH_SPEC="torch==2.11.0"`.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: test demo env clean

env: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -r requirements.txt -r requirements-test.txt
	touch $@

test: env
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache demo_out
