"""Where CPU decode tops out: decode in worker processes with and without the pipeline's IPC.

    python -m benchmarks.decode_ceiling [--cameras 1,14,64,100] [--seconds 3] [--clip PATH]

For each camera count, side by side in one run, on the same clip (default: the benchmarks'
1080p clip, ``benchmarks.overlap_benchmark.make_1080p_clip``, looped; made when missing):

- ``isolated``: the same worker processes as the pipeline would start (``default_worker_count``,
  sources dealt round-robin), each decoding its sources in threads with ``DecodeStage`` into a
  private slot ring (plain memory, the planes copied as in the pipeline) and giving each slot
  back at once. Frames are only counted: nothing crosses a process boundary per frame. This
  is the ceiling of CPU decode with the pipeline's decoder settings on this machine
  (``pipeline.app.ceilings.measure_isolated``: what ``capacity`` calls decode alone).
- ``pool``: the ``DecodeWorkerPool`` of a whole pipeline in one process (``runtime.workers:
  1``; source workers decode in their own threads instead): its worker processes, the
  shared-memory ring, frame records through the pipes, one reading thread per source that
  gives each slot back.

Each row also gives the CPU seconds per frame of the pipeline process and of the worker
processes (``getrusage``), so a gap between the two modes is attributed: a pipeline process
near one core's worth of work per frame at the pool's rate is the bottleneck.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import threading
import time
from pathlib import Path

from pipeline.app.ceilings import measure_isolated
from pipeline.config import PipelineConfig, parse_config
from pipeline.records import Frame

WARMUP_SHARE = 0.1  # the first 10% of the frames are start-up, not steady state
START_S = 30.0  # opening the sources and their first frames may take this long
CAMERA_FPS_CAP = 2_500  # frames/s one camera may reach: the looped clip lasts at that rate


def pool_config(clip: Path, cameras: int, model: Path) -> PipelineConfig:
    """``cameras`` CPU-decoded file sources of ``clip`` (``model`` is never loaded)."""
    from pipeline.app.workers import default_worker_count

    return parse_config({
        "sources": [{"name": f"cam{i:03d}", "uri": str(clip), "decode": "cpu"}
                    for i in range(cameras)],
        "model": {"path": str(model)},
        "inference": {"device": "cpu", "batch_size": 64},
        "output": {"video": None},
        "runtime": {"progress": False, "log_level": "warning",
                    "decode_workers": default_worker_count(cameras)},
    })


def steady_rate(times: list[float]) -> float:
    """Frames/s over completion ``times`` (in order), the first ``WARMUP_SHARE`` left out."""
    first = int(len(times) * WARMUP_SHARE)
    if len(times) - first < 2 or times[-1] <= times[first]:
        raise RuntimeError(f"too few frames to measure ({len(times)})")
    return (len(times) - 1 - first) / (times[-1] - times[first])


def pool_rate(clip: Path, cameras: int, seconds: float, model: Path) -> tuple[float, int]:
    """(frames/s over ``seconds`` from the first frame, every frame received) of ``cameras``
    sources decoded by the pipeline's ``DecodeWorkerPool``, each slot given back as soon as
    its frame arrives."""
    from pipeline.app.build import frame_slots, probe_frame_size
    from pipeline.app.workers import DecodeWorkerPool, WorkerSource
    from pipeline.slots import SlotRing, i420_bytes
    from stages.decode import decoder_threads

    config = pool_config(clip, cameras, model)
    ring = SlotRing(frame_slots(config), i420_bytes(*probe_frame_size(str(clip))), shared=True)
    pool = DecodeWorkerPool(config, ring, config.runtime.decode_workers,
                            decoder_threads(cameras), list(enumerate(config.sources)))
    stop = threading.Event()
    done: list[float] = []
    failures: list[str] = []

    def read(source: WorkerSource) -> None:
        for item in source.frames(stop):
            if isinstance(item, Frame):
                ring.release([item.slot])
                done.append(time.perf_counter())  # list.append is atomic: no lock needed
            elif item.error:
                failures.append(item.error)

    threads = [threading.Thread(target=read, args=(source,), daemon=True)
               for source in pool.sources]
    try:
        pool.start()
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + seconds + START_S
        while time.monotonic() < deadline and not failures and any(t.is_alive() for t in threads):
            if done and time.perf_counter() - done[0] >= seconds:
                break
            time.sleep(0.05)
        measured = sorted(done)
    finally:
        stop.set()
        pool.request_stop()
        for thread in threads:
            thread.join(30)
        pool.close()
        ring.close()
    if failures:
        raise RuntimeError(failures[0])
    return steady_rate(measured), len(done)


def measure_pool(clip: Path, cameras: int, seconds: float) -> tuple[float, float, float]:
    """(frames/s, pipeline-process CPU s per frame, worker CPU s per frame) of the pool."""
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "unused.onnx"  # the configuration needs a model file: never loaded
        model.touch()
        own0 = resource.getrusage(resource.RUSAGE_SELF)
        kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        fps, frames = pool_rate(clip, cameras, seconds, model)
        own1 = resource.getrusage(resource.RUSAGE_SELF)
        kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    frames = max(frames, 1)  # every frame of the call, not only the window's
    own = (own1.ru_utime - own0.ru_utime) + (own1.ru_stime - own0.ru_stime)
    kids = (kids1.ru_utime - kids0.ru_utime) + (kids1.ru_stime - kids0.ru_stime)
    return fps, own / frames, kids / frames


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_ceiling",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--cameras", default="1,14,64,100")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--clip", type=Path, default=None)
    args = parser.parse_args(argv)
    from pipeline.logging import configure_logging

    configure_logging(level="warning")
    clip = args.clip
    if clip is None:
        from benchmarks.overlap_benchmark import CLIP_BITRATE, CLIP_NAME, make_1080p_clip
        from pipeline.app.clips import clip_for
        from samples.fetch import SamplePaths

        bikes = SamplePaths.under(Path("assets")).bikes
        big = make_1080p_clip(bikes, Path("assets/cache") / CLIP_NAME, bitrate=CLIP_BITRATE)
        clip = clip_for(big, args.seconds + 7, CAMERA_FPS_CAP, Path("assets/cache"))
    print(f"decode ceiling, {clip.name}, {os.cpu_count()} cores, {args.seconds:g} s windows")
    print("| cameras | processes | isolated fps | pool fps | pool / isolated | "
          "pipeline-process CPU ms/frame (pool) | worker CPU ms/frame (isolated, pool) |")
    print("|---|---|---|---|---|---|---|")
    for cameras in [int(n) for n in args.cameras.split(",")]:
        iso_fps, procs, iso_cpu = measure_isolated(clip, cameras, args.seconds)
        pool_fps, own_cpu, kid_cpu = measure_pool(clip, cameras, args.seconds)
        print(f"| {cameras} | {procs} | {iso_fps:,.0f} | {pool_fps:,.0f} | "
              f"{pool_fps / iso_fps:.2f} | {own_cpu * 1e3:.3f} | "
              f"{iso_cpu * 1e3:.2f}, {kid_cpu * 1e3:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
