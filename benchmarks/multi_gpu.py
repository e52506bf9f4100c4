"""Several GPUs against one: the same camera runs on 1 and on 2 GPUs (``runtime.gpus``: one
pipeline process per GPU, the sources shared out by load), in one command.

    python -m benchmarks.multi_gpu [--small] [--gpus 1,2] [--cameras 100] [--paced 16,32,64]
        [--pace-fps 30] [--seconds 10] [--warmup-s 3] [--budget-s S] [--out t.md]

The runs are what users run: the supervisor of ``pipeline.cluster`` with its local
executor (spawned processes, no Ray), each host building its pipeline with the public
``build_graph``. Frames and drops are read from the hosts' metrics snapshots (the ones the
Prometheus endpoint serves, once a second), so a window's numbers are whole seconds of every
host. For every GPU count of ``--gpus`` (devices 0..n-1):

- unpaced: ``--cameras`` file sources reading the long looped clip as fast as they are
  taken; once every host delivered, ``--warmup-s``, then a window of ``--seconds``:
  frames/s over the window. The table gives each count's speed-up over the first (target:
  >= 1.8x for 2 GPUs against 1);
- paced, for each count of ``--paced``: every camera live at ``--pace-fps`` in real time
  (``live: true``, ``reconnect: false``); it is held when the window has no drop and
  delivers >= 95% of the offered frames/s. The line under the table names the largest count
  held per GPU count and their ratio (target: >= 2x the one-GPU figure).

Frames/s and drops of a window come from each host's first and last metrics snapshot
inside it (hosts report once a second: a window of at least 2.5 s).

Full mode (the GPUs): YOLOv8s 640, torch FP16 compiled (``--engine-cache``, default
assets/engines, shared by the processes), the 1080p clip of ``benchmarks.throughput``, CPU
decode in worker processes: each GPU process gets ``cores / GPUs - 2`` of them (at least
1). ``--small`` (CI, no GPU): the same on the CPU path with ``runtime.pipelines`` in place
of GPUs (each process on its share of the cores), YOLOv3-tiny on onnxruntime, bikes.mp4,
a couple of cameras, 2.5 s per window. A measurement that fails writes its error in its
row; with ``--budget-s`` one that would not fit in the time left is skipped (and says so).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.overlap_benchmark import CLIP_BITRATE, CLIP_NAME, make_1080p_clip
from benchmarks.throughput import (
    CAMERA_FPS_CAP,
    DELIVERED_SHARE,
    Setup,
    clip_frames,
    counts_arg,
    looped_clip,
    pipeline_config,
)
from samples.fetch import SamplePaths, ensure_samples

START_TIMEOUT_S = 300.0  # every host must deliver within this (compiling from the cache)
OVERHEAD_S = {"full": 60.0, "small": 15.0}  # start-up and drain of one measurement


@dataclass
class Row:
    """One measurement."""

    gpus: int
    cameras: int
    paced: bool
    offered: float | None = None  # paced: cameras x pace_fps
    fps: float | None = None
    dropped: int | None = None
    start_s: float | None = None  # until every host delivered
    notes: list[str] = field(default_factory=list)

    @property
    def held(self) -> bool:
        return (self.paced and self.fps is not None and self.dropped == 0
                and self.fps >= DELIVERED_SHARE * (self.offered or 0))


class Totals:
    """Every host's metrics snapshots as (arrival time, frames, dropped) of its sources (the
    supervisor's exporter interface)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.history: dict[str, list[tuple[float, float, float]]] = {}

    def update(self, pipeline: str, families: list[Any]) -> None:
        frames = dropped = 0.0
        for family in families:
            for name, _, value in family.samples:
                if name == "pipeline_source_frames_total":
                    frames += value
                elif name == "pipeline_source_dropped_frames_total":
                    dropped += value
        with self.lock:
            self.history.setdefault(pipeline, []).append((time.monotonic(), frames, dropped))

    def delivering(self) -> int:
        """Hosts that delivered frames."""
        with self.lock:
            return sum(1 for history in self.history.values() if history[-1][1] > 0)

    def window(self, start: float, end: float) -> tuple[float, int]:
        """(frames/s, frames dropped) in [start, end], summed over the hosts, each from its
        first and last snapshot inside it.

        Raises:
            RuntimeError: a host has fewer than two snapshots in it (a window too short).
        """
        fps, dropped = 0.0, 0
        with self.lock:
            histories = {name: list(history) for name, history in self.history.items()}
        for name, history in histories.items():
            inside = [item for item in history if start <= item[0] <= end]
            if len(inside) < 2:
                raise RuntimeError(f"{name}: fewer than two metrics snapshots in the window")
            (t0, f0, d0), (t1, f1, d1) = inside[0], inside[-1]
            fps += (f1 - f0) / (t1 - t0)
            dropped += int(d1 - d0)
        return fps, dropped


