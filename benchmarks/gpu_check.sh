#!/usr/bin/env bash
# Every GPU check and timing, in one call on the GPU machine; a short table is printed last
# and full logs are written under $OUT (default /tmp/gpu-check).
#
#   bash benchmarks/gpu_check.sh                      # all steps
#   bash benchmarks/gpu_check.sh nms preprocess       # some steps
#   CAP_CAMERAS=50,100 CAP_UNPACED= bash benchmarks/gpu_check.sh capacity
#   # two GPUs (nvidia-h200-x2):
#   CAP_CAMERAS=200,300 CAP_ARGS="--set runtime.gpus=[0,1]" bash benchmarks/gpu_check.sh capacity
#
# Steps: tests (pytest -m gpu), nms, preprocess, overlap, nvdecopen, startup, capacity, and livecontrol
# and failover (not in the default set: each takes a call of its own). Needs CuPy, Numba,
# torch, torchvision, onnx2torch, PyAV and the assets (python -m samples.fetch, and
# python -m samples.yolov8 for capacity, livecontrol and failover) on that machine: on the
# H200, `python -m benchmarks.device_pack build tests` (or `benchmarks`) packs what it lacks
# into .pack/ here, under the 64 MiB a call carries; the call carries .pack and starts with
#   python3 -m benchmarks.device_pack unpack && export PYTHONPATH=/tmp/site:$PWD &&
#
# Time: the whole script keeps within BUDGET_S seconds (default 570: the device allows 600 s
# per command). Every step runs under `timeout` with the time left; while capacity is still
# to come, the steps before it leave it CAPACITY_RESERVE_S (default 330) of that.
#
# capacity: `python run.py capacity` (how many paced cameras this GPU holds, beside decode
# alone and engine alone) with the YOLOv8s of livecontrol and failover (torch FP16, batch 64,
# compile cache assets/engines, no video) on their 1080p clip; a first row, capsetup, makes
# both when missing and writes the config to $OUT/capacity.yaml. CAP_CAMERAS: paced camera
# counts (default 100,150; empty: capacity's own search) at CAP_FPS (default 30); CAP_ANALYTICS=1:
# each camera tracked (ByteTrack) with a line across its middle, events and their snapshots
# written (output.event_media, clip: null; needs the analytics extra's wheels); CAP_UNPACED:
# cameras reading as fast as they can, measured after them (default 100; empty for none);
# CAP_SECONDS: each run's window (default 20, after capacity's 10 s warm-up); CAP_ARGS: more
# flags (--http; "--set runtime.gpus=[0,1]" for two GPUs; "--set runtime.workers=4"). It gets
# the time left as --budget-s: a run that would not end in time is not started (its row says
# so) and the table is always printed; the table, each run's config and log go under
# $OUT/capacity.
#
# nvdecopen: benchmarks.nvdec_open: 20 NVDEC sources of the 1080p clip opened at once, in 1, 2
# and 4 processes: the seconds to their first frames (a spare taking a dead worker's cameras).
#
# startup: benchmarks.startup, in this order: a cold start (a fresh compile cache, STARTUP_CACHE,
# default /tmp/startup-cache), a warm start (the same cache), both one paced camera through
# run.py; a warm start with runtime.http whose /api/health is polled; the bucketed graphs'
# inference rates (batch 64, 37 padded to its bucket and 37 captured exactly); then a warm start
# of STARTUP_CAMERAS (default 100) paced cameras with runtime.workers STARTUP_WORKERS (default
# empty: not set, the default config's automatic count of source workers).
# Each start's log, with seconds since its launch, is written under $OUT. The runtime.http start
# needs starlette and uvicorn there (not on the H200's image: carry their wheels).
#
# livecontrol: benchmarks.live_control, issue 24's acceptance run through run.py: LIVE_CAMERAS
# (default 100) paced cameras at LIVE_PACE_FPS (default 30) in the default config (one engine,
# the automatic count of source workers; LIVE_WORKERS=N sets runtime.workers: N) with
# runtime.http on; a camera POSTed and DELETEd through the HTTP API in
# the window (LIVE_SECONDS, default 30, after LIVE_WARMUP_S, default 10); the paced verdict
# (0 dropped, p99 <= 100 ms, >= 95% delivered). The start (model compile: ~35 s cold, ~10 s
# with the cache in assets/engines) gets what the rest leaves of the time left (--budget-s).
# It saves the page, /api/sources, /api/health and JPEGs of 6 cameras under
# $OUT/livecontrol: render the page elsewhere with python -m benchmarks.render_page
# $OUT/livecontrol (no browser on the H200). Needs starlette and uvicorn there (carry
# their wheels), like the runtime.http start of startup:
#   BUDGET_S=570 bash benchmarks/gpu_check.sh livecontrol
#
# failover: benchmarks.failover, issue 25's failure targets through run.py: FAIL_CAMERAS
# (default 100) paced cameras at FAIL_PACE_FPS (default 30) and 2 paced file sources in the
# default config (FAIL_WORKERS=N sets runtime.workers: N) with runtime.http on; after
# FAIL_WARMUP_S (default 10) the device memory of each process (nvidia-smi), then source
# worker 1 killed with SIGKILL (its cameras must deliver again within 3 s, the others drop
# nothing), then the engine (every camera again within 20 s); then the files' records are
# checked (complete, each frame once) and the exit status after SIGINT. The start gets what
# the rest leaves of the time left (--budget-s); its table, run.log and the files' JSONL go
# under $OUT/failover. FAIL_ARGS: more flags (--no-standby-engine; --set runtime.cuda_mps=false,
# passed on to run.py). Needs starlette and
# uvicorn there, like livecontrol:
#   BUDGET_S=570 bash benchmarks/gpu_check.sh failover
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
BUDGET_S=${BUDGET_S:-570}
CAPACITY_RESERVE_S=${CAPACITY_RESERVE_S:-330}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests nms preprocess overlap nvdecopen startup capacity)
rows=()
capacity_pending=0
for step in "${steps[@]}"; do [ "$step" = capacity ] && capacity_pending=1; done

