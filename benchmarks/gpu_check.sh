#!/usr/bin/env bash
# Every GPU check and timing, in one call on the GPU machine; a short table is printed last
# and full logs are written under $OUT (default /tmp/gpu-check).
#
#   bash benchmarks/gpu_check.sh                 # all steps
#   bash benchmarks/gpu_check.sh nms preprocess  # some steps
#
# Steps: tests (pytest -m gpu), nms, preprocess, overlap, throughput. Needs CuPy, Numba,
# torch, torchvision, onnx2torch, PyAV and the assets (python -m samples.fetch, and
# python -m samples.yolov8 for throughput) on that machine.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests nms preprocess overlap throughput)
rows=()

run_step() {
    local name=$1; shift
    local started=$SECONDS
    echo "== $name: $*"
    "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    rows+=("$(printf '%-11s %-4s %5ss  %s' "$name" "$rc" "$((SECONDS - started))" \
        "$(grep -v '^\s*$' "$OUT/$name.log" | tail -n 1 | cut -c1-90)")")
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
    --format=csv | tee "$OUT/gpu.txt"
python3 -c "import cupy, numba, numba_cuda, numpy; print('cupy', cupy.__version__, 'numba', \
numba.__version__, 'numba-cuda', numba_cuda.__version__, 'numpy', numpy.__version__)" \
    | tee -a "$OUT/gpu.txt"
for step in "${steps[@]}"; do
    case $step in
        tests) run_step tests python3 -m pytest -q -m gpu -rA -p no:cacheprovider ${GPU_TESTS:-tests} ;;
        nms) run_step nms python3 -m benchmarks.nms_benchmark ;;
        preprocess) run_step preprocess python3 -m benchmarks.preprocess_benchmark ;;
        overlap) run_step overlap python3 -m benchmarks.overlap_benchmark ;;
        throughput) run_step throughput python3 -m benchmarks.throughput \
            --cameras "${CAMERAS:-1,8,32}" --seconds 4 --out "$OUT/throughput.md" ;;
        *) echo "unknown step $step"; exit 2 ;;
    esac
done
for step in "${steps[@]}"; do
    [ "$step" = tests ] && { grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed" \
        "$OUT/tests.log" | tail -n 40; continue; }
    echo "---- $step"; tail -n 25 "$OUT/$step.log"
done
echo
printf '%-11s %-4s %6s  %s\n' step rc time "last line"
printf '%s\n' "${rows[@]}"
