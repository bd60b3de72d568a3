# Two commands do everything on a fresh machine:
#   make demo   set up, then run the whole loop on GELU (GPU if there is one, else CPU)
#   make test   set up, then lint and run the CPU test suite (Triton via its interpreter)
# Set-up is idempotent: a second run reuses .venv and installs nothing new.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
READY  := $(VENV)/.perfloop-ready

.PHONY: demo test lint gpu-check multi-gpu-check setup clean

setup: $(READY)

# Debian's Chromium, for the test that opens the HTML report in a real browser.
CHROMIUM := $(VENV)/.chromium-ready
$(CHROMIUM): $(READY)
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "note: no chromium and not root: the browser test of the report will skip"; fi; }
	touch $@

$(READY): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The CPU build of torch, pinned, only when the venv has no torch yet (never a multi-GB CUDA build).
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: $(READY)
	$(VENV)/bin/perfloop demo

lint: $(READY)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

test: $(READY) $(CHROMIUM) lint
	TRITON_INTERPRET=1 $(PY) -m pytest -q --durations=40 tests

# On the GPU machine as its image stands (system python3, no install, no network):
gpu-check:
	bash scripts/gpu-check

multi-gpu-check:
	bash scripts/multi-gpu-check

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
