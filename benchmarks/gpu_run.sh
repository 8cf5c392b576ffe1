#!/usr/bin/env bash
# The GPU checks in one run, for a machine with an NVIDIA GPU, CuPy, Numba,
# numba-cuda, torch and pytest but no network: the CUDA tests (exact kernel,
# its backward, the tensor-core kernel, the mma emulator against the hardware),
# compute-sanitizer on the kernel, and the GPU benchmark. About 5 minutes.
#
# Usage: benchmarks/gpu_run.sh OUT_DIR
#
# Packages the machine lacks (array-api-compat) travel as wheels in .whl/ of the
# repository root, fetched beforehand on a machine with pip:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_17_x86_64 --platform any -d .whl array-api-compat
# The project itself runs from src/ (no install). OUT_DIR receives at most
# seven files: gpu.txt (nvidia-smi), tests.txt, tests.xml, sanitize.tgz, gpu.json,
# gpu.md and run.log (everything printed).
set -u
out="${1:?usage: benchmarks/gpu_run.sh OUT_DIR}"
mkdir -p "$out"
exec > >(tee "$out/run.log") 2>&1
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/polyattn-site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/polyattn-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD/src:$PWD/tests:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
export POLYATTN_TEST_BACKENDS=cupy
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu \
    --format=csv > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"

echo "== tests"
# Each test compiles its kernels first (seconds each): with pytest-xdist, eight
# processes compile side by side.
parallel=""
python3 -c "import xdist" 2>/dev/null && parallel="-n 8"
timeout 170 python3 -m pytest -q -p no:cacheprovider $parallel tests/backends/cuda/test_cuda_tensor_core.py \
    tests/backends/cuda/test_cuda_tiled.py tests/backends/cuda/test_cuda_tiled_backward.py tests/backends/cuda/test_cuda_rows.py \
    tests/backends/cuda/test_cuda_rows_backward.py --junitxml="$out/tests.xml" > "$out/tests.txt" 2>&1
echo "tests: exit $?"; tail -15 "$out/tests.txt"

echo "== compute-sanitizer"
timeout 60 bash benchmarks/sanitize.sh /tmp/polyattn-sanitize
echo "sanitize: exit $?"
tar czf "$out/sanitize.tgz" -C /tmp polyattn-sanitize 2>/dev/null

echo "== benchmark"
timeout 120 python3 benchmarks/gpu.py --quick --out "$out/gpu.json"
echo "gpu.py: exit $?"
