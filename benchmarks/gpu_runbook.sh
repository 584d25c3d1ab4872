#!/usr/bin/env bash
# The GPU runbook: what to run the day a GPU is lent, in one go, with the results kept.
#
#   bash benchmarks/gpu_runbook.sh            # the whole book (tens of minutes on an H100)
#   bash benchmarks/gpu_runbook.sh --quick    # a short pass of every step (sanitizers on a subset, small bench)
#   bash benchmarks/gpu_runbook.sh --lease    # a short lease (minutes of device time): the GPU steps only,
#                                             # each under a time limit, the C++ extension built first
#   bash benchmarks/gpu_runbook.sh --dry-run  # print the steps, run nothing (works without a GPU)
#
# Steps, each logged and timed, none stopping the others:
#   1. the device: nvidia-smi, torch's and cupy's view of it
#   2. the GPU kernel tests (tests/test_cuda_kernels.py) and the CPU-harness suites, byte for byte
#      against delta_ref (they also run in CI without a GPU; here they confirm on the real thing)
#   3. the kernel tests under compute-sanitizer: memcheck, racecheck, synccheck
#   4. the other tests marked gpu (tests/test_local.py, test_lowrank.py, test_torchdist.py, the quantizers on
#      device tensors: test_cuda_quant.py)
#   5. the throughput benchmark against a device-to-device copy, v2's GPU decoder against v1's apply
#      (wsync bench cuda)
#   6. end to end (wsync bench gpu-sync): trainer and engine processes on the GPU, publish -> live
#      through the public API (raw and delta over local://, delta over tcp://), beside a device-to-device copy
#      of the same state, with memory and bit-exactness; in a lease it runs right after the device step
# Everything lands in benchmarks/results/<date>-<gpu>-runbook/ (logs, bench JSON, summary.md naming the
# device); commit that folder. Needs the dev and cuda extras and the benchmarks: pip install -e ".[dev,cuda]"
# -e ./benchmarks with a CUDA torch.
set -u
cd "$(dirname "$0")/.."

QUICK=0
DRY=0
LEASE=0
for a in "$@"; do
    case "$a" in
        --quick) QUICK=1 ;;
        --lease) LEASE=1 ;;
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
        *) echo "unknown option $a (see --help)" >&2; exit 2 ;;
    esac
done

PY=${PYTHON:-python}
gpu_name() { nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1; }
if [ "$DRY" = 0 ]; then
    if ! command -v nvidia-smi >/dev/null || [ -z "$(gpu_name)" ]; then
        echo "no GPU here (nvidia-smi finds none): this runbook is for a machine with one (--dry-run lists the steps)" >&2
        exit 3
    fi
    GPU=$(gpu_name)
else
    GPU="dry-run"
fi
SLUG=$(echo "$GPU" | tr '[:upper:]' '[:lower:]' | sed -e 's/nvidia//' -e 's/[^a-z0-9]\+/-/g' -e 's/^-//' -e 's/-$//')
OUT=${RUNBOOK_OUT:-benchmarks/results/$(date +%F)-${SLUG:-gpu}-runbook}
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
[ "$DRY" = 0 ] && mkdir -p "$OUT"

# The sanitizers slow kernels 10-100x: they get the tests' small and edge cases, not the hypothesis sweeps.
SAN_TESTS="tests/test_cuda_kernels.py"
SAN_K="bad_sections or digests or fused_detector or public_api or v2"
BENCH_ARGS="--size full"
if [ "$QUICK" = 1 ] || [ "$LEASE" = 1 ]; then
    SAN_K="bad_sections or digests or v2_decode_matches"
fi
[ "$QUICK" = 1 ] && BENCH_ARGS="--size small"
[ "$LEASE" = 1 ] && BENCH_ARGS="--size full --repeat 5 --warmup 2"  # full sizes, fewer repeats
# end to end: the real shapes (quick: scaled down); in a lease its own limit sits inside the step's, so it
# writes its results before the step is killed
SYNC_ARGS="--size full --time-limit 900"
[ "$QUICK" = 1 ] && SYNC_ARGS="--size small --time-limit 120"
[ "$LEASE" = 1 ] && SYNC_ARGS="--size full --time-limit 150"
SYNC_LIMIT=165
# A lease's step limits add up to 375 s: one device call, with room left in a 15-minute loan for the machine's
# start and a rerun. The sanitizers are left out of it (they need a loan of their own).

# In a lease each step gets a time limit (seconds), so one that hangs cannot spend the others' time.
LIMIT=()
declare -a NAMES RCS SECS LOGS
step() {  # step NAME LOGFILE COMMAND...: run it, keep its log, its exit code and its seconds
    local name=$1 log=$2
    shift 2
    [ "${#LIMIT[@]}" -gt 0 ] && set -- "${LIMIT[@]}" "$@"
    if [ "$DRY" = 1 ]; then
        echo "[$name] $*"
        return
    fi
    echo "== $name: $*" | tee "$OUT/$log"
    local t0=$SECONDS
    "$@" >>"$OUT/$log" 2>&1
    local rc=$?
    NAMES+=("$name")
    LOGS+=("$log")
    RCS+=("$rc")
    SECS+=($((SECONDS - t0)))
    echo "   -> exit $rc in $((SECONDS - t0)) s (log: $OUT/$log)"
}

