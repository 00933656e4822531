#!/usr/bin/env bash
# GPU check of kvd_kernels: the cuda-marked kernel tests, the GPU session test
# (tests/test_gpu_session.py), then scripts/bench_kernels.py.
# Runs from a checkout without installing it (GPU machines may have no network for build deps):
# kvd_kernels is made importable through a symlink on PYTHONPATH. Logs go to $LOG_DIR
# (default $OUT when set, else /tmp/kvd_gpu_check). Exit status: non-zero if the tests failed or
# the bench found a wrong result.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG_DIR=${LOG_DIR:-${OUT:-/tmp/kvd_gpu_check}}
mkdir -p "$LOG_DIR"
shim=$(mktemp -d)
ln -s "$PWD/kernels" "$shim/kvd_kernels"
ln -s "$PWD/client" "$shim/kvd_client"
export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$LOG_DIR/gpu.txt"
# --confcutdir keeps the daemon's conftests (and their zmq imports) out of this run
$PY -m pytest -m cuda tests/kernels -q -p no:cacheprovider --confcutdir=tests/kernels \
    -o addopts="" 2>&1 | tee "$LOG_DIR/pytest_cuda.log"
tests_rc=${PIPESTATUS[0]}
# GPU session buffers: a real --device cuda:0 daemon, two client processes over CUDA IPC
# (needs the daemon's deps: pyzmq, orjson, uvloop)
$PY -m pytest -m cuda tests/test_gpu_session.py -q -s -p no:cacheprovider -o addopts="" 2>&1 \
    | tee "$LOG_DIR/pytest_gpu_session.log"
gs_rc=${PIPESTATUS[0]}
[ "$tests_rc" -eq 0 ] && tests_rc=$gs_rc
$PY scripts/bench_kernels.py 2>&1 | tee "$LOG_DIR/bench.log"
bench_rc=${PIPESTATUS[0]}
exact=$(tail -n 1 "$LOG_DIR/bench.log" | $PY -c 'import json,sys; print(json.load(sys.stdin)["checks"]["all_exact"])' 2>/dev/null)
echo "gpu_check: pytest rc=$tests_rc bench rc=$bench_rc all_exact=$exact"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$exact" = "True" ]
