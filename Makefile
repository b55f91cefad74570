# Two commands on a fresh machine:  make demo   and   make test
# Both create .venv on first use. Without a GPU they install torch's CPU build
# (2.13.0, served from local disk here) first, so pip never pulls a CUDA torch.

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?= -q

.PHONY: demo test lint bench-quick protos clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	-$(PY) -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    echo "GPU found: installing CUDA torch"; $(PY) -m pip install -q "torch>=2.4"; \
	else \
	    echo "no GPU: installing CPU torch 2.13.0"; $(PY) -m pip install -q torch==2.13.0; \
	fi
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m kvstore demo

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# ruff (rules and complexity), one format, the rooms' import contract
# (pyproject.toml [tool.importlinter]) and dead code.
lint: $(STAMP)
	$(VENV)/bin/ruff check kvstore tests bench
	$(VENV)/bin/ruff format --check kvstore tests bench
	$(VENV)/bin/lint-imports
	$(VENV)/bin/vulture kvstore --min-confidence 80 --exclude kvstore/_proto

bench-quick: $(STAMP)
	$(PY) bench/copy_engine.py --quick
	$(PY) bench/router.py --quick
	$(PY) bench/transfer.py --quick
	$(PY) bench/router_trace.py --quick --out /tmp/kvstore-router-trace-quick.json

protos: $(STAMP)
	$(PY) -m kvstore.protogen

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