def measure(setup: Setup, row: Row, out: Path, small: bool, warmup_s: float,
            cores: int) -> None:
    from pipeline.cluster import LocalExecutor, Supervisor

    config = pipeline_config(setup, row.cameras, "cpu", setup.batch_cap, out, paced=row.paced)
    config.runtime.decode_workers = max(1, cores // row.gpus - 2)
    devices: list[int | None] = [None] * row.gpus if small else list(range(row.gpus))
    if small:
        config.runtime.pipelines = row.gpus
    else:
        config.runtime.gpus = devices  # type: ignore[assignment]
    totals = Totals()
    executor = LocalExecutor(config, devices, metrics=True)
    supervisor = Supervisor(config, executor, max_restarts=0, exporter=totals)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            supervisor.run()
        except BaseException as error:  # noqa: BLE001 - reported in the row
            failure.append(error)

    runner = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    runner.start()
    try:
        while totals.delivering() < row.gpus:
            if not runner.is_alive():
                raise RuntimeError(f"the run ended before every host delivered: {failure}")
            if time.monotonic() - started > START_TIMEOUT_S:
                raise RuntimeError(f"not every host delivered within {START_TIMEOUT_S:g} s")
            time.sleep(0.2)
        row.start_s = time.monotonic() - started
        time.sleep(warmup_s)
        t0 = time.monotonic()
        time.sleep(setup.seconds)
        row.fps, row.dropped = totals.window(t0, time.monotonic())
        errors = {name: e for name, e in supervisor.results.items() if e}
        if errors:
            row.notes.append(f"errors: {errors}")
    finally:
        supervisor.request_stop()
        runner.join(120)


def num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def markdown(rows: list[Row], header: str, pace_fps: float) -> str:
    lines = [header, ""]
    unpaced = [r for r in rows if not r.paced]
    if unpaced:
        base = next((r.fps for r in unpaced if r.fps), None)
        lines += ["| GPUs | cameras | frames/s | x first | start s | notes |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r.gpus} | {r.cameras} | {num(r.fps)} | "
                  f"{num(r.fps / base if r.fps and base else None, 2)} | {num(r.start_s, 1)} | "
                  f"{'; '.join(r.notes)} |" for r in unpaced]
        lines.append("")
    paced = [r for r in rows if r.paced]
    if paced:
        lines += [f"Paced: every camera live at {pace_fps:g} frames/s.", "",
                  "| GPUs | cameras | offered fps | delivered fps | dropped | held | notes |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r.gpus} | {r.cameras} | {num(r.offered)} | {num(r.fps)} | "
                  f"{num(r.dropped)} | {'yes' if r.held else 'no'} | {'; '.join(r.notes)} |"
                  for r in paced]
        held = {g: max((r.cameras for r in paced if r.gpus == g and r.held), default=0)
                for g in sorted({r.gpus for r in paced})}
        first = next(iter(held.values()))
        lines += ["", "Largest paced count held: " + ", ".join(
            f"{g} GPU(s): {n}" + (f" ({n / first:.2f}x)" if first and g != min(held) else "")
            for g, n in held.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.multi_gpu",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="CPU-only mode for CI")
    parser.add_argument("--gpus", default=None, help="GPU counts to compare (default 1,2)")
    parser.add_argument("--cameras", default=None,
                        help="unpaced camera counts (default 100; small: 2); 'none' for none")
    parser.add_argument("--paced", default=None,
                        help="paced camera counts (default 16,32,64; small: 2); 'none' for none")
    parser.add_argument("--pace-fps", type=float, default=None, help="default 30; small: 5")
    parser.add_argument("--seconds", type=float, default=None,
                        help="window, at least 2.5: hosts report once a second (default 10; "
                             "small: 2.5)")
    parser.add_argument("--warmup-s", type=float, default=None, help="default 3; small: 1")
    parser.add_argument("--engine-cache", default="assets/engines")
    parser.add_argument("--assets", default="assets")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no measurement that would not end within this many seconds")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables here (md)")
    started = time.monotonic()
    args = parser.parse_args(argv)
    small = args.small
    gpus = counts_arg(parser, "--gpus", args.gpus or "1,2")
    cameras = counts_arg(parser, "--cameras", args.cameras or ("2" if small else "100"))
    paced = counts_arg(parser, "--paced", args.paced or ("2" if small else "16,32,64"))
    seconds = args.seconds or (2.5 if small else 10.0)
    if seconds < 2.5:
        parser.error(f"--seconds: at least 2.5 (hosts report once a second), got {seconds:g}")
    warmup_s = args.warmup_s if args.warmup_s is not None else (1.0 if small else 3.0)
    pace_fps = args.pace_fps or (5.0 if small else 30.0)
    from pipeline.logging import configure_logging

    configure_logging(level="warning")
    assets = Path(args.assets)
    samples = SamplePaths.under(assets)
    if not (samples.bikes.exists() and samples.model.exists()):
        samples = ensure_samples(assets, log=print)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    rows = [Row(g, n, False) for n in cameras for g in gpus] + \
        [Row(g, n, True, offered=n * pace_fps) for g in gpus for n in paced]
    with tempfile.TemporaryDirectory() as tmp:
        window = seconds + warmup_s + 2
        if small:
            clip = looped_clip(samples.bikes, window + 10, CAMERA_FPS_CAP["small"], Path(tmp))
            setup = Setup(clip, samples.model, samples.names, "cpu", "onnxruntime", seconds, 4,
                          pace_fps=pace_fps)
            what = "YOLOv3-tiny 416, onnxruntime on the CPU, bikes.mp4 640x272, pipelines"
        else:
            from samples.yolov8 import ensure_yolov8

            model, names = ensure_yolov8(assets, log=print)
            big = make_1080p_clip(samples.bikes, assets / "cache" / CLIP_NAME,
                                  bitrate=CLIP_BITRATE)
            clip = looped_clip(big, window + 60, CAMERA_FPS_CAP["full"], assets / "cache")
            setup = Setup(clip, model, names, "cuda", "torch", seconds, 64, True,
                          Path(args.engine_cache), pace_fps=pace_fps)
            what = "YOLOv8s 640, torch FP16 compiled, bikes.mp4 upscaled to 1080p, runtime.gpus"
        for row in rows:
            left = None if args.budget_s is None else args.budget_s - (time.monotonic() - started)
            if left is not None and left < window + OVERHEAD_S["small" if small else "full"]:
                row.notes.append("skipped: no time left (--budget-s)")
                continue
            out = Path(tmp) / f"out-{row.gpus}-{row.cameras}-{row.paced}"
            try:
                measure(dataclasses.replace(setup), row, out, small, warmup_s, cores)
            except Exception as error:  # noqa: BLE001 - the table says what failed
                row.notes.append(f"failed: {type(error).__name__}: {error}")
            print(row, flush=True)
        header = (f"Multi-GPU, {what}; each camera reads {clip.name} ({clip_frames(clip):,} "
                  f"frames); {warmup_s:g} s warm-up once every process delivered, then "
                  f"{seconds:g} s; {cores} cores, decode workers per process: cores / GPUs - 2.")
    table = markdown(rows, header, pace_fps)
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
