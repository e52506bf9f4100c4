"""Throughput at scale: N synthetic cameras through the real pipeline, unpaced (each camera as
fast as the pipeline takes it) and paced (every camera delivering 30 frames/s in real time,
like a real camera), each stage alone, and a naive sequential pipeline, in one run.

    python -m benchmarks.throughput [--small] [--cameras 1,8,32,64,100] [--seconds 10]
        [--decode cpu,gpu[,cpu-threads]] [--decode-workers auto|N] [--paced 32,64,100,128]
        [--pace-fps 30] [--paced-warmup-s 2] [--paced-decode cpu] [--no-naive]
        [--compile | --no-compile] [--engine-cache DIR | --fresh-cache] [--budget-s S]
        [--gil-profile DIR] [--out t.md]

Decode modes: ``cpu`` decodes on the CPU in worker processes into the shared-memory slot ring
(``runtime.decode_workers``: ``--decode-workers``, default auto = one per source, at most the
core count less 2), ``cpu-threads`` on the CPU in threads of the pipeline process
(``decode_workers: 0``), ``gpu`` on NVDEC in the pipeline process.

Full mode (a GPU): every camera reads a long 1080p H.264 file: bikes.mp4 (natural footage)
upscaled to 1080p at 4 Mbps, like a camera, then repeated end to end by a stream copy (no
re-encode) often enough that no camera runs out within a measurement. The cameras are plain
file sources built by the public ``pipeline.app.build.build_graph``; nothing inside a built graph
is touched. The model is the real YOLOv8s export (``samples.yolov8``, dynamic batch) at 640,
torch backend, FP16, compiled (``inference.compile``; ``--no-compile`` runs it eagerly), with
its compile artefacts in ``--engine-cache`` (persistent, default ``assets/engines``) or, with
``--fresh-cache``, in the run's temporary folder (every start then compiles from scratch).
JSONL sink only. The measurements:

- inference alone, first: ``backend.infer`` on one preallocated random batch, CUDA-event
  timed, at every batch size the pipeline rows use and at batch 64 (the issue's target:
  >= 5,000 images/s for YOLOv8s 640 FP16, compiled), with the backend built exactly as the
  pipeline builds it (``stages.infer.create_backend`` with the run's config) and the seconds
  its ``warmup()`` took (compilation, CUDA graph captures);
- paced (``--paced``), for each camera count: every source ``live: true``, ``pace_fps: 30``
  (``--pace-fps``), ``reconnect: false``, reading the long looped clip, so each camera hands
  over a frame every 1/30 s whether or not the pipeline is ready for it and drops (counted)
  when it is behind. After ``--paced-warmup-s`` from the first result, a window of
  ``--seconds``: frames completed per second in it (delivered), the frames dropped in it
  (the difference of ``graph.source_metrics[name].dropped`` between its start and end), the
  capture-to-sink latency p50/p99 of the frames completed in it, GPU utilisation, and the
  stages' work and blocked time (whole run). A run keeps up when it drops nothing, its p99 is
  <= 100 ms and it delivers >= 95% of the offered rate (a decoder slower than real time does
  not drop, it falls behind: the third condition catches that). The line below the table
  names the largest camera count that kept up;
- unpaced, for each N and each decode mode:
  - the pipeline: frames/s at steady state (completions, counted per batch part through
    ``on_batch_done``, after the first 10% and before the window's end: the queues
    draining after it are left out), capture-to-sink latency p50/p99
    (``graph.source_metrics``), the mean GPU utilisation over that window (NVML, else
    ``nvidia-smi``), the seconds ``build_graph`` took, and every stage's work ms/frame and
    blocked seconds (``graph.stage_metrics``; the sinks summed), with the busiest thread (its
    work time over its active time): a thread near 100% work is the bottleneck; a stage
    mostly blocked waits on the next one (postprocess on the GPU path: blocked = waiting for
    the GPU's results or for room at the sinks). "Slot wait" is the share of the sources'
    time spent waiting for a free frame slot (``graph.ring.waited_s``: ``cpu-threads`` only, a
    worker process waits on its own view of the ring; their waits for room
    in the first queue are not in it); with every stage far from 100% work and the pipeline
    near decode alone, decode is the bottleneck;
  - decode alone: N sources decoded as the pipeline decodes them, each slot given back as
    soon as its frame arrives, nothing else: ``cpu``: the same ``DecodeWorkerPool`` the
    pipeline starts (N sources in its worker processes, into a shared-memory ring, frames
    received through its pipes); ``cpu-threads`` and ``gpu``: N threads into a slot ring;
  - pipeline / slowest stage alone: 1.0 means the pipeline is as fast as its bottleneck allows;
- a naive pipeline (measured after the paced runs, shown last): one thread decodes a frame,
  uploads it, preprocesses, infers at batch 1, runs NMS and copies the detections back before
  it touches the next frame (no overlap, no batching); each row's "x naive" is its speed-up
  over that.

``--small`` runs the same on a machine without a GPU (what CI runs): bikes.mp4 (640x272)
repeated, the YOLOv3-tiny sample on onnxruntime, a couple of cameras, a few seconds, a paced
run of 2 cameras at 5 frames/s (1 s warm-up), inference alone only at the pipeline's batch.
A measurement that fails writes its error into its row
instead of ending the run; with ``--budget-s`` a measurement that would not fit in the time
left is skipped (and says so), so the table is always printed.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import av
import numpy as np

from benchmarks.overlap_benchmark import CLIP_BITRATE, CLIP_NAME, make_1080p_clip
from pipeline.app.clips import clip_frames, make_looped_clip, repeats_for
from pipeline.app.measurement import UtilisationSampler
from pipeline.config import PipelineConfig, SourceConfig, parse_config
from pipeline.records import BatchDetections, EndOfStream, Frame
from pipeline.slots import SlotRing, i420_bytes
from pipeline.stage import SourceStage
from samples.fetch import SamplePaths, ensure_samples

WARMUP_SHARE = 0.1  # the first 10% of a window's completions are start-up, not steady state
TARGET_BATCH = 64  # the inference target: >= 5,000 images/s at batch 64 (full mode)
TARGET_IMAGES_S = 5_000
# Frames/s one camera can possibly reach (decode of one stream tops out below this), to size
# the looped clip so that no camera runs out within a measurement.
CAMERA_FPS_CAP = {"full": 2_500, "small": 1_500}
# Seconds a measurement needs beyond its window (opening, compiling from the cache,
# draining), to decide under --budget-s whether it still fits.
# Once a measurement of a kind has run, its own overhead (x1.5, + 5 s) is used instead.
OVERHEAD_S = {"pipeline": 45.0, "decode": 10.0, "inference": 60.0, "naive": 45.0,
              "paced": 45.0}
P99_LIMIT_MS = 100.0  # paced: a camera count keeps up with zero drops and p99 <= this
DELIVERED_SHARE = 0.95  # ... and delivering at least this share of the offered frames/s
DECODE_MODES = ("cpu", "cpu-threads", "gpu")


@dataclass
class Setup:
    """What every measurement of one run shares."""

    clip: Path
    model: Path
    names: Path | None
    device: str  # "cuda" or "cpu"
    backend: str
    seconds: float
    batch_cap: int
    compile: bool = True
    engine_cache: Path = Path("assets/engines")
    target_batch: int | None = None  # inference alone also at this batch (full mode: 64)
    deadline: float | None = None  # time.monotonic() after which nothing new starts
    decode_workers: int | None = None  # runtime.decode_workers of the cpu mode (None: auto)
    pace_fps: float = 30.0  # paced runs: each camera's frames/s
    gil_profile_dir: Path | None = None  # py-spy GIL samples of each pipeline window go here
    paced_warmup_s: float = 2.0  # paced runs: seconds after the first result before the window
    overheads: dict[str, float] = field(default_factory=dict)  # measured, per kind: the largest

    def window_s(self, what: str) -> float:
        return self.seconds + (self.paced_warmup_s if what == "paced" else 0.0)

    def fits(self, what: str) -> bool:
        """True when a measurement of kind ``what`` can still finish before the deadline."""
        seen = self.overheads.get(what)
        overhead = OVERHEAD_S[what] if seen is None else min(OVERHEAD_S[what], 1.5 * seen + 5)
        return self.deadline is None or (
            time.monotonic() + self.window_s(what) + overhead <= self.deadline)

    def workers(self, mode: str, cameras: int) -> int:
        """Decode worker processes a ``mode`` run of ``cameras`` sources uses (0: threads)."""
        if mode != "cpu":
            return 0
        from pipeline.app.workers import default_worker_count

        wanted = (default_worker_count(cameras) if self.decode_workers is None
                  else self.decode_workers)
        return min(cameras, wanted)


@dataclass
class StageLine:
    """One stage's share of a pipeline run (the sinks summed into one line)."""

    name: str
    work_ms_per_frame: float
    work_s: float
    blocked_s: float
    active_s: float  # first item's start to last item's end

    @property
    def work_share(self) -> float:
        return self.work_s / self.active_s if self.active_s > 0 else 0.0


