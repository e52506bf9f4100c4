"""Where CPU decode tops out: decode in worker processes with and without the pipeline's IPC.

    python -m benchmarks.decode_ceiling [--cameras 1,14,64,100] [--seconds 3] [--clip PATH]

For each camera count, side by side in one run, on the same clip (default: the throughput
benchmark's looped 1080p clip, made when missing):

- ``isolated``: the same worker processes as the pipeline would start (``default_worker_count``,
  sources dealt round-robin), each decoding its sources in threads with ``DecodeStage`` into a
  private slot ring (plain memory, the planes copied as in the pipeline) and giving each slot
  back at once. Frames are only counted: nothing crosses a process boundary per frame. This
  is the ceiling of CPU decode with the pipeline's decoder settings on this machine
  (``pipeline.app.ceilings.measure_isolated``: what ``capacity`` calls decode alone).
- ``pool``: ``benchmarks.throughput.measure_decode``, the pipeline's own ``DecodeWorkerPool``
  (shared-memory ring, frame records through the pipes, one reading thread per source that
  gives each slot back).

Each row also gives the CPU seconds per frame of the pipeline process and of the worker
processes (``getrusage``), so a gap between the two modes is attributed: a pipeline process
near one core's worth of work per frame at the pool's rate is the bottleneck.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
from pathlib import Path

from pipeline.app.ceilings import measure_isolated


def measure_pool(clip: Path, cameras: int, seconds: float) -> tuple[float, float, float]:
    """(frames/s, pipeline-process CPU s per frame, worker CPU s per frame) of the pool."""
    from benchmarks.throughput import Setup, measure_decode

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "unused.onnx"  # the configuration needs a model file: never loaded
        model.touch()
        setup = Setup(clip, model, None, "cpu", "onnxruntime", seconds, 64)
        counted: dict[str, int] = {}
        own0 = resource.getrusage(resource.RUSAGE_SELF)
        kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        fps = measure_decode(setup, "cpu", cameras, counted)
        own1 = resource.getrusage(resource.RUSAGE_SELF)
        kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    frames = max(counted["frames"], 1)  # every frame of the call, not only the window's
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
        from benchmarks.throughput import CAMERA_FPS_CAP, looped_clip
        from samples.fetch import SamplePaths

        bikes = SamplePaths.under(Path("assets")).bikes
        big = make_1080p_clip(bikes, Path("assets/cache") / CLIP_NAME, bitrate=CLIP_BITRATE)
        clip = looped_clip(big, args.seconds + 5, CAMERA_FPS_CAP["full"], Path("assets/cache"))
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
