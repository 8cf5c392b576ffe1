#!/usr/bin/env bash
# Run the Numba CUDA kernel under NVIDIA compute-sanitizer.
#
# Usage: benchmarks/sanitize.sh [LOG_DIR] [-- ARGS FOR sanitize_cases.py]
#
# Runs benchmarks/sanitize_cases.py (every kernel feature on small CuPy arrays,
# checked against a float64 reference) once per tool: memcheck (out-of-bounds
# and misaligned accesses) and racecheck (shared-memory hazards); set
# SANITIZE_TOOLS="memcheck racecheck synccheck initcheck" for more. Each tool
# writes LOG_DIR/<tool>.log (the sanitizer's report) and LOG_DIR/<tool>.out
# (the cases' output). LOG_DIR defaults to benchmarks/results/sanitize.
#
# Exit status: 0 when every tool reports 0 errors and every case matches the
# reference; 1 otherwise. Without a GPU, compute-sanitizer or CuPy it prints
# "no GPU: skipping" and exits 0. PYTHON selects the interpreter.
set -u

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
log_dir="$here/results/sanitize"
if [[ $# -gt 0 && "$1" != "--" ]]; then
    log_dir="$1"
    shift
fi
[[ "${1:-}" == "--" ]] && shift
python="${PYTHON:-python}"
tools="${SANITIZE_TOOLS:-memcheck racecheck}"

skip() {
    echo "no GPU: skipping ($1)"
    exit 0
}

command -v nvidia-smi >/dev/null 2>&1 || skip "nvidia-smi not found"
nvidia-smi -L >/dev/null 2>&1 || skip "nvidia-smi finds no GPU"
sanitizer="$(command -v compute-sanitizer 2>/dev/null || true)"
for candidate in "${CUDA_HOME:-}/bin/compute-sanitizer" /usr/local/cuda/bin/compute-sanitizer; do
    if [[ -z "$sanitizer" && -x "$candidate" ]]; then
        sanitizer="$candidate"
    fi
done
[[ -n "$sanitizer" ]] || skip "compute-sanitizer not found (CUDA toolkit)"
"$python" -c "import cupy; assert cupy.cuda.runtime.getDeviceCount() > 0" >/dev/null 2>&1 \
    || skip "CuPy cannot reach a GPU"

mkdir -p "$log_dir"
unset NUMBA_ENABLE_CUDASIM
export PYTORCH_NO_CUDA_MEMORY_CACHING=1   # torch tensors: no caching allocator either
{
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    "$sanitizer" --version | tail -n 1
} > "$log_dir/environment.txt" 2>&1

status=0
for tool in $tools; do
    echo "== $tool"
    "$sanitizer" --tool "$tool" --error-exitcode 99 --log-file "$log_dir/$tool.log" \
        "$python" "$here/sanitize_cases.py" "$@" > "$log_dir/$tool.out" 2>&1
    rc=$?
    summary="$(grep -h "ERROR SUMMARY" "$log_dir/$tool.log" 2>/dev/null | tail -n 1 | sed "s/^=* *//")"
    cases="$(tail -n 1 "$log_dir/$tool.out")"
    echo "   ${summary:-no error summary}; $cases (exit $rc)"
    if [[ $rc -ne 0 ]]; then
        status=1
        grep -m 20 -E "^=+ +(Invalid|Race|Error|Barrier|Uninitialized)" "$log_dir/$tool.log" || true
        grep -E "^FAIL" "$log_dir/$tool.out" || true
    fi
done

if [[ $status -eq 0 ]]; then
    echo "compute-sanitizer: no errors (logs in $log_dir)"
else
    echo "compute-sanitizer: errors found (logs in $log_dir)" >&2
fi
exit $status