def busiest_cell(stages: list[StageLine]) -> str:
    """The table cell naming the stage that worked the largest share of its active time."""
    if not stages:
        return ""
    busiest = max(stages, key=lambda s: s.work_share)
    return f"{busiest.name} {100 * busiest.work_share:.0f}%"


@dataclass
class Row:
    """One line of the table; None where not measured, errors in ``notes``."""

    decode: str
    cameras: int
    batch: int
    workers: int = 0  # decode worker processes (0: decoded in the pipeline process)
    fps: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    gpu_util: float | None = None
    decode_fps: float | None = None
    infer_fps: float | None = None
    naive_fps: float | None = None
    build_s: float | None = None
    stages: list[StageLine] = field(default_factory=list)
    slot_wait_share: float | None = None  # sources' time waiting for a free frame slot
    gil: str | None = None  # who held the interpreter lock in the window (--gil-profile)
    notes: list[str] = field(default_factory=list)

    @property
    def slowest(self) -> tuple[str, float] | None:
        stages = [(n, v) for n, v in (("decode", self.decode_fps), ("infer", self.infer_fps)) if v]
        return min(stages, key=lambda s: s[1]) if stages else None


@dataclass
class PacedRow:
    """One paced run: every camera at ``pace_fps`` in real time; None where not measured."""

    decode: str
    cameras: int
    batch: int
    pace_fps: float
    workers: int = 0
    delivered_fps: float | None = None  # frames completed per second in the window
    dropped: int | None = None  # frames dropped in the window (sources and live lanes)
    frames: int | None = None  # frames completed in the window
    p50_ms: float | None = None
    p99_ms: float | None = None
    gpu_util: float | None = None
    decode_fps: float | None = None  # decode alone, same mode and camera count (unpaced table)
    infer_fps: float | None = None
    naive_fps: float | None = None
    build_s: float | None = None
    stages: list[StageLine] = field(default_factory=list)
    gil: str | None = None  # who held the interpreter lock in the window (--gil-profile)
    notes: list[str] = field(default_factory=list)

    @property
    def offered_fps(self) -> float:
        return self.cameras * self.pace_fps

    @property
    def kept_up(self) -> bool:
        return (self.dropped == 0 and self.p99_ms is not None and self.p99_ms <= P99_LIMIT_MS
                and self.delivered_fps is not None
                and self.delivered_fps >= DELIVERED_SHARE * self.offered_fps)


@dataclass
class InferenceRow:
    """Inference alone at one batch size."""

    batch: int
    images_s: float | None = None
    warmup_s: float | None = None
    backend: str = ""
    notes: list[str] = field(default_factory=list)


