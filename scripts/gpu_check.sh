#!/usr/bin/env bash
# One call on a machine with an NVIDIA GPU: what the machine is, the GPU tests, the GPU
# benchmark and a short training run from the command line, everything written under
# RESULTS_DIR.
#
#   bash scripts/gpu_check.sh RESULTS_DIR          # on the GPU machine, from the repo root
#   bash scripts/gpu_check.sh --dry RESULTS_DIR    # anywhere: the same steps, tiny sizes,
#                                                  # on the strict array (npformer.strict)
#
# Each step runs under its own time limit and the script goes on past a failure. Each
# writes RESULTS_DIR/STEP.log; RESULTS_DIR/steps.tsv has one row per step: its name, its
# status (ok, failed, timeout, or skipped with the reason), exit status, wall seconds, time
# limit and command (shell-quoted). The script's own exit status is 0 when it ran every step to the end,
# whatever the steps gave: read steps.tsv.
#
# The machine needs python3 with NumPy and CuPy (PyTorch for the benchmark); nothing is
# installed or downloaded, and the package runs from src/ (PYTHONPATH=src). Without
# pytest the GPU tests run through scripts/plain_tests.py, and steps.tsv says so.
# --dry uses .venv/bin/python when there is one. Settings (environment variables):
#   GPU_CHECK_BUDGET   seconds for the whole script (default 420); a step's limit is cut
#                      to what is left, and a step with under 5 s left is skipped
#   GPU_CHECK_REPEATS  timed steps per side in the benchmark (default 5)
#   PYTHON             the interpreter (default python3)
set -u
cd "$(dirname "$0")/.."

DRY=0
if [ "${1:-}" = "--dry" ]; then DRY=1; shift; fi
if [ $# -ne 1 ]; then
    echo "usage: bash scripts/gpu_check.sh [--dry] RESULTS_DIR" >&2
    exit 2
fi
R=$1
mkdir -p "$R" || exit 2
R=$(cd "$R" && pwd)
if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    if [ "$DRY" = 1 ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
BUDGET=${GPU_CHECK_BUDGET:-420}
REPEATS=${GPU_CHECK_REPEATS:-5}
START=$(date +%s)
WORK=$(mktemp -d)  # the training run's checkpoint: kept out of RESULTS_DIR
trap 'rm -rf "$WORK"' EXIT
printf 'step\tstatus\texit\tseconds\tlimit_s\tcommand\n' > "$R/steps.tsv"

record() {  # NAME STATUS EXIT SECONDS LIMIT COMMAND
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >> "$R/steps.tsv"
    printf '%-14s %-40s %6s s\n' "$1" "$2" "$4"
}

skip() {  # NAME REASON
    echo "skipped: $2" > "$R/$1.log"
    record "$1" "skipped: $2" - 0 - -
}

step() {  # NAME LIMIT COMMAND...: run COMMAND under the limit, output to NAME.log
    local name=$1 limit=$2 left rc t0 t1 status
    shift 2
    left=$((BUDGET - ($(date +%s) - START)))
    if [ "$left" -lt 5 ]; then
        skip "$name" "out of time (budget ${BUDGET} s)"
        return
    fi
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
    t0=$(date +%s.%N)
    timeout -k 5 "$limit" "$@" > "$R/$name.log" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    case $rc in
        0) status=ok ;;
        124 | 137) status=timeout ;;
        5) status=failed  # pytest's (and plain_tests.py's) 5: no test ran
           if [ "${name#pytest}" != "$name" ]; then status="skipped: no test ran (exit 5)"; fi ;;
        *) status=failed ;;
    esac
    printf -v command '%q ' "$@"
    record "$name" "$status" "$rc" "$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')" \
        "$limit" "${command//$'\n'/ }"
}

has_module() { "$PYTHON" -c "import $1" > /dev/null 2>&1; }

# The CLI on the device: "cuda" as users run it; the dry run registers the strict array
# first (npformer.strict.register), as tests/test_device.py does.
if [ "$DRY" = 1 ]; then
    DEVICE=strict
    CLI=("$PYTHON" -c "import sys; import npformer.strict as s; s.register(); \
from npformer.cli import main; sys.exit(main(sys.argv[1:]))")
    SIZES=(--steps 4 --n-layer 1 --n-head 2 --d-model 16 --block-size 16 --batch-size 2
           --eval-interval 2 --eval-batches 1)
    BENCH=(--device strict --models gpt_baby --repeats 1 --warmup 0)
else
    DEVICE=cuda
    CLI=("$PYTHON" -m npformer)
    SIZES=(--steps 40 --eval-interval 20 --eval-batches 2)  # the baby GPT: the defaults
    BENCH=(--device cuda --models gpt_baby,gpt2_small --repeats "$REPEATS" --warmup 1)
fi
echo "gpu_check: device $DEVICE, python $PYTHON, results in $R, budget ${BUDGET} s"

step system 10 bash -c 'date -u; uname -a; nproc; free -g; df -h .; git rev-parse HEAD'