left() { echo $((BUDGET_S - SECONDS)); }

run_step() {
    local name=$1 limit=$2; shift 2
    local started=$SECONDS
    if [ "$limit" -lt 10 ]; then
        rows+=("$(printf '%-11s %-4s %5ss  %s' "$name" "-" 0 "skipped: no time left")")
        echo "== $name: skipped, no time left"
        return
    fi
    echo "== $name (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    [ $rc -eq 124 ] && echo "(killed after ${limit}s)" >>"$OUT/$name.log"
    rows+=("$(printf '%-11s %-4s %5ss  %s' "$name" "$rc" "$((SECONDS - started))" \
        "$(grep -v '^\s*$' "$OUT/$name.log" | tail -n 1 | cut -c1-90)")")
}

# The time a step before capacity may take: what is left, less capacity's reserve.
step_limit() {
    local limit=$(( $(left) - 15 ))
    [ "$capacity_pending" = 1 ] && limit=$((limit - CAPACITY_RESERVE_S))
    echo "$limit"
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
    --format=csv | tee "$OUT/gpu.txt"
python3 -c "import cupy, numba, numba_cuda, numpy; print('cupy', cupy.__version__, 'numba', \
numba.__version__, 'numba-cuda', numba_cuda.__version__, 'numpy', numpy.__version__)" \
    | tee -a "$OUT/gpu.txt"
for step in "${steps[@]}"; do
    case $step in
        # -v: a test's verdict is in the log as it ends, so a step stopped at its limit still
        # says which passed (the whole GPU suite takes longer than one 600 s call: GPU_TESTS)
        tests) run_step tests "$(step_limit)" python3 -m pytest -v -m gpu -rA -p no:cacheprovider \
            --durations=20 ${GPU_TESTS:-tests} ;;
        nms) run_step nms "$(step_limit)" python3 -m benchmarks.nms_benchmark ;;
        preprocess) run_step preprocess "$(step_limit)" python3 -m benchmarks.preprocess_benchmark ;;
        overlap) run_step overlap "$(step_limit)" python3 -m benchmarks.overlap_benchmark ;;
        nvdecopen) run_step nvdecopen "$(step_limit)" python3 -m benchmarks.nvdec_open ;;
        startup)
            cache=${STARTUP_CACHE:-/tmp/startup-cache}; rm -rf "$cache"
            run_step startup "$(step_limit)" bash -c "
                python3 -m benchmarks.startup launch --cache '$cache' --log '$OUT/start-cold.log' &&
                python3 -m benchmarks.startup launch --cache '$cache' --log '$OUT/start-warm.log' &&
                python3 -m benchmarks.startup launch --cache '$cache' --log '$OUT/start-http.log' \
                    --http-port 8791 &&
                python3 -m benchmarks.startup inference --cache '$cache' &&
                python3 -m benchmarks.startup launch --cache '$cache' --log '$OUT/start-many.log' \
                    --cameras ${STARTUP_CAMERAS:-100} \
                    ${STARTUP_WORKERS:+--workers $STARTUP_WORKERS}" ;;
        capacity)
            capacity_pending=0
            # The clip and the model of livecontrol and failover (made when missing) and a
            # config of their settings; capacity replaces its sources by the cameras.
            run_step capsetup "$(( $(left) - 15 ))" python3 - "$OUT/capacity.yaml" \
                "${CAP_ANALYTICS:-0}" <<'EOF'