def steady_rate(times: Any, counts: Any = None) -> tuple[float, float, float]:
    """(items/s, start, end) over completion ``times``, the first 10% of items left out.

    Args:
        times: completion times in seconds, any order.
        counts: items completed at each time (a batch part completes ``len(part)`` frames at
            once), or None for one item per time.
    """
    times = np.asarray(times, np.float64).reshape(-1)
    if counts is not None:
        times = np.repeat(times, np.asarray(counts, np.int64).reshape(-1))
    times = np.sort(times)
    first = int(len(times) * WARMUP_SHARE)
    if len(times) - first < 2 or times[-1] <= times[first]:
        raise RuntimeError(f"too few completions to measure ({len(times)})")
    start, end = float(times[first]), float(times[-1])
    return (len(times) - 1 - first) / (end - start), start, end


def looped_clip(clip: Path, seconds: float, fps_cap: int, cache: Path) -> Path:
    """A copy of ``clip`` repeated often enough for one camera at ``fps_cap`` frames/s to
    read for ``seconds`` plus start-up."""
    repeats = repeats_for(clip_frames(clip), seconds + 2, fps_cap)
    return make_looped_clip(clip, cache / f"{clip.stem}_x{repeats}.mp4", repeats)


def pipeline_config(setup: Setup, cameras: int, decode: str, batch: int, out: Path,
                    paced: bool = False) -> PipelineConfig:
    """The run's configuration: ``cameras`` sources of ``decode`` mode (``DECODE_MODES``);
    ``paced``: each one live, at ``setup.pace_fps`` in real time, never reconnecting."""
    live = {"live": True, "pace_fps": setup.pace_fps, "reconnect": False} if paced else {}
    sources = [{"name": f"cam{i:03d}", "uri": str(setup.clip),
                "decode": "gpu" if decode == "gpu" else "cpu", **live} for i in range(cameras)]
    return parse_config({
        "sources": sources,
        "model": {"path": str(setup.model),
                  "class_names": str(setup.names) if setup.names else None},
        "inference": {"device": setup.device, "backend": setup.backend, "precision": "fp16",
                      "batch_size": batch, "batch_timeout_ms": 5.0, "compile": setup.compile,
                      "engine_cache": str(setup.engine_cache)},
        "output": {"dir": str(out), "video": None, "jsonl": "{source}.jsonl"},
        "runtime": {"progress": False, "log_level": "warning",
                    "decode_workers": setup.workers(decode, cameras)},
    })


def stage_lines(graph: Any) -> list[StageLine]:
    """Every chain stage's metrics, then the sinks summed into one line."""
    chain, sinks = [], []
    for name, metrics in graph.stage_metrics.items():
        (sinks if name.startswith("sink:") else chain).append(metrics)

    def line(name: str, group: list[Any]) -> StageLine:
        summaries = [m.summary() for m in group]
        frames = sum(s["frames"] for s in summaries)
        work_s = sum(m.work_s for m in group)
        active = [(m.started, m.ended) for m in group if m.started is not None and m.ended]
        active_s = (max(e for _, e in active) - min(s for s, _ in active)) if active else 0.0
        return StageLine(name, 1000 * work_s / frames if frames else 0.0, work_s,
                         sum(m.blocked_s for m in group), active_s)

    lines = [line(m.name, [m]) for m in chain]
    if sinks:
        lines.append(line(f"sinks({len(sinks)})", sinks))
    return lines


def measure_pipeline(setup: Setup, row: Row, out: Path) -> None:
    from pipeline.app.build import build_graph

    config = pipeline_config(setup, row.cameras, row.decode, row.batch, out)
    row.workers = config.runtime.decode_workers or 0
    times: list[float] = []
    counts: list[int] = []
    lock = threading.Lock()
    timer: threading.Timer | None = None
    window_ended = threading.Event()
    window_end = [math.inf]
    graph: Any = None
    profile = None

    def end_window() -> None:
        window_end[0] = time.perf_counter()
        window_ended.set()
        graph.request_stop()

    def batch_done(source: str, part: BatchDetections) -> None:
        nonlocal timer, profile
        now = time.perf_counter()
        with lock:  # sinks call this from their own threads
            if timer is None:  # the window starts with the first result, after start-up
                timer = threading.Timer(setup.seconds, end_window)
                timer.daemon = True
                timer.start()
                profile = start_gil_profile(setup, f"{row.decode}-{row.cameras}")
            times.append(now)
            counts.append(len(part))

    started = time.perf_counter()
    graph = build_graph(config, on_batch_done=batch_done)
    row.build_s = time.perf_counter() - started
    try:
        with UtilisationSampler(setup.device == "cuda") as sampler:
            graph.run()
    finally:
        if timer is not None:
            timer.cancel()
        if profile is not None:
            row.gil = profile.wait()
    errors = {m.error for m in graph.source_metrics.values() if m.error}
    if errors:
        raise RuntimeError("; ".join(sorted(errors)))
    if not window_ended.is_set():
        row.notes.append("the clip ran out before the window ended")
    # What completes after the window is the queues draining, no longer steady state.
    inside = np.asarray(times) <= window_end[0]
    row.fps, start, end = steady_rate(np.asarray(times)[inside], np.asarray(counts)[inside])
    latencies = np.concatenate([m.latency_s for m in graph.source_metrics.values()])
    row.p50_ms, row.p99_ms = (1000 * float(np.percentile(latencies, q)) for q in (50, 99))
    row.gpu_util = sampler.mean(start, end)
    row.stages = stage_lines(graph)
    # GPU frames take no slot; a worker process waits for one on its own view of the ring.
    if graph.ring is not None and row.stages and row.decode == "cpu" and not row.workers:
        active = max(line.active_s for line in row.stages)
        if active > 0:
            row.slot_wait_share = graph.ring.waited_s / (row.cameras * active)


