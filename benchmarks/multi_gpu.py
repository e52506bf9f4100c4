"""Several GPUs against one: the same camera runs on 1 and on 2 GPUs (``runtime.gpus``: one
pipeline process per GPU, the sources shared out by load), in one command.

    python -m benchmarks.multi_gpu [--small] [--gpus 1,2,1x3] [--decode cpu,gpu]
        [--cameras 100] [--paced 16,32,64] [--pace-fps 30] [--seconds 10] [--warmup-s 3]
        [--budget-s S] [--out t.md]

``--gpus`` lists layouts: ``N`` is N GPUs with one pipeline process each (``runtime.gpus``:
0..N-1); ``1xK`` is K pipeline processes sharing GPU 0 (``runtime.pipelines: K``, each on
``inference.gpu_id`` 0 and its share of the cores), which gives the GPU K interpreters to
feed it. ``--decode`` runs every layout with CPU decode in worker processes (``cpu``) and/or
NVDEC in each pipeline process (``gpu``).

The runs are what users run: the supervisor of ``pipeline.app.supervisor`` with its local
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
decode in worker processes: each pipeline process gets ``cores / processes - 2`` of them
(at least 1). Each row also gives, over its window and summed over the processes, every
stage's work ms per frame and seconds blocked (``pipeline_stage_*`` of the hosts' metrics),
the busiest stage of any process (work % of the window) and each GPU's mean utilisation.
``--small`` (CI, no GPU): the same on the CPU path with ``runtime.pipelines`` in place of
GPUs (each process on its share of the cores), YOLOv3-tiny on onnxruntime, bikes.mp4, a
couple of cameras, 2.5 s per window. A measurement that fails writes its error in its
row; with ``--budget-s`` one that would not fit in the time left is skipped (and says so).
"""

from __future__ import annotations

import argparse
import contextlib
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
    counts_arg,
    emit_table,
    looped_clip,
    pipeline_config,
)
from pipeline.app.clips import clip_frames
from pipeline.app.measurement import UtilisationSampler
from samples.fetch import SamplePaths, ensure_samples

START_TIMEOUT_S = 300.0  # every host must deliver within this (compiling from the cache)
OVERHEAD_S = {"full": 60.0, "small": 15.0}  # start-up and drain of one measurement


@dataclass
class Row:
    """One measurement: ``gpus`` GPUs, ``per_gpu`` pipeline processes on each (more than one
    only with one GPU: ``runtime.pipelines``), ``decode`` ``cpu`` (worker processes) or
    ``gpu`` (NVDEC)."""

    gpus: int
    cameras: int
    paced: bool
    per_gpu: int = 1
    decode: str = "cpu"
    offered: float | None = None  # paced: cameras x pace_fps
    fps: float | None = None
    dropped: int | None = None
    start_s: float | None = None  # until every host delivered
    stages: str = ""  # the window's per-stage profile (Totals.profile)
    within_100ms: float | None = None  # share of the window's frames with latency <= 100 ms
    gpu_util: list[float | None] = field(default_factory=list)  # per GPU, mean %
    notes: list[str] = field(default_factory=list)

    @property
    def p99_within_100ms(self) -> bool:
        return self.within_100ms is not None and self.within_100ms >= 0.99

    @property
    def processes(self) -> int:
        return self.gpus * self.per_gpu

    @property
    def layout(self) -> str:
        return f"{self.gpus}" if self.per_gpu == 1 else f"{self.gpus}x{self.per_gpu}"

    @property
    def held(self) -> bool:
        return (self.paced and self.fps is not None and self.dropped == 0
                and self.fps >= DELIVERED_SHARE * (self.offered or 0))


STAGE_SAMPLES = {"pipeline_stage_frames_total": 0, "pipeline_stage_work_seconds_total": 1,
                 "pipeline_stage_blocked_seconds_total": 2}