if command -v nvidia-smi > /dev/null; then
    step nvidia_smi 20 nvidia-smi
    step nvidia_smi_q 20 nvidia-smi -q
else
    skip nvidia_smi "nvidia-smi not found"
    skip nvidia_smi_q "nvidia-smi not found"
fi

step versions 60 "$PYTHON" - <<'EOF'
import importlib
import platform
import sys

print("python", sys.version.replace("\n", " "), platform.machine())
for name in ("numpy", "scipy", "sympy", "safetensors", "cupy", "torch", "numba", "pytest",
             "npformer"):
    try:
        module = importlib.import_module(name)
        print(f"{name:12s} {getattr(module, '__version__', '?'):12s} {module.__file__}")
    except Exception as err:  # numba-cuda, say, may fail on import: say how
        print(f"{name:12s} not importable: {type(err).__name__}: {err}")
try:
    import cupy
    rt = cupy.cuda.runtime
    print("CUDA runtime", rt.runtimeGetVersion(), "driver", rt.driverGetVersion())
    for i in range(rt.getDeviceCount()):
        p = rt.getDeviceProperties(i)
        print(f"device {i}: {p['name'].decode()}, compute capability {p['major']}.{p['minor']},"
              f" {p['totalGlobalMem'] / 2**30:.1f} GiB, {p['multiProcessorCount']} SMs")
except Exception as err:
    print("CuPy's devices: none:", type(err).__name__, err)
try:
    import torch
    print("torch CUDA", torch.version.cuda, "available", torch.cuda.is_available(),
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
except Exception as err:
    print("torch: ", type(err).__name__, err)
EOF

NVCC=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2> /dev/null || true)
if [ -n "$NVCC" ]; then
    step nvcc 10 "$NVCC" --version
else
    skip nvcc "nvcc not found"
fi

if has_module cupy; then
    step cupy_config 60 "$PYTHON" -c "import cupy; cupy.show_config()"
    # NVRTC and the CUDA headers: an element-wise kernel of CuPy's own, the book's CUDA
    # kernels (book/kernels.md) compiled in both precisions, and a matrix product's rate.
    step cupy_kernels 90 "$PYTHON" - <<'EOF'
import re
import time

import cupy
import numpy as np

from npformer.kernels import CUDA_SOURCE, cuda_function

t0 = time.perf_counter()
axpy = cupy.ElementwiseKernel("float32 x, float32 a", "float32 y", "y += a * x", "axpy")
x, y = cupy.arange(1000, dtype=cupy.float32), cupy.ones(1000, dtype=cupy.float32)
axpy(x, np.float32(2), y)
assert np.array_equal(y.get(), 1 + 2 * np.arange(1000, dtype=np.float32)), "axpy is wrong"
print(f"ElementwiseKernel compiled and run in {time.perf_counter() - t0:.2f} s")
names = re.findall(r"__global__ void (\w+)\(", CUDA_SOURCE)
for dtype in ("float32", "float64"):
    t0 = time.perf_counter()
    for name in names:
        cuda_function(name, dtype)
    print(f"{len(names)} kernels of book/kernels.md in {dtype}: compiled in "
          f"{time.perf_counter() - t0:.2f} s")
a = cupy.random.default_rng(0).standard_normal((4096, 4096), dtype=cupy.float32)
a @ a
cupy.cuda.Device().synchronize()
t0 = time.perf_counter()
for _ in range(10):
    a @ a
cupy.cuda.Device().synchronize()
rate = 2 * 4096**3 * 10 / (time.perf_counter() - t0) / 1e12
print(f"4096^3 float32 product (CUPY_TF32 unset): {rate:.1f} TFLOP/s")
EOF
else
    skip cupy_config "CuPy not importable"
    skip cupy_kernels "CuPy not importable"
fi

step cli_train 90 "${CLI[@]}" train gpt --data pydoc --out "$WORK/run" "${SIZES[@]}" \
    --device "$DEVICE"
cp "$WORK/run/log.jsonl" "$R/cli_train_log.jsonl" 2> /dev/null
step cli_sample 45 "${CLI[@]}" sample "$WORK/run" --prompt 'The ' --max-new-tokens 200 \
    --device "$DEVICE"

if has_module pytest; then
    step pytest_gpu 150 "$PYTHON" -m pytest tests/test_gpu.py -m gpu -v -rA \
        -p no:cacheprovider --junitxml "$R/pytest_gpu.xml"
else  # the same tests through the stand-in; steps.tsv's command column says so
    echo "gpu_check: no pytest here; tests/test_gpu.py runs through scripts/plain_tests.py"
    step pytest_gpu 150 "$PYTHON" scripts/plain_tests.py tests/test_gpu.py \
        -m gpu --junitxml "$R/pytest_gpu.xml"
fi

if has_module torch; then
    step bench_gpu 240 "$PYTHON" bench/gpu.py "${BENCH[@]}" --json "$R/gpu_results.json"
else
    skip bench_gpu "torch not importable (the benchmark's other side)"
fi

echo "gpu_check: done in $(($(date +%s) - START)) s; see $R/steps.tsv"