def measure_paced(setup: Setup, row: PacedRow, out: Path) -> None:
    """One paced run (module docstring): warm-up, then a window of ``setup.seconds``."""
    from pipeline.app.build import build_graph

    config = pipeline_config(setup, row.cameras, row.decode, row.batch, out, paced=True)
    row.workers = config.runtime.decode_workers or 0
    lock = threading.Lock()
    window: dict[str, float] = {}  # start, end: perf_counter; dropped0, dropped1: counters
    done: list[tuple[float, int]] = []  # (time, frames) of each part completed in the window
    latencies: list[np.ndarray] = []
    timers: list[threading.Timer] = []
    graph: Any = None
    profiles: list[Any] = []

    def dropped() -> int:
        graph.refresh_source_metrics()
        return sum(m.dropped for m in graph.source_metrics.values())

    def start_window() -> None:
        with lock:
            window["dropped0"] = dropped()
            window["start"] = time.perf_counter()
        later(setup.seconds, end_window)
        profiles.append(start_gil_profile(setup, f"paced-{row.decode}-{row.cameras}"))

    def end_window() -> None:
        with lock:
            window["end"] = time.perf_counter()
            window["dropped1"] = dropped()
        graph.request_stop()

    def later(seconds: float, call: Callable[[], None]) -> None:
        timer = threading.Timer(seconds, call)
        timer.daemon = True
        timers.append(timer)
        timer.start()

    def batch_done(source: str, part: BatchDetections) -> None:
        now = time.perf_counter()
        latency = time.time() - np.asarray(part.frames.capture_time, np.float64)
        with lock:  # sinks call this from their own threads
            if not timers:  # the warm-up starts with the first result
                later(setup.paced_warmup_s, start_window)
            elif "start" in window and "end" not in window:
                done.append((now, len(part)))
                latencies.append(latency)

    started = time.perf_counter()
    graph = build_graph(config, on_batch_done=batch_done)
    row.build_s = time.perf_counter() - started
    try:
        with UtilisationSampler(setup.device == "cuda") as sampler:
            graph.run()
    finally:
        for timer in timers:
            timer.cancel()
        for profile in profiles:
            if profile is not None:
                row.gil = profile.wait()
    errors = {m.error for m in graph.source_metrics.values() if m.error}
    if errors:
        raise RuntimeError("; ".join(sorted(errors)))
    row.stages = stage_lines(graph)
    if "end" not in window:
        raise RuntimeError("the sources ended before the window did")
    span = window["end"] - window["start"]
    row.frames = sum(n for _, n in done)
    row.delivered_fps = row.frames / span
    row.dropped = int(window["dropped1"] - window["dropped0"])
    if not latencies:
        raise RuntimeError("no frame completed within the window")
    inside = np.concatenate(latencies)
    row.p50_ms, row.p99_ms = (1000 * float(np.percentile(inside, q)) for q in (50, 99))
    row.gpu_util = sampler.mean(window["start"], window["end"])


def start_gil_profile(setup: Setup, name: str) -> Any:
    """With ``--gil-profile``: py-spy samples of the interpreter lock's holders for one window
    (``benchmarks.gil_profile``), else None."""
    if setup.gil_profile_dir is None:
        return None
    from benchmarks.gil_profile import GilProfile

    return GilProfile(setup.gil_profile_dir / f"{name}.txt", setup.seconds).start()


def gil_lines(rows: list[Row] | list[PacedRow], what: str) -> str:
    """The GIL profiles of the rows that have one, one line each."""
    lines = [f"- {what} {row.decode}, {row.cameras} cameras: {row.gil}" for row in rows
             if row.gil]
    return ("\nInterpreter lock (py-spy --gil, the window only):\n\n" + "\n".join(lines) + "\n"
            if lines else "")


def make_source(setup: Setup, decode: str, index: int, ring: SlotRing | None = None,
                abort: threading.Event | None = None) -> SourceStage:
    source = SourceConfig(name=f"cam{index:03d}", uri=str(setup.clip))
    if decode == "gpu":
        from stages.gpu_decode import GpuDecodeStage

        return GpuDecodeStage(source, 0, ring)
    from stages.decode import DecodeStage

    return DecodeStage(source, ring, abort)


def measure_decode(setup: Setup, decode: str, cameras: int,
                   counted: dict[str, int] | None = None) -> float:
    """Frames/s of ``cameras`` sources decoded as the pipeline decodes them, each slot given
    back as soon as its frame arrives; nothing else. ``cpu`` with decode workers: the
    pipeline's own ``DecodeWorkerPool`` (worker processes, a shared-memory ring, the frames
    received through its pipes, one reading thread per source as in the graph); otherwise
    one thread per source (``DecodeStage`` / ``GpuDecodeStage``) into a slot ring.
    ``counted["frames"]`` is set to every frame received, window or not."""
    from pipeline.app.build import frame_slots
    from pipeline.app.workers import DecodeWorkerPool
    from stages.decode import decoder_threads

    stop = threading.Event()
    width, height = probe_size(setup.clip)
    workers = setup.workers(decode, cameras)
    pool: DecodeWorkerPool | None = None
    if workers:
        config = pipeline_config(setup, cameras, decode, setup.batch_cap, Path("."))
        ring = SlotRing(frame_slots(config), i420_bytes(width, height), shared=True)
        pool = DecodeWorkerPool(config, ring, workers, decoder_threads(len(config.sources)),
                                list(enumerate(config.sources)))
        sources: list[SourceStage] = pool.sources
    else:
        ring = SlotRing(4 * cameras, i420_bytes(width, height))
        sources = [make_source(setup, decode, i, ring, stop) for i in range(cameras)]
    done: list[float] = []
    failures: list[str] = []

    def read(source: SourceStage) -> None:
        for item in source.frames(stop):
            if isinstance(item, Frame):
                ring.release([item.slot])
                done.append(time.perf_counter())  # list.append is atomic: no lock needed
            elif item.error:
                failures.append(item.error)

    threads = [threading.Thread(target=read, args=(source,), daemon=True) for source in sources]
    try:
        if pool is not None:
            pool.start()
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + setup.seconds + 30  # + start-up (opening, first frames)
        while time.monotonic() < deadline and not failures and any(t.is_alive() for t in threads):
            if done and time.perf_counter() - done[0] >= setup.seconds:
                break
            time.sleep(0.05)
        measured = list(done)
    finally:
        stop.set()
        if pool is not None:
            pool.request_stop()
        for thread in threads:
            thread.join(30)
        if pool is not None:
            pool.close()
        ring.close()
    if counted is not None:
        counted["frames"] = len(done)
    if failures:
        raise RuntimeError(failures[0])
    return steady_rate(measured)[0]