@dataclass
class Snapshot:
    """One host's metrics as they arrived: its sources' frames and drops, and per stage
    (sinks summed into ``sinks``) [frames, work s, blocked s]."""

    time: float
    frames: float
    dropped: float
    stages: dict[str, list[float]]
    latency: list[float] = field(default_factory=lambda: [0.0, 0.0])  # [<= 100 ms, all]


class Totals:
    """Every host's metrics snapshots (the supervisor's exporter interface)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.history: dict[str, list[Snapshot]] = {}

    def update(self, pipeline: str, families: list[Any]) -> None:
        item = Snapshot(time.monotonic(), 0.0, 0.0, {})
        for family in families:
            for name, labels, value in family.samples:
                if name == "pipeline_source_frames_total":
                    item.frames += value
                elif name == "pipeline_source_dropped_frames_total":
                    item.dropped += value
                elif name == "pipeline_frame_latency_seconds_bucket":
                    le = dict(labels).get("le")
                    if le in ("0.1", "+Inf"):
                        item.latency[le == "+Inf"] += value
                elif name in STAGE_SAMPLES:
                    stage = dict(labels).get("stage", "?")
                    stage = "sinks" if stage.startswith("sink:") else stage
                    item.stages.setdefault(stage, [0.0, 0.0, 0.0])[STAGE_SAMPLES[name]] += value
        with self.lock:
            self.history.setdefault(pipeline, []).append(item)

    def delivering(self) -> int:
        """Hosts that delivered frames."""
        with self.lock:
            return sum(1 for history in self.history.values() if history[-1].frames > 0)

    def _ends(self, start: float, end: float) -> dict[str, tuple[Snapshot, Snapshot]]:
        with self.lock:
            histories = {name: list(history) for name, history in self.history.items()}
        ends = {}
        for name, history in histories.items():
            inside = [item for item in history if start <= item.time <= end]
            if len(inside) < 2:
                raise RuntimeError(f"{name}: fewer than two metrics snapshots in the window")
            ends[name] = inside[0], inside[-1]
        return ends

    def window(self, start: float, end: float) -> tuple[float, int]:
        """(frames/s, frames dropped) in [start, end], summed over the hosts, each from its
        first and last snapshot inside it.

        Raises:
            RuntimeError: a host has fewer than two snapshots in it (a window too short).
        """
        fps, dropped = 0.0, 0
        for first, last in self._ends(start, end).values():
            fps += (last.frames - first.frames) / (last.time - first.time)
            dropped += int(last.dropped - first.dropped)
        return fps, dropped

    def within_100ms(self, start: float, end: float) -> float | None:
        """The share of the window's frames (every host) whose capture-to-sink latency was
        at most 100 ms (a bucket bound of ``pipeline_frame_latency_seconds``): p99 <= 100 ms
        when it is >= 0.99. None: no frame."""
        fast = every = 0.0
        for first, last in self._ends(start, end).values():
            fast += last.latency[0] - first.latency[0]
            every += last.latency[1] - first.latency[1]
        return fast / every if every else None

    def profile(self, start: float, end: float) -> str:
        """The window's stages summed over the hosts: ``name work ms/f, blocked s`` each, then
        the busiest stage of any host (its work in % of that host's window)."""
        sums: dict[str, list[float]] = {}
        busiest = (0.0, "")
        for host, (first, last) in self._ends(start, end).items():
            for stage, after in last.stages.items():
                before = first.stages.get(stage, [0.0, 0.0, 0.0])
                delta = [a - b for a, b in zip(after, before)]
                total = sums.setdefault(stage, [0.0, 0.0, 0.0])
                for k in range(3):
                    total[k] += delta[k]
                if stage != "sinks":  # the sinks are many threads: their sum is no thread's
                    busiest = max(busiest, (100 * delta[1] / (last.time - first.time),
                                            f"{host} {stage}"))
        parts = [f"{stage} {1000 * work / frames if frames else 0:.2f} ms/f, {blocked:.1f} s "
                 f"blocked" for stage, (frames, work, blocked) in sums.items()]
        return "; ".join(parts) + (f"; busiest: {busiest[1]} {busiest[0]:.0f}%"
                                   if busiest[1] else "")


def measure(setup: Setup, row: Row, out: Path, small: bool, warmup_s: float,
            cores: int) -> None:
    from pipeline.app.supervisor import LocalExecutor, Supervisor

    config = pipeline_config(setup, row.cameras, row.decode, setup.batch_cap, out,
                             paced=row.paced)
    config.runtime.decode_workers = (max(1, cores // row.processes - 2) if row.decode == "cpu"
                                     else 0)
    devices: list[int | None]
    if small or row.per_gpu > 1:
        devices = [None] * row.processes  # runtime.pipelines: on inference.gpu_id (0)
        config.runtime.pipelines = row.processes
    else:
        devices = list(range(row.gpus))
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
        while totals.delivering() < row.processes:
            if not runner.is_alive():
                raise RuntimeError(f"the run ended before every host delivered: {failure}")
            if time.monotonic() - started > START_TIMEOUT_S:
                raise RuntimeError(f"not every host delivered within {START_TIMEOUT_S:g} s")
            time.sleep(0.2)
        row.start_s = time.monotonic() - started
        time.sleep(warmup_s)
        samplers = [UtilisationSampler(not small, index=gpu) for gpu in range(row.gpus)]
        with contextlib.ExitStack() as stack:
            for sampler in samplers:
                stack.enter_context(sampler)
            t0, p0 = time.monotonic(), time.perf_counter()
            time.sleep(setup.seconds)
            t1, p1 = time.monotonic(), time.perf_counter()
        row.fps, row.dropped = totals.window(t0, t1)
        row.stages = totals.profile(t0, t1)
        row.within_100ms = totals.within_100ms(t0, t1)
        row.gpu_util = [sampler.mean(p0, p1) for sampler in samplers]
        errors = {name: e for name, e in supervisor.results.items() if e}
        if errors:
            row.notes.append(f"errors: {errors}")
    finally:
        supervisor.request_stop()
        runner.join(120)


def num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def utilisation(row: Row) -> str:
    return " / ".join(num(u) for u in row.gpu_util)


def markdown(rows: list[Row], header: str, pace_fps: float) -> str:
    """The tables: ``GPUs`` is the layout (``1x3``: 3 processes on one GPU); ``x first`` and
    the paced verdict compare each layout with the first of the same decode mode."""
    lines = [header, ""]
    unpaced = [r for r in rows if not r.paced]
    if unpaced:
        base = {}
        for r in unpaced:
            if r.fps:
                base.setdefault(r.decode, r.fps)
        lines += ["| decode | GPUs | processes | cameras | frames/s | x first | GPU util % | "
                  "start s | stages in the window: work ms per frame, blocked s (all "
                  "processes) | notes |", "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r.decode} | {r.layout} | {r.processes} | {r.cameras} | {num(r.fps)} | "
                  f"{num(r.fps / base[r.decode] if r.fps and r.decode in base else None, 2)} | "
                  f"{utilisation(r)} | {num(r.start_s, 1)} | {r.stages} | "
                  f"{'; '.join(r.notes)} |" for r in unpaced]
        lines.append("")
    paced = [r for r in rows if r.paced]
    if paced:
        lines += [f"Paced: every camera live at {pace_fps:g} frames/s.", "",
                  "| decode | GPUs | processes | cameras | offered fps | delivered fps | "
                  "dropped | held | frames <= 100 ms % | GPU util % | stages in the window | "
                  "notes |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r.decode} | {r.layout} | {r.processes} | {r.cameras} | "
                  f"{num(r.offered)} | {num(r.fps)} | {num(r.dropped)} | "
                  f"{'yes' if r.held else 'no'} | "
                  f"{num(None if r.within_100ms is None else 100 * r.within_100ms, 1)} | "
                  f"{utilisation(r)} | {r.stages} | {'; '.join(r.notes)} |" for r in paced]
        lines.append("")
        for decode in dict.fromkeys(r.decode for r in paced):
            mine = [r for r in paced if r.decode == decode]
            held = {layout: max((r.cameras for r in mine if r.layout == layout and r.held),
                                default=0) for layout in dict.fromkeys(r.layout for r in mine)}
            first_layout, first = next(iter(held.items()))
            lines.append(f"Largest paced count held ({decode} decode): " + ", ".join(
                f"{layout} GPU(s): {n}" + (f" ({n / first:.2f}x)" if first and
                                           layout != first_layout else "")
                for layout, n in held.items()))
            fast = {layout: max((r.cameras for r in mine if r.layout == layout and r.held
                                 and r.p99_within_100ms), default=0) for layout in held}
            lines.append(f"Largest held with p99 <= 100 ms ({decode} decode): " + ", ".join(
                f"{layout} GPU(s): {n}" for layout, n in fast.items()))
    return "\n".join(lines) + "\n"


def layouts_arg(parser: argparse.ArgumentParser, text: str) -> list[tuple[int, int]]:
    """--gpus: a comma-separated list of ``N`` (N GPUs, a process each) and ``1xK`` (K
    processes on one GPU), as (GPUs, processes per GPU)."""
    layouts = []
    for item in text.split(","):
        gpus, _, per_gpu = item.strip().partition("x")
        try:
            layout = int(gpus), int(per_gpu or 1)
        except ValueError:
            parser.error(f"--gpus: expected N or 1xK items, got {item!r}")
        if min(layout) < 1 or (layout[1] > 1 and layout[0] != 1):
            parser.error(f"--gpus: expected N >= 1 or 1xK (K processes on one GPU), got {item!r}")
        layouts.append(layout)
    return layouts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.multi_gpu",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="CPU-only mode for CI")
    parser.add_argument("--gpus", default=None,
                        help="layouts to compare: N GPUs, or 1xK (K processes on one GPU); "
                             "default 1,2")
    parser.add_argument("--decode", default="cpu",
                        help="cpu (decode worker processes), gpu (NVDEC in each process) or "
                             "both: cpu,gpu (default cpu)")
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
    layouts = layouts_arg(parser, args.gpus or "1,2")
    decodes = [d.strip() for d in args.decode.split(",")]
    if not set(decodes) <= {"cpu", "gpu"} or (small and decodes != ["cpu"]):
        parser.error(f"--decode: cpu and/or gpu (small mode: cpu), got {args.decode!r}")
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
    if not (samples.bikes.exists() and (samples.model.exists() or not small)):
        samples = ensure_samples(assets, log=print)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    rows = [Row(g, n, False, k, d) for d in decodes for n in cameras for g, k in layouts] + \
        [Row(g, n, True, k, d, offered=n * pace_fps) for d in decodes for g, k in layouts
         for n in paced]
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
            what = ("YOLOv8s 640, torch FP16 compiled, bikes.mp4 upscaled to 1080p, runtime.gpus "
                    "(N GPUs) or runtime.pipelines (1xK)")
        for row in rows:
            left = None if args.budget_s is None else args.budget_s - (time.monotonic() - started)
            if left is not None and left < window + OVERHEAD_S["small" if small else "full"]:
                row.notes.append("skipped: no time left (--budget-s)")
                continue
            out = Path(tmp) / f"out-{row.decode}-{row.layout}-{row.cameras}-{row.paced}"
            try:
                measure(dataclasses.replace(setup), row, out, small, warmup_s, cores)
            except Exception as error:  # noqa: BLE001 - the table says what failed
                row.notes.append(f"failed: {type(error).__name__}: {error}")
            print(row, flush=True)
        header = (f"Multi-GPU, {what}; each camera reads {clip.name} ({clip_frames(clip):,} "
                  f"frames); {warmup_s:g} s warm-up once every process delivered, then "
                  f"{seconds:g} s; {cores} cores, CPU decode workers per process: cores / "
                  f"processes - 2.")
    emit_table(markdown(rows, header, pace_fps), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
