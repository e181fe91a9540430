# Two commands set everything up on a fresh machine: `make test` and `make demo`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch 2.13.0 installs quickly from local wheels here; on a CUDA machine pick your own,
# e.g. `make test TORCH_SPEC="torch==2.11.0"`.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: test demo env browser clean test-floor test-latest

env: $(VENV)/.installed

# The real-browser test (tests/test_serve_browser.py) drives Debian's chromium through chromium-driver (no browser can
# be downloaded by the test itself). `make test` never installs it: without it that one test skips, saying so (under
# CI=true it fails). `make browser`, run as root (sudo make browser), installs it with apt-get; .ci/run does.
browser:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" != 0 ]; then echo "make browser installs system packages: run it as root (sudo make browser)"; exit 1; \
	elif command -v apt-get >/dev/null 2>&1; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; \
	else echo "no apt-get here: install chromium and chromedriver with this system's package manager"; exit 1; fi

$(VENV)/.installed: requirements.txt requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -r requirements.txt -r requirements-test.txt
	touch $@

test: env
	$(PY) -m pytest $(PYTEST_ARGS)

# The declared dependency range, tested (README, Install): each end in a venv of its own, on the tests of the library,
# kernels, processing, weights, predict and train. test-floor installs requirements.txt's floors exactly (torch,
# numpy, pillow, safetensors) and huggingface_hub, but no transformers (5.23 needs a newer safetensors): the tests
# that compare with it skip there, saying so; test-latest the newest torch (with its triton), numpy, pillow and
# safetensors, and the test requirements.
# PyPI's torch for Linux is a CUDA build (a few GB with its nvidia-* wheels); a machine-wide pip constraint file is
# set aside for these venvs alone (PIP_CONSTRAINT pointing to an empty file). Versions are printed before the tests.
RANGE_TESTS ?= tests/test_sapiens2.py tests/test_heads.py tests/test_kernels.py tests/test_processing.py \
	tests/test_weights.py tests/test_predict.py tests/test_train.py tests/test_one_module.py
FLOOR_SPECS := $(shell sed -e 's/[[:space:]]*\#.*//' -e '/^$$/d' -e 's/>=/==/' requirements.txt)
VERSIONS := torch|triton|numpy|pillow|safetensors|transformers

.venv-floor/.installed: requirements.txt
	rm -rf .venv-floor && $(PYTHON) -m venv .venv-floor && : > .venv-floor/no-constraints.txt
	PIP_CONSTRAINT=$(CURDIR)/.venv-floor/no-constraints.txt .venv-floor/bin/python -m pip install -q $(FLOOR_SPECS) "pytest>=8" \
		huggingface_hub
	touch $@

.venv-latest/.installed: requirements.txt requirements-test.txt
	rm -rf .venv-latest && $(PYTHON) -m venv .venv-latest && : > .venv-latest/no-constraints.txt
	PIP_CONSTRAINT=$(CURDIR)/.venv-latest/no-constraints.txt .venv-latest/bin/python -m pip install -q -U torch \
		numpy pillow safetensors -r requirements-test.txt
	touch $@

test-floor test-latest: test-%: .venv-%/.installed
	@echo "$@ on: $$(.venv-$*/bin/python -m pip list --format=freeze 2>/dev/null | grep -iE '^($(VERSIONS))==' | tr '\n' ' ')"
	OMP_NUM_THREADS=1 .venv-$*/bin/python -m pytest -rs -p no:cacheprovider $(RANGE_TESTS) $(PYTEST_ARGS)

# The bundled photo (assets/astronaut.jpg) through seg + normal + pose; pictures in demo_out/. Downloads the
# DEMO_MODEL checkpoints when it can (0.4b: about 5 GB, cached in ~/.cache/sapiens2); without network or weights
# it runs the same pipeline with random weights on the 0.1b backbone and says loudly that the pictures are
# meaningless.
DEMO_MODEL ?= 0.4b
demo: env
	$(PY) predict.py seg,normal,pose assets/astronaut.jpg -o demo_out --model $(DEMO_MODEL) \
		--random-init fallback --random-backbone 0.1b
	@echo "pictures: $$(ls demo_out/*.jpg demo_out/*.normal.png | tr '\n' ' ')"

clean:
	rm -rf $(VENV) .venv-floor .venv-latest .pytest_cache demo_out