def probe_size(clip: Path) -> tuple[int, int]:
    with av.open(str(clip)) as container:
        stream = container.streams.video[0]
        return max(stream.width, 2) & ~1, max(stream.height, 2) & ~1


def measure_inference(setup: Setup, row: InferenceRow) -> None:
    """Images/s of ``backend.infer`` on one preallocated batch of random images, the backend
    built as the pipeline builds it; also how long its ``warmup()`` took
    (``pipeline.app.ceilings.engine_rate``, what ``capacity`` calls engine alone)."""
    from pipeline.app.ceilings import engine_rate

    rate = engine_rate(pipeline_config(setup, 1, "cpu", row.batch, Path(".")), setup.seconds / 2)
    row.backend, row.warmup_s, row.images_s = rate.backend, rate.warmup_s, rate.images_s


def measure_naive(setup: Setup, row: Row) -> None:
    """One thread, one frame at a time: decode, upload, preprocess, infer, NMS, D2H."""
    from kernels.preprocess import letterbox_geometry
    from pipeline.app.build import create_gpu_context
    from stages.backends.base import read_model_info
    from stages.infer import create_backend

    config = pipeline_config(setup, 1, "cpu", 1, Path("."))
    info, nms = read_model_info(setup.model), config.nms
    gpu = create_gpu_context(config)
    backend = create_backend(config.inference, setup.model, info, gpu)
    started = time.perf_counter()
    backend.warmup()
    row.build_s = time.perf_counter() - started
    process = naive_cpu_step(backend, nms) if gpu is None else naive_gpu_step(backend, nms, gpu)
    stop = threading.Event()
    done: list[float] = []
    latencies: list[float] = []
    letterboxes: dict[tuple[int, int], Any] = {}
    try:
        for item in make_source(setup, "cpu", 0).frames(stop):
            if isinstance(item, EndOfStream):
                if item.error:
                    raise RuntimeError(item.error)
                break
            size = (item.width, item.height)
            if size not in letterboxes:
                letterboxes[size] = letterbox_geometry(*size, info.input_width, info.input_height)
            process(item, letterboxes[size])
            done.append(time.perf_counter())
            latencies.append(time.time() - item.capture_time)
            if done[-1] - done[0] >= setup.seconds:
                stop.set()
    finally:
        stop.set()
        backend.close()
    row.fps, start, end = steady_rate(done)
    row.naive_fps = row.fps
    row.p50_ms, row.p99_ms = (1000 * float(np.percentile(latencies, q)) for q in (50, 99))


def naive_cpu_step(backend: Any, nms: Any) -> Callable[[Frame, Any], Any]:
    from kernels.nms import postprocess_reference
    from kernels.preprocess import preprocess_reference

    def step(frame: Frame, letterbox: Any) -> Any:
        images = preprocess_reference(frame.image, frame.width, frame.height, letterbox)[None]
        return postprocess_reference(backend.infer(images), nms.conf_threshold,
                                     nms.iou_threshold, nms.class_agnostic, nms.max_detections)
    return step


def naive_gpu_step(backend: Any, nms: Any, gpu: Any) -> Callable[[Frame, Any], Any]:
    import cupy

    from kernels.nms_cuda import CudaNms, stream_from_cupy, to_host
    from kernels.preprocess_cuda import launch_preprocess_frame, warmup_preprocess

    stream, nstream = gpu.compute_stream, stream_from_cupy(gpu.compute_stream)
    images = backend.input_buffer(1)
    with stream:
        images.fill(0.5)
    output = backend.infer(images, stream)
    cuda_nms = CudaNms(1, output.shape[2], output.shape[1] - 4, nms.conf_threshold,
                       nms.iou_threshold, nms.class_agnostic, nms.max_detections)
    cuda_nms.warmup(output, stream=nstream)  # the very output binding: nothing compiles later
    warmed: set[Any] = set()

    def step(frame: Frame, letterbox: Any) -> Any:
        if letterbox not in warmed:
            warmup_preprocess(letterbox, images.dtype)
            warmed.add(letterbox)
        with stream:
            device = cupy.asarray(frame.image)  # pageable H2D, as a plain program does it
        launch_preprocess_frame(device, letterbox, images, 0, stream)
        kept = cuda_nms.run(backend.infer(images, stream), nstream)
        return to_host(*kept, stream=nstream)  # synchronises: the next frame waits for this one
    return step


def attempt(setup: Setup, row: Row | PacedRow | InferenceRow, what: str,
            measure: Callable[[], Any]) -> Any:
    """Run one measurement unless the time budget is spent; a failure is noted in the row
    (traceback on stderr), not raised. Records how long it took beyond its window."""
    if not setup.fits(what):
        row.notes.append(f"{what} skipped: time budget spent")
        return None
    started = time.monotonic()
    try:
        result = measure()
        overhead = time.monotonic() - started - setup.window_s(what)
        setup.overheads[what] = max(setup.overheads.get(what, 0.0), overhead)
        return result
    except Exception as error:  # noqa: BLE001 - the table shows it; the run goes on
        traceback.print_exc(file=sys.stderr)
        row.notes.append(f"{what} failed: {type(error).__name__}: {' '.join(str(error).split())}")
        return None
    finally:
        gc.collect()