limit() {  # the time limit (seconds) of the next steps, in a lease only
    [ "$LEASE" = 1 ] && LIMIT=(timeout -k 5 "$1")
    return 0
}
sanitizers() {
    if [ -n "$SAN" ] || [ "$DRY" = 1 ]; then
        for tool in memcheck racecheck synccheck; do
            # racecheck: our kernels only. cupy's nonzero scan (the v2 decoder's compaction) shows shared-memory
            # hazard warnings of its own, which fail the step without saying anything about ours (H200, 2026-11-27)
            local only=()
            [ "$tool" = racecheck ] && only=(--kernel-name-exclude kns=cupy_)
            step "compute-sanitizer $tool" "sanitizer-$tool.log" "${SAN:-compute-sanitizer}" --tool "$tool" \
                "${only[@]}" --error-exitcode 99 --target-processes all "$PY" -m pytest -q -x "$SAN_TESTS" -k "$SAN_K"
        done
    else
        echo "compute-sanitizer not found (PATH, /usr/local/cuda/bin): sanitizer steps skipped" | tee "$OUT/sanitizer-missing.log"
    fi
}
other_gpu_tests() {
    step other-gpu-tests gpu-tests.log "$PY" -m pytest -q -rs -m gpu tests/test_local.py tests/test_device_sync.py tests/test_shard_device.py \
        tests/test_transport_devices.py tests/test_lowrank.py \
        tests/test_torchdist.py tests/test_cuda_quant.py
}
wait_build() {  # once: a second wait on the same pid is an error in bash
    if [ -n "${BUILD:-}" ]; then
        wait "$BUILD"
        BUILD=
    fi
}
throughput() {
    wait_build
    step throughput bench.log "$PY" -m wsync.cli bench cuda $BENCH_ARGS --json "$OUT/bench_cuda.json"
}
end_to_end() {  # the publisher's host paths use the C++ backend: measured without it they would time Python
    wait_build
    step gpu-sync gpu-sync.log "$PY" -m wsync.cli bench gpu-sync $SYNC_ARGS --out "$OUT"
}

if [ "$LEASE" = 1 ] && [ "$DRY" = 0 ]; then  # the C++ twin: the v2 stage encodes with it; built beside the first steps
    ( $PY setup.py build_ext --inplace -q >"$OUT/build-ext.log" 2>&1; echo "exit $?" >>"$OUT/build-ext.log" ) &
    BUILD=$!
fi
limit 30
step device device.log bash -c "nvidia-smi; $PY -c 'import torch, cupy; print(\"torch\", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0)); print(\"cupy\", cupy.__version__, cupy.cuda.runtime.runtimeGetVersion())'"
if [ "$LEASE" = 1 ]; then  # the readings before the slow checks; the CPU-only suites are left to CI
    limit "$SYNC_LIMIT"
    end_to_end  # first after the device: the one reading no other step gives, kept if later steps overrun
fi
if [ "$LEASE" = 1 ]; then
    limit 45
    other_gpu_tests  # CUDA IPC in a fresh reader process, NCCL on the link's device
fi
limit 60
step kernels-on-gpu kernels.log "$PY" -m pytest -q -rs tests/test_cuda_kernels.py
if [ "$LEASE" = 1 ]; then
    limit 75
    throughput
else
    step harness-suites harness.log "$PY" -m pytest -q tests/test_cuda_sim.py tests/test_cuda_sim_harness.py \
        tests/test_cuda_streams.py tests/test_cuda_xxh3.py tests/test_cuda_compile.py
    other_gpu_tests
    sanitizers
    throughput
    end_to_end
fi

[ "$DRY" = 1 ] && exit 0
{
    echo "# GPU runbook, $(date +%F)"
    echo
    echo "Device: $GPU ($(nvidia-smi --query-gpu=driver_version,memory.total --format=csv,noheader | head -1));"
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'); mode: $([ "$LEASE" = 1 ] && echo lease || ([ "$QUICK" = 1 ] && echo quick || echo full))."
    echo
    echo "| step | exit | seconds | log |"
    echo "|---|---|---|---|"
    for i in "${!NAMES[@]}"; do
        echo "| ${NAMES[$i]} | ${RCS[$i]} | ${SECS[$i]} | ${LOGS[$i]} |"
    done
    if [ -f "$OUT/gpu_sync.md" ]; then
        echo
        echo "End to end (gpu_sync.md, gpu_sync.json):"
        sed 's/^# /### /' "$OUT/gpu_sync.md"
    fi
    echo
    echo "Tail of each log:"
    for f in "$OUT"/*.log; do
        echo
        echo "## $(basename "$f")"
        echo '```'
        tail -n 15 "$f"
        echo '```'
    done
} >"$OUT/summary.md"
echo "summary: $OUT/summary.md"
fail=0
for rc in "${RCS[@]}"; do [ "$rc" = 0 ] || fail=1; done
exit $fail
