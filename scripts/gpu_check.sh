#!/usr/bin/env bash
# GPU checks and benchmarks in one call (< 8 minutes on one GPU):
#   1. install the package (native core built) with the dev extra (triton) where needed,
#   2. run the accelerator tests compiled on the GPU (tests/test_kernels.py, tests/test_device_store.py),
#   3. python -m tiergram.bench.gpu --json: pinned H2D and D2D copy limits, UVA / resident / HBM-cache gather
#      bandwidth, the DeviceTable step, end-to-end engine throughput with the tables resident / pinned host / file
#      (the default model's geometry with random weights, or the trained model $TIERGRAM_MODEL names).
# Figures: $OUT/gpu_check.json when $OUT is set, else build/gpu_check.json; the log sits next to them.
# Exit status: 0 when the tests pass and every measurement ran; the first failing step's status otherwise
# (124: a step ran out of time). Each step has a timeout, all of them together $TOTAL_TIMEOUT seconds; the
# benchmark rewrites its JSON after every measurement, so a run cut short keeps what it measured.
# GPU_CHECK_DRY_RUN=1 runs the plumbing on a CPU-only machine: no install, interpreted tests, a tiny benchmark.
set -euo pipefail

cd "$(dirname "$0")/.."
DEST="${OUT:-build}"
mkdir -p "$DEST"
LOG="$DEST/gpu_check.log"
: >"$LOG"
INSTALL_TIMEOUT="${INSTALL_TIMEOUT:-150}"
TEST_TIMEOUT="${TEST_TIMEOUT:-150}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-150}"
TOTAL_TIMEOUT="${TOTAL_TIMEOUT:-470}"  # every step's timeout is cut to what is left of this (seconds)
export PYTHONUNBUFFERED=1

say() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$LOG"; }
run() {  # run TIMEOUT CMD...: CMD under a timeout, its output to the terminal and the log; returns its status
    local t="$1"; shift
    local left=$((TOTAL_TIMEOUT - SECONDS - 12))
    if [ "$left" -lt "$t" ]; then t="$left"; fi
    if [ "$t" -le 0 ]; then say "no time left for: $*"; return 124; fi
    set +e
    timeout --kill-after=10 "$t" "$@" 2>&1 | tee -a "$LOG"
    local rc="${PIPESTATUS[0]}"
    set -e
    return "$rc"
}

# the interpreter: $PYTHON, else the first of python3 / python that imports torch (a GPU image may have no
# `python`, or one without torch)
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    for cand in python3 python; do
        if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import torch' >/dev/null 2>&1; then PY="$cand"; break; fi
    done
    PY="${PY:-python3}"
fi

DRY="${GPU_CHECK_DRY_RUN:-0}"
BENCH_ARGS=()
say "python: $PY $($PY -c 'import sys; print(sys.version.split()[0])' 2>&1)"
if [ "$DRY" = 1 ]; then
    say "dry run: CPU only, no install, tiny benchmark"
    BENCH_ARGS=(--device cpu --small --backend torch)
elif ! $PY -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    say "torch.cuda.is_available() is False: no GPU to check (torch $($PY -c 'import torch; print(torch.__version__)'))"
    exit 2
fi
if [ "$DRY" != 1 ]; then
    $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))' \
        | tee -a "$LOG"
    nvidia-smi --query-gpu=name,memory.used,memory.total,pcie.link.gen.current,pcie.link.width.current \
        --format=csv 2>&1 | tee -a "$LOG" || true
fi

# 1. install: the dev extra when triton is missing; offline machines keep what they have (--no-deps retry)
# (--no-build-isolation: scikit-build-core, nanobind, cmake and ninja must be installed already; nothing is fetched)
install_rc=0
with_deps=0
if [ "$DRY" = 1 ]; then
    say "dry run: using the installed package"
elif $PY -c 'import triton' 2>/dev/null; then
    say "triton $($PY -c 'import triton; print(triton.__version__)') present: installing the package only"
    run "$INSTALL_TIMEOUT" $PY -m pip install --no-build-isolation --no-deps -e . || install_rc=$?
else
    say "installing with the dev extra (triton)"
    with_deps=1
    run "$INSTALL_TIMEOUT" $PY -m pip install --no-build-isolation -e '.[dev]' || install_rc=$?
fi
if [ "$install_rc" -ne 0 ] && [ "$with_deps" = 1 ]; then  # the same command again would fail the same way
    say "install failed ($install_rc); retrying without dependencies"
    install_rc=0
    run "$INSTALL_TIMEOUT" $PY -m pip install --no-build-isolation --no-deps -e . || install_rc=$?
fi
if [ "$install_rc" -ne 0 ] || ! $PY -c 'import tiergram._native, tiergram.kernels, triton' 2>&1 | tee -a "$LOG"; then
    say "the package or triton cannot be imported: stopping (install status $install_rc)"
    exit 3
fi

# 2. the accelerator tests, compiled on the GPU (TRITON_INTERPRET must not be set; the tests set it without one)
unset TRITON_INTERPRET
say "tests"
tests_rc=0
# -v names each test as it starts, and faulthandler dumps every thread's stack after 60 s: a hang is located
run "$TEST_TIMEOUT" $PY -m pytest -v -p no:cacheprovider -o faulthandler_timeout=60 --durations=5 \
    tests/test_kernels.py tests/test_device_store.py || tests_rc=$?
say "tests finished with status $tests_rc"

# 3. the benchmark (runs even when a test failed: its figures still say something)
say "benchmark"
bench_rc=0
run "$BENCH_TIMEOUT" $PY -m tiergram.bench.gpu --json --out "$DEST/gpu_check.json" --note "tests_rc=$tests_rc" \
    ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"} \
    || bench_rc=$?
say "benchmark finished with status $bench_rc; figures in $DEST/gpu_check.json"

if [ "$tests_rc" -ne 0 ]; then exit "$tests_rc"; fi
exit "$bench_rc"