def decode_modes(setup: Setup, wanted: list[str]) -> list[tuple[str, str | None]]:
    """(mode, why it cannot run or None) for the wanted modes; gpu only on the GPU path."""
    modes = []
    for mode in wanted:
        if mode != "gpu":
            modes.append((mode, None))
        elif setup.device == "cuda":
            from stages.gpu_decode import gpu_decode_unavailable_reason

            modes.append(("gpu", gpu_decode_unavailable_reason()))
    return modes


def row_batch(setup: Setup, cameras: int) -> int:
    """Every row runs the same largest batch: smaller batches run their own captured graph
    (no padding), and one compiled model (one cache entry) serves every row."""
    return setup.batch_cap


@dataclass
class Results:
    rows: list[Row]
    paced: list[PacedRow]
    inference: list[InferenceRow]


def run_benchmark(setup: Setup, cameras: list[int], decode: list[str], naive: bool = True,
                  paced: list[int] | None = None, paced_decode: list[str] | None = None
                  ) -> Results:
    """Every row of the tables (see the module docstring), each printed to stderr when done.
    Order: inference alone (it fills the compile cache), the paced runs, the naive pipeline,
    then the unpaced rows, camera count by camera count (every decode mode of a count before
    the next count); with a budget, what does not fit at the end is skipped."""
    paced, paced_decode = paced or [], paced_decode or ["cpu"]
    batches = sorted({row_batch(setup, n) for n in [*cameras, *paced]}
                     | ({setup.target_batch} if setup.target_batch else set()))
    inference = [InferenceRow(batch) for batch in batches]
    for irow in inference:  # first: they also fill the compile cache the pipelines start from
        attempt(setup, irow, "inference", lambda r=irow: measure_inference(setup, r))
        print(inference_markdown([irow], f"measured inference alone, batch {irow.batch}:"),
              file=sys.stderr, flush=True)
    infer_fps = {r.batch: r.images_s for r in inference}
    rows: list[Row] = []
    paced_rows: list[PacedRow] = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode, unavailable in decode_modes(setup, paced_decode):
            for count in paced:
                prow = PacedRow(mode, count, row_batch(setup, count), setup.pace_fps,
                                setup.workers(mode, count))
                paced_rows.append(prow)
                prow.infer_fps = infer_fps.get(prow.batch)
                if unavailable:
                    prow.notes.append(f"gpu decode unavailable: {unavailable}")
                    continue
                attempt(setup, prow, "paced",
                        lambda r=prow: measure_paced(setup, r, Path(tmp) / "paced"))
                print(paced_markdown([prow], f"measured paced, {mode} decode, {count} cameras:"),
                      file=sys.stderr, flush=True)
        sequential = Row("naive sequential", 1, 1)
        if naive:
            attempt(setup, sequential, "naive", lambda: measure_naive(setup, sequential))
            print(markdown([sequential], "measured naive sequential:"), file=sys.stderr,
                  flush=True)
        modes = decode_modes(setup, decode)
        for count in cameras:
            for mode, unavailable in modes:
                row = Row(mode, count, row_batch(setup, count), setup.workers(mode, count))
                rows.append(row)
                if unavailable:
                    row.notes.append(f"gpu decode unavailable: {unavailable}")
                    continue
                row.infer_fps = infer_fps.get(row.batch)
                row.decode_fps = attempt(setup, row, "decode",
                                         lambda r=row: measure_decode(setup, r.decode, r.cameras))
                attempt(setup, row, "pipeline",
                        lambda r=row: measure_pipeline(setup, r, Path(tmp) / "out"))
                # Each row as it is done, so a run cut short still shows what it measured.
                print(markdown([row], f"measured {mode} decode, {count} cameras:"),
                      file=sys.stderr, flush=True)
    order = {mode: i for i, (mode, _) in enumerate(modes)}
    rows.sort(key=lambda r: (order[r.decode], cameras.index(r.cameras)))  # table: mode by mode
    decode_alone = {(r.decode, r.cameras): r.decode_fps for r in rows}
    for prow in paced_rows:
        prow.decode_fps = decode_alone.get((prow.decode, prow.cameras))
    if naive:
        for line in [*rows, *paced_rows]:
            line.naive_fps = sequential.fps
        rows.append(sequential)
    return Results(rows, paced_rows, inference)


def num(value: float | None, digits: int = 0) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def markdown(rows: list[Row], header: str) -> str:
    """The pipeline table, with a line of context above it."""
    lines = [header, "",
             "| decode | cameras | decode procs | batch | pipeline fps | p50 ms | p99 ms | GPU "
             "util % | decode alone fps | infer alone fps | slowest alone | pipeline / slowest | "
             "x naive | busiest thread (work % of its time) | sources' slot wait % | stages: "
             "work ms per frame, blocked s | build s | notes |",
             "|" + "---|" * 18]
    for row in rows:
        slowest = row.slowest
        ratio = row.fps / slowest[1] if row.fps and slowest else None
        speedup = row.fps / row.naive_fps if row.fps and row.naive_fps else None
        lines.append("| " + " | ".join([
            row.decode, str(row.cameras), procs(row.decode, row.workers), str(row.batch),
            num(row.fps), num(row.p50_ms, 1),
            num(row.p99_ms, 1), num(row.gpu_util), num(row.decode_fps), num(row.infer_fps),
            slowest[0] if slowest else "", num(ratio, 2), num(speedup, 1),
            busiest_cell(row.stages),
            num(None if row.slot_wait_share is None else 100 * row.slot_wait_share),
            stage_text(row.stages), num(row.build_s, 1), "; ".join(row.notes)]) + " |")
    return "\n".join(lines) + "\n"