import sys
from pathlib import Path

import yaml

from benchmarks.live_control import camera_clip
from samples.yolov8 import ensure_yolov8

assets = Path("assets").resolve()
model, names = ensure_yolov8(assets, log=print)
config = {
    "model": {"path": str(model), "class_names": str(names)},
    "inference": {"device": "cuda", "backend": "torch", "precision": "fp16",
                  "batch_size": 64, "engine_cache": str(assets / "engines")},
    "output": {"video": None, "jsonl": "{source}.jsonl"}}
if sys.argv[2] == "1":  # each camera tracked, a line across its middle, event snapshots
    config["sources"] = [{"name": "camera", "uri": "rtsp://camera.invalid/stream",
                          "tracker": "bytetrack", "analytics": [
                              {"type": "line", "name": "middle", "start": [960, 0],
                               "end": [960, 1080]}]}]
    config["output"].update(events="{source}.events.jsonl", event_media={"clip": None})
Path(sys.argv[1]).write_text(yaml.safe_dump(config, sort_keys=False))
print(camera_clip(False, assets))  # the last line: the clip
EOF
            limit=$(( $(left) - 15 ))
            cameras=${CAP_CAMERAS-100,150} unpaced=${CAP_UNPACED-100}
            # capacity plans with 20 s less than its hard limit, to print its table.
            # shellcheck disable=SC2086
            run_step capacity "$limit" python3 run.py capacity --config "$OUT/capacity.yaml" \
                --clip "$(tail -n 1 "$OUT/capsetup.log")" --fps "${CAP_FPS:-30}" \
                ${cameras:+--cameras "$cameras"} ${unpaced:+--unpaced "$unpaced"} \
                --seconds "${CAP_SECONDS:-20}" --budget-s "$((limit - 20))" \
                --out "$OUT/capacity" ${CAP_ARGS:-} ;;
        livecontrol)
            limit=$(( $(left) - 15 ))
            # The benchmark plans with 20 s less than its hard limit, to print its table.
            run_step livecontrol "$limit" python3 -m benchmarks.live_control \
                --cameras "${LIVE_CAMERAS:-100}" ${LIVE_WORKERS:+--workers "$LIVE_WORKERS"} \
                --pace-fps "${LIVE_PACE_FPS:-30}" --warmup-s "${LIVE_WARMUP_S:-10}" \
                --seconds "${LIVE_SECONDS:-30}" --budget-s "$((limit - 20))" \
                --out "$OUT/livecontrol" ;;
        failover)
            limit=$(( $(left) - 15 ))
            # The benchmark plans with 20 s less than its hard limit, to print its table.
            run_step failover "$limit" python3 -m benchmarks.failover \
                --cameras "${FAIL_CAMERAS:-100}" ${FAIL_WORKERS:+--workers "$FAIL_WORKERS"} \
                --pace-fps "${FAIL_PACE_FPS:-30}" --warmup-s "${FAIL_WARMUP_S:-10}" \
                --budget-s "$((limit - 20))" ${FAIL_ARGS:-} --out "$OUT/failover" ;;
        *) echo "unknown step $step"; exit 2 ;;
    esac
done
for step in "${steps[@]}"; do
    [ -f "$OUT/$step.log" ] || continue
    [ "$step" = tests ] && { grep -E " (PASSED|FAILED|ERROR) |^(FAILED|ERROR)|passed|failed" \
        "$OUT/tests.log" | tail -n 60; continue; }
    echo "---- $step"
    if [ "$step" = capacity ] && [ -s "$OUT/capacity/results.md" ]; then
        cat "$OUT/capacity/results.md"
    elif [ "$step" = livecontrol ] && [ -s "$OUT/livecontrol/results.md" ]; then
        cat "$OUT/livecontrol/results.md"
    elif [ "$step" = failover ] && [ -s "$OUT/failover/results.md" ]; then
        cat "$OUT/failover/results.md"
    else
        tail -n 30 "$OUT/$step.log"
    fi
done
echo
printf '%-11s %-4s %6s  %s\n' step rc time "last line"
printf '%s\n' "${rows[@]}"
