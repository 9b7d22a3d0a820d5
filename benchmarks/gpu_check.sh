#!/usr/bin/env bash
# The GPU check: one command on an offline machine with an NVIDIA GPU and its own torch, under 6 minutes.
#
#   make gpu-wheels                          # here, with network: .gpu-wheels/ and .gpu-models/ (a few MiB)
#   bash benchmarks/gpu_check.sh             # there, from the repository root, with both folders sent along
#   make gpu-dryrun                          # here: a stand-in of that machine on CPU, offline (--dry-run)
#
# 1. what the machine is (Python, torch, CUDA, the GPU, each of lmppo's needs: have / need);
# 2. install, offline: the wheelhouse on top of the machine's packages, lmppo itself --no-deps;
# 3. `pytest -m gpu tests/test_gpu.py` (at most 2 minutes);
# 4. benchmarks/bench_gpu.py (rows until about 5.5 minutes from the start, then it stops itself).
# Everything goes to $OUT (./gpu-out when unset): gpu_check.log, gpu_tests.xml, gpu_bench.md, gpu_bench.jsonl.
# PYTHON picks the interpreter (default python3); every step prints a progress line.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-gpu-out}
WHEELS=${WHEELS:-.gpu-wheels}
DRY_RUN=0
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
START=$SECONDS
step() { echo "[gpu_check +$((SECONDS - START))s] $*"; }
fail() { step "FAILED: $*"; exit 1; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

step "1/4 the machine"
date -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || [ $DRY_RUN = 1 ] || fail "no nvidia-smi"
"$PYTHON" benchmarks/gpu_env.py || fail "$PYTHON cannot run (is it the interpreter with torch?)"

step "2/4 install, offline"
[ -f "$WHEELS/requirements.txt" ] || fail "$WHEELS/requirements.txt is missing: run \`make gpu-wheels\` and send $WHEELS along"
[ -f .gpu-models/smollm2-135m/tokenizer.json ] || fail ".gpu-models/smollm2-135m is missing: run \`make gpu-wheels\` and send it along"
"$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" -r "$WHEELS/requirements.txt" || fail "the wheelhouse did not install"
if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation -e . ; then
  step "lmppo did not install as a package: importing it from src/ instead"
  export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PYTHON" benchmarks/gpu_env.py --require || fail "lmppo's needs are not met (above)"
"$PYTHON" -m lmppo --help > /dev/null || fail "the lmppo command does not start"

if [ $DRY_RUN = 1 ]; then
  step "3/4 collect the gpu tests; run the CLI ones on the CPU"
  "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu --collect-only tests/test_gpu.py || fail "the gpu tests do not collect"
  # the two that need no SmolLM2-sized model run on the CPU: the CLI end to end on the machine's versions
  LMPPO_GPU_TESTS_DEVICE=cpu "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k "resume or eval" \
    || fail "the gpu tests' CLI runs fail on the CPU"
  step "4/4 the benchmark's rows and their plans"
  "$PYTHON" benchmarks/bench_gpu.py --dry-run --out "$OUT" || fail "bench_gpu.py --dry-run"
  step "dry run passed"
  exit 0
fi

step "3/4 pytest -m gpu"
CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 120 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -rA --durations=0 \
  --junitxml="$OUT/gpu_tests.xml"
tests=$?
step "tests exited $tests"

step "4/4 bench_gpu.py"
left=$((330 - (SECONDS - START)))
timeout $((left + 20)) "$PYTHON" benchmarks/bench_gpu.py --deadline-s "$left" --out "$OUT"
bench=$?
step "bench exited $bench; results in $OUT"
exit $((tests || bench))