def procs(decode: str, workers: int) -> str:
    """The decode procs cell: worker processes, or where the decoding ran instead."""
    if decode == "gpu":
        return "NVDEC, in-process"
    if decode.startswith("naive"):
        return ""
    return str(workers) if workers else "threads"


def stage_text(stages: list[StageLine]) -> str:
    return "; ".join(f"{s.name} {s.work_ms_per_frame:.2f} ms/f, {s.blocked_s:.1f} s blocked"
                     for s in stages)


def paced_markdown(rows: list[PacedRow], header: str, verdict: bool = False) -> str:
    """The paced table (and, with ``verdict``, the line naming the largest camera count that
    kept up)."""
    lines = [header, "",
             "| decode | cameras | decode procs | offered fps | delivered fps | delivered / "
             "offered | dropped | p50 ms | p99 ms | GPU util % | offered / decode alone | "
             "offered / infer alone | x naive | kept up | busiest thread (work % of its time) "
             "| stages: work ms per frame, blocked s | build s | notes |",
             "|" + "---|" * 18]
    for row in rows:
        measured = row.delivered_fps is not None
        lines.append("| " + " | ".join([
            row.decode, str(row.cameras), procs(row.decode, row.workers), num(row.offered_fps),
            num(row.delivered_fps), num(row.delivered_fps / row.offered_fps if measured else None,
                                        2),
            "" if row.dropped is None else f"{row.dropped:,}", num(row.p50_ms, 1),
            num(row.p99_ms, 1), num(row.gpu_util),
            num(row.offered_fps / row.decode_fps if row.decode_fps else None, 2),
            num(row.offered_fps / row.infer_fps if row.infer_fps else None, 2),
            num(row.delivered_fps / row.naive_fps if measured and row.naive_fps else None, 1),
            ("yes" if row.kept_up else "no") if measured else "",
            busiest_cell(row.stages),
            stage_text(row.stages), num(row.build_s, 1), "; ".join(row.notes)]) + " |")
    text = "\n".join(lines) + "\n"
    if verdict:
        text += "\n" + paced_verdict(rows) + "\n"
    return text


def paced_verdict(rows: list[PacedRow]) -> str:
    """The line the paced runs are for (one per decode mode)."""
    lines = []
    for mode in dict.fromkeys(row.decode for row in rows) or [""]:
        ours = [row for row in rows if row.decode == mode]
        kept = [row.cameras for row in ours if row.kept_up]
        best = f"{max(kept)}" if kept else "none of those tried"
        tried = ",".join(f"{row.cameras}" + ("" if row.delivered_fps is not None else
                                             " (not measured)") for row in ours)
        pace = f"{ours[0].pace_fps:g} fps, {mode} decode, " if ours else ""
        lines.append(f"largest camera count with zero drops and p99 <= {P99_LIMIT_MS:g} ms: "
                     f"{best} ({pace}tried {tried or 'none'}; each also delivering >= "
                     f"{100 * DELIVERED_SHARE:g}% of the offered frames/s)")
    return "\n".join(lines)


def inference_markdown(rows: list[InferenceRow], header: str) -> str:
    """The inference-alone table."""
    lines = [header, "", "| batch | backend | images/s | warm-up s | notes |", "|" + "---|" * 5]
    for row in rows:
        lines.append("| " + " | ".join([str(row.batch), row.backend, num(row.images_s),
                                        num(row.warmup_s, 1), "; ".join(row.notes)]) + " |")
    return "\n".join(lines) + "\n"


def make_setup(args: argparse.Namespace, tmp: Path) -> tuple[Setup, str]:
    """The clip, model and backend of the mode asked for, fetched or built when missing."""
    assets = Path(args.assets)
    samples = SamplePaths.under(assets)
    if not (samples.bikes.exists() and samples.model.exists() and samples.names.exists()):
        samples = ensure_samples(assets, log=print)
    cache = tmp / "engines" if args.fresh_cache else Path(args.engine_cache)
    mode = "small" if args.small else "full"
    if args.small:
        seconds = args.seconds or 2.0
        clip = looped_clip(samples.bikes, seconds, CAMERA_FPS_CAP[mode], tmp)
        setup = Setup(clip, samples.model, samples.names, "cpu", "onnxruntime", seconds,
                      args.batch or 4, args.compile, cache,
                      pace_fps=args.pace_fps or 5.0, paced_warmup_s=args.paced_warmup_s or 1.0)
        what = "yolov3-tiny 416, onnxruntime on the CPU, bikes.mp4 640x272"
    else:
        from samples.yolov8 import ensure_yolov8

        model, names = ensure_yolov8(assets, log=print)
        seconds = args.seconds or 10.0
        big = make_1080p_clip(samples.bikes, assets / "cache" / CLIP_NAME,
                              bitrate=CLIP_BITRATE)
        clip = looped_clip(big, seconds, CAMERA_FPS_CAP[mode], assets / "cache")
        setup = Setup(clip, model, names, "cuda", "torch", seconds, args.batch or 64,
                      args.compile, cache, TARGET_BATCH, pace_fps=args.pace_fps or 30.0,
                      paced_warmup_s=args.paced_warmup_s or 2.0)
        what = (f"YOLOv8s 640, torch FP16 {'compiled' if args.compile else 'eager'} on the GPU, "
                "bikes.mp4 upscaled to 1080p H.264 4 Mbps")
    setup.decode_workers = args.decode_workers
    setup.gil_profile_dir = args.gil_profile
    if args.budget_s:  # counted from the start: making the clip is inside the budget
        setup.deadline = args.started + args.budget_s
    cache_note = "a fresh compile cache" if args.fresh_cache else f"compile cache {cache}"
    cores = os.cpu_count() or 1
    workers = (f"auto (one per source, at most {max(1, cores - 2)} on these {cores} cores)"
               if args.decode_workers is None else
               "0 (threads of the pipeline process)" if args.decode_workers == 0 else
               f"{args.decode_workers} (at most one per source)")
    return setup, (f"Throughput, {what}; {setup.seconds:g} s per measurement; each camera reads "
                   f"{clip.name} ({clip_frames(clip):,} frames, the clip repeated), {cache_note}; "
                   f"decode workers of the cpu mode: {workers}.")


def emit_table(table: str, out: Path | None) -> None:
    """Print a benchmark's tables, and write them to ``out`` (--out) when given."""
    print(table)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table)


def workers_arg(text: str) -> int | None:
    """--decode-workers: 'auto' (None) or a count >= 0."""
    if text == "auto":
        return None
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected auto or a number >= 0, got {text}")
    return value


def counts_arg(parser: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    """A comma-separated list of camera counts ('none' or '' for none)."""
    if text.strip().lower() in ("", "none"):
        return []
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        parser.error(f"{flag}: expected comma-separated camera counts, got {text}")
    if min(counts) < 1:
        parser.error(f"{flag}: camera counts must be >= 1, got {text}")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.throughput",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true",
                        help="CPU-only mode for CI: YOLOv3-tiny on onnxruntime, small clip")
    parser.add_argument("--cameras", default=None,
                        help="comma-separated camera counts of the unpaced table (default "
                             "1,8,32,64,100; small: 1,2); 'none' for no unpaced rows")
    parser.add_argument("--seconds", type=float, default=None,
                        help="length of each measurement (default 10; small: 2)")
    parser.add_argument("--batch", type=int, default=None,
                        help="largest batch of every row (default 64; small: 4)")
    parser.add_argument("--decode", default=None,
                        help="comma-separated decode modes of the unpaced table: cpu (worker "
                             "processes), cpu-threads (decode_workers 0), gpu (NVDEC) (default "
                             "cpu,gpu; small: cpu)")
    parser.add_argument("--decode-workers", type=workers_arg, default=None,
                        help="runtime.decode_workers of the cpu mode: auto (default: one per "
                             "source, at most cores - 2) or a number (0: threads)")
    parser.add_argument("--paced", default=None,
                        help="comma-separated camera counts of the paced runs, each camera "
                             "live at --pace-fps (default 32,64,100,128; small: 2); 'none' "
                             "for no paced runs")
    parser.add_argument("--pace-fps", type=float, default=None,
                        help="frames/s of each paced camera (default 30; small: 5)")
    parser.add_argument("--paced-warmup-s", type=float, default=None,
                        help="paced runs: seconds from the first result to the window "
                             "(default 2; small: 1)")
    parser.add_argument("--paced-decode", default="cpu",
                        help="comma-separated decode modes of the paced runs (default cpu)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="torch backend: compiled (default) or eager (--no-compile)")
    parser.add_argument("--engine-cache", default="assets/engines",
                        help="persistent folder for compile artefacts (default assets/engines)")
    parser.add_argument("--fresh-cache", action="store_true",
                        help="compile into the run's temporary folder instead (cold starts)")
    parser.add_argument("--no-naive", dest="naive", action="store_false",
                        help="leave out the naive sequential pipeline")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no measurement that would not end within this many seconds")
    parser.add_argument("--assets", default="assets", help="assets folder (models, clips)")
    parser.add_argument("--gil-profile", type=Path, default=None, metavar="DIR",
                        help="sample which threads hold the interpreter lock in every window "
                             "with py-spy (raw stacks in DIR, a summary under the tables)")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables here (md)")
    started = time.monotonic()
    args = parser.parse_args(argv)
    args.started = started
    cameras = counts_arg(parser, "--cameras", args.cameras or ("1,2" if args.small
                                                               else "1,8,32,64,100"))
    paced = counts_arg(parser, "--paced", args.paced or ("2" if args.small else "32,64,100,128"))
    decode = (args.decode or ("cpu" if args.small else "cpu,gpu")).split(",")
    paced_decode = args.paced_decode.split(",")
    for flag, modes in (("--decode", decode), ("--paced-decode", paced_decode)):
        if not set(modes) <= set(DECODE_MODES):
            parser.error(f"{flag}: expected some of {', '.join(DECODE_MODES)}, got "
                         f"{','.join(modes)}")
    from pipeline.logging import configure_logging

    configure_logging(level="warning")
    with tempfile.TemporaryDirectory() as tmp:
        setup, header = make_setup(args, Path(tmp))
        if setup.device == "cuda":
            try:
                import cupy

                name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
                header += f" GPU: {name}."
            except Exception as error:  # noqa: BLE001 - the rows will say what fails
                header += f" GPU: not usable ({type(error).__name__})."
        results = run_benchmark(setup, cameras, decode, args.naive, paced, paced_decode)
    target = (f" Target: >= {TARGET_IMAGES_S:,} images/s at batch {setup.target_batch}."
              if setup.target_batch else "")
    table = markdown(results.rows, header + " Unpaced: each camera as fast as it is taken.")
    table += gil_lines(results.rows, "unpaced")
    if paced:
        table += "\n" + paced_markdown(
            results.paced, f"Paced: every camera live at {setup.pace_fps:g} frames/s in real "
            f"time (live: true, reconnect: false), {setup.paced_warmup_s:g} s warm-up from the "
            f"first result, then a {setup.seconds:g} s window: delivered fps, drops, latency "
            "and GPU utilisation inside it; stages over the whole run. Decode alone and infer "
            "alone: the unpaced measurements at the same camera count and batch.", verdict=True)
        table += gil_lines(results.paced, "paced")
    table += "\n" + inference_markdown(
        results.inference, "Inference alone (backend.infer on one preallocated batch, built as "
        f"the pipeline builds it; warm-up = its warmup(), compilation included).{target}")
    emit_table(table, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
