"""Throughput at scale: N synthetic cameras through the real pipeline, each stage alone, and a
naive sequential pipeline, in one run and one table.

    python -m benchmarks.throughput [--small] [--cameras 1,8,32,64] [--seconds 10]
        [--decode cpu,gpu] [--compile | --no-compile] [--engine-cache DIR | --fresh-cache]
        [--budget-s S] [--out t.md]

Full mode (a GPU): every camera reads a long 1080p H.264 file: bikes.mp4 (natural footage)
upscaled to 1080p at 4 Mbps, like a camera, then repeated end to end by a stream copy (no
re-encode) often enough that no camera runs out within a measurement. The cameras are plain
file sources built by the public ``pipeline.build.build_graph``; nothing inside a built graph
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
- for each N and each decode mode (cpu; gpu where a GPU decoder is usable):
  - the pipeline: frames/s at steady state (completions, counted per batch part through
    ``on_batch_done``, after the first 10% and before the window's end: the queues
    draining after it are left out), capture-to-sink latency p50/p99
    (``graph.source_metrics``), the mean GPU utilisation over that window (NVML, else
    ``nvidia-smi``), the seconds ``build_graph`` took, and every stage's work ms/frame and
    blocked seconds (``graph.stage_metrics``; the sinks summed), with the busiest thread (its
    work time over its active time): a thread near 100% work is the bottleneck; a stage
    mostly blocked waits on the next one (postprocess on the GPU path: blocked = waiting for
    the GPU's results or for room at the sinks). "Slot wait" is the share of the sources'
    time spent waiting for a free frame slot (``graph.ring.waited_s``; their waits for room
    in the first queue are not in it); with every stage far from 100% work and the pipeline
    near decode alone, decode is the bottleneck;
  - decode alone: N sources of the same kind decoded in N threads into a slot ring, each
    slot given back at once;
  - pipeline / slowest stage alone: 1.0 means the pipeline is as fast as its bottleneck allows;
- a naive pipeline, last: one thread decodes a frame, uploads it, preprocesses, infers at
  batch 1, runs NMS and copies the detections back before it touches the next frame (no
  overlap, no batching); each row's "x naive" is its speed-up over that.

``--small`` runs the same on a machine without a GPU (what CI runs): bikes.mp4 (640x272)
repeated, the YOLOv3-tiny sample on onnxruntime, a couple of cameras, a few seconds, inference
alone only at the pipeline's batch. A measurement that fails writes its error into its row
instead of ending the run; with ``--budget-s`` a measurement that would not fit in the time
left is skipped (and says so), so the table is always printed.
"""

from __future__ import annotations

import argparse
import gc
import math
import shutil
import statistics
import subprocess
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
OVERHEAD_S = {"pipeline": 45.0, "decode": 10.0, "inference": 60.0, "naive": 45.0}


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

    def fits(self, what: str) -> bool:
        """True when a measurement of kind ``what`` can still finish before the deadline."""
        return self.deadline is None or (
            time.monotonic() + self.seconds + OVERHEAD_S[what] <= self.deadline)


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


@dataclass
class Row:
    """One line of the table; None where not measured, errors in ``notes``."""

    decode: str
    cameras: int
    batch: int
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
    notes: list[str] = field(default_factory=list)

    @property
    def slowest(self) -> tuple[str, float] | None:
        stages = [(n, v) for n, v in (("decode", self.decode_fps), ("infer", self.infer_fps)) if v]
        return min(stages, key=lambda s: s[1]) if stages else None

    @property
    def busiest(self) -> StageLine | None:
        return max(self.stages, key=lambda s: s.work_share) if self.stages else None


@dataclass
class InferenceRow:
    """Inference alone at one batch size."""

    batch: int
    images_s: float | None = None
    warmup_s: float | None = None
    backend: str = ""
    notes: list[str] = field(default_factory=list)


class UtilisationSampler:
    """GPU utilisation (%) every ``interval_s`` in a thread: NVML, else ``nvidia-smi``."""

    def __init__(self, enabled: bool, interval_s: float = 0.2) -> None:
        self.samples: list[tuple[float, float]] = []
        self.interval_s = interval_s
        self._read = self._reader() if enabled else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _reader() -> Callable[[], float] | None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except Exception:  # noqa: BLE001 - not installed or no driver: try the CLI
            if shutil.which("nvidia-smi") is None:
                return None
            command = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                       "-i", "0"]
            return lambda: float(subprocess.run(command, capture_output=True, text=True,
                                                timeout=5).stdout.split()[0])

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.samples.append((time.perf_counter(), self._read()))
            except Exception:  # noqa: BLE001 - one failed read leaves a gap, no more
                pass

    def __enter__(self) -> UtilisationSampler:
        if self._read is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def mean(self, start: float, end: float) -> float | None:
        inside = [value for t, value in self.samples if start <= t <= end]
        return statistics.fmean(inside) if inside else None


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


def clip_frames(clip: Path) -> int:
    """Frames of a file's first video stream (counted by demuxing when the header has none)."""
    with av.open(str(clip)) as container:
        stream = container.streams.video[0]
        if stream.frames:
            return int(stream.frames)
        return sum(1 for packet in container.demux(stream) if packet.size)


def make_looped_clip(source: Path, target: Path, repeats: int) -> Path:
    """``source``'s video repeated ``repeats`` times end to end, by a stream copy (no
    re-encode; timestamps shifted per copy so they keep rising); once, cached at ``target``."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.stem + ".partial" + target.suffix)
    with av.open(str(partial), "w") as out:
        ostream = None
        offset = 0  # in the source stream's time base
        for _ in range(repeats):
            with av.open(str(source)) as inp:
                istream = inp.streams.video[0]
                if ostream is None:
                    ostream = out.add_stream_from_template(istream)
                end = offset
                for packet in inp.demux(istream):
                    if packet.dts is None or not packet.size:  # the demuxer's flush packet
                        continue
                    pts = packet.pts if packet.pts is not None else packet.dts
                    end = max(end, offset + pts + (packet.duration or 0))
                    packet.pts, packet.dts = offset + pts, offset + packet.dts
                    packet.stream = ostream
                    out.mux(packet)
                offset = end
    partial.replace(target)
    return target


def looped_clip(clip: Path, seconds: float, fps_cap: int, cache: Path) -> Path:
    """A copy of ``clip`` repeated often enough for one camera at ``fps_cap`` frames/s to
    read for ``seconds`` plus start-up."""
    repeats = max(1, math.ceil(fps_cap * (seconds + 2) / clip_frames(clip)))
    return make_looped_clip(clip, cache / f"{clip.stem}_x{repeats}.mp4", repeats)


def pipeline_config(setup: Setup, cameras: int, decode: str, batch: int, out: Path
                    ) -> PipelineConfig:
    sources = [{"name": f"cam{i:02d}", "uri": str(setup.clip), "decode": decode}
               for i in range(cameras)]
    return parse_config({
        "sources": sources,
        "model": {"path": str(setup.model),
                  "class_names": str(setup.names) if setup.names else None},
        "inference": {"device": setup.device, "backend": setup.backend, "precision": "fp16",
                      "batch_size": batch, "batch_timeout_ms": 5.0, "compile": setup.compile,
                      "engine_cache": str(setup.engine_cache)},
        "output": {"dir": str(out), "video": None, "jsonl": "{source}.jsonl"},
        "runtime": {"progress": False, "log_level": "warning"},
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
    from pipeline.build import build_graph

    config = pipeline_config(setup, row.cameras, row.decode, row.batch, out)
    times: list[float] = []
    counts: list[int] = []
    lock = threading.Lock()
    timer: threading.Timer | None = None
    window_ended = threading.Event()
    window_end = [math.inf]
    graph: Any = None

    def end_window() -> None:
        window_end[0] = time.perf_counter()
        window_ended.set()
        graph.request_stop()

    def batch_done(source: str, part: BatchDetections) -> None:
        nonlocal timer
        now = time.perf_counter()
        with lock:  # sinks call this from their own threads
            if timer is None:  # the window starts with the first result, after start-up
                timer = threading.Timer(setup.seconds, end_window)
                timer.daemon = True
                timer.start()
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
    if graph.ring is not None and row.stages and row.decode == "cpu":  # GPU frames take none
        active = max(line.active_s for line in row.stages)
        if active > 0:
            row.slot_wait_share = graph.ring.waited_s / (row.cameras * active)


def make_source(setup: Setup, decode: str, index: int, ring: SlotRing | None = None,
                abort: threading.Event | None = None) -> SourceStage:
    source = SourceConfig(name=f"cam{index:02d}", uri=str(setup.clip))
    if decode == "gpu":
        from stages.gpu_decode import GpuDecodeStage

        return GpuDecodeStage(source, 0, ring)
    from stages.decode import DecodeStage

    return DecodeStage(source, ring, abort)


def measure_decode(setup: Setup, decode: str, cameras: int) -> float:
    """Frames/s of ``cameras`` sources decoded in as many threads into a slot ring (as in the
    pipeline), each slot given back as soon as its frame arrives; nothing else."""
    stop = threading.Event()
    width, height = probe_size(setup.clip)
    ring = SlotRing(4 * cameras, i420_bytes(width, height))
    done: list[float] = []
    failures: list[str] = []

    def read(source: SourceStage) -> None:
        for item in source.frames(stop):
            if isinstance(item, Frame):
                ring.release([item.slot])
                done.append(time.perf_counter())  # list.append is atomic: no lock needed
            elif item.error:
                failures.append(item.error)

    threads = [threading.Thread(target=read, args=(make_source(setup, decode, i, ring, stop),),
                                daemon=True) for i in range(cameras)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + setup.seconds + 30  # + start-up (opening, first frames)
    while time.monotonic() < deadline and not failures and any(t.is_alive() for t in threads):
        if done and time.perf_counter() - done[0] >= setup.seconds:
            break
        time.sleep(0.05)
    stop.set()
    for thread in threads:
        thread.join(30)
    if failures:
        raise RuntimeError(failures[0])
    return steady_rate(done)[0]


def probe_size(clip: Path) -> tuple[int, int]:
    with av.open(str(clip)) as container:
        stream = container.streams.video[0]
        return max(stream.width, 2) & ~1, max(stream.height, 2) & ~1


def measure_inference(setup: Setup, row: InferenceRow) -> None:
    """Images/s of ``backend.infer`` on one preallocated batch of random images, the backend
    built as the pipeline builds it; also how long its ``warmup()`` took."""
    from pipeline.build import create_gpu_context
    from stages.backends.base import read_model_info
    from stages.infer import create_backend

    batch = row.batch
    config = pipeline_config(setup, 1, "cpu", batch, Path("."))
    info = read_model_info(setup.model)
    gpu = create_gpu_context(config)
    backend = create_backend(config.inference, setup.model, info, gpu)
    row.backend = backend.name
    try:
        started = time.perf_counter()
        backend.warmup()
        row.warmup_s = time.perf_counter() - started
        shape = (batch, 3, info.input_height, info.input_width)
        if gpu is None:
            images = np.random.default_rng(0).random(shape, np.float32)
            started, runs = time.perf_counter(), 0
            while runs < 3 or time.perf_counter() - started < setup.seconds / 2:
                backend.infer(images)
                runs += 1
            row.images_s = batch * runs / (time.perf_counter() - started)
            return
        import cupy

        stream = gpu.compute_stream
        images = backend.input_buffer(batch) if hasattr(backend, "input_buffer") else cupy.empty(
            shape, getattr(backend, "input_dtype", info.input_dtype))
        with stream:
            images[...] = cupy.random.random(shape, np.float32).astype(images.dtype)
        backend.infer(images, stream)
        stream.synchronize()
        probe = time.perf_counter()
        backend.infer(images, stream)
        stream.synchronize()
        runs = max(10, int(setup.seconds / 2 / max(time.perf_counter() - probe, 1e-4)))
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(runs):
            backend.infer(images, stream)
        end.record(stream)
        end.synchronize()
        row.images_s = batch * runs / (cupy.cuda.get_elapsed_time(start, end) / 1000)
    finally:
        backend.close()


def measure_naive(setup: Setup, row: Row) -> None:
    """One thread, one frame at a time: decode, upload, preprocess, infer, NMS, D2H."""
    from kernels.preprocess import letterbox_geometry
    from pipeline.build import create_gpu_context
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


def attempt(setup: Setup, row: Row | InferenceRow, what: str, measure: Callable[[], Any]) -> Any:
    """Run one measurement unless the time budget is spent; a failure is noted in the row
    (traceback on stderr), not raised."""
    if not setup.fits(what):
        row.notes.append(f"{what} skipped: time budget spent")
        return None
    try:
        return measure()
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
        if mode == "cpu":
            modes.append(("cpu", None))
        elif setup.device == "cuda":
            from stages.gpu_decode import gpu_decode_unavailable_reason

            modes.append(("gpu", gpu_decode_unavailable_reason()))
    return modes


def row_batch(setup: Setup, cameras: int) -> int:
    """Every row runs the same largest batch: smaller batches run their own captured graph
    (no padding), and one compiled model (one cache entry) serves every row."""
    return setup.batch_cap


def run_benchmark(setup: Setup, cameras: list[int], decode: list[str], naive: bool = True
                  ) -> tuple[list[Row], list[InferenceRow]]:
    """Every row of the tables (see the module docstring), each printed to stderr when done."""
    batches = sorted({row_batch(setup, n) for n in cameras}
                     | ({setup.target_batch} if setup.target_batch else set()))
    inference = [InferenceRow(batch) for batch in batches]
    for irow in inference:  # first: they also fill the compile cache the pipelines start from
        attempt(setup, irow, "inference", lambda r=irow: measure_inference(setup, r))
        print(inference_markdown([irow], f"measured inference alone, batch {irow.batch}:"),
              file=sys.stderr, flush=True)
    infer_fps = {r.batch: r.images_s for r in inference}
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode, unavailable in decode_modes(setup, decode):
            for count in cameras:
                row = Row(mode, count, row_batch(setup, count))
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
    if naive:
        sequential = Row("naive sequential", 1, 1)
        attempt(setup, sequential, "naive", lambda: measure_naive(setup, sequential))
        for row in rows:
            row.naive_fps = sequential.fps
        rows.append(sequential)
    return rows, inference


def num(value: float | None, digits: int = 0) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def markdown(rows: list[Row], header: str) -> str:
    """The pipeline table, with a line of context above it."""
    lines = [header, "",
             "| decode | cameras | batch | pipeline fps | p50 ms | p99 ms | GPU util % | decode "
             "alone fps | infer alone fps | slowest alone | pipeline / slowest | x naive | "
             "busiest thread (work % of its time) | sources' slot wait % | stages: work ms per "
             "frame, blocked s | build s | notes |",
             "|" + "---|" * 17]
    for row in rows:
        slowest = row.slowest
        ratio = row.fps / slowest[1] if row.fps and slowest else None
        speedup = row.fps / row.naive_fps if row.fps and row.naive_fps else None
        busiest = row.busiest
        lines.append("| " + " | ".join([
            row.decode, str(row.cameras), str(row.batch), num(row.fps), num(row.p50_ms, 1),
            num(row.p99_ms, 1), num(row.gpu_util), num(row.decode_fps), num(row.infer_fps),
            slowest[0] if slowest else "", num(ratio, 2), num(speedup, 1),
            f"{busiest.name} {100 * busiest.work_share:.0f}%" if busiest else "",
            num(None if row.slot_wait_share is None else 100 * row.slot_wait_share),
            "; ".join(f"{s.name} {s.work_ms_per_frame:.2f} ms/f, {s.blocked_s:.1f} s blocked"
                      for s in row.stages),
            num(row.build_s, 1), "; ".join(row.notes)]) + " |")
    return "\n".join(lines) + "\n"


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
                      args.batch or 4, args.compile, cache)
        what = "yolov3-tiny 416, onnxruntime on the CPU, bikes.mp4 640x272"
    else:
        from samples.yolov8 import ensure_yolov8

        model, names = ensure_yolov8(assets, log=print)
        seconds = args.seconds or 10.0
        big = make_1080p_clip(samples.bikes, assets / "cache" / CLIP_NAME,
                              bitrate=CLIP_BITRATE)
        clip = looped_clip(big, seconds, CAMERA_FPS_CAP[mode], assets / "cache")
        setup = Setup(clip, model, names, "cuda", "torch", seconds, args.batch or 64,
                      args.compile, cache, TARGET_BATCH)
        what = (f"YOLOv8s 640, torch FP16 {'compiled' if args.compile else 'eager'} on the GPU, "
                "bikes.mp4 upscaled to 1080p H.264 4 Mbps")
    if args.budget_s:
        setup.deadline = time.monotonic() + args.budget_s
    cache_note = "a fresh compile cache" if args.fresh_cache else f"compile cache {cache}"
    return setup, (f"Throughput, {what}; {setup.seconds:g} s per measurement; each camera reads "
                   f"{clip.name} ({clip_frames(clip):,} frames, the clip repeated), {cache_note}.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.throughput",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true",
                        help="CPU-only mode for CI: YOLOv3-tiny on onnxruntime, small clip")
    parser.add_argument("--cameras", default=None,
                        help="comma-separated camera counts (default 1,8,32,64; small: 1,2)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="length of each measurement (default 10; small: 2)")
    parser.add_argument("--batch", type=int, default=None,
                        help="largest batch of every row (default 64; small: 4)")
    parser.add_argument("--decode", default=None,
                        help="comma-separated decode modes, cpu and/or gpu (default cpu,gpu; "
                             "small: cpu)")
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
    parser.add_argument("--out", type=Path, default=None, help="also write the tables here (md)")
    args = parser.parse_args(argv)
    cameras = [int(n) for n in (args.cameras or ("1,2" if args.small else "1,8,32,64")).split(",")]
    decode = (args.decode or ("cpu" if args.small else "cpu,gpu")).split(",")
    if not set(decode) <= {"cpu", "gpu"}:
        parser.error(f"--decode: expected cpu and/or gpu, got {args.decode}")
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
        rows, inference = run_benchmark(setup, cameras, decode, args.naive)
    target = (f" Target: >= {TARGET_IMAGES_S:,} images/s at batch {setup.target_batch}."
              if setup.target_batch else "")
    table = (markdown(rows, header) + "\n"
             + inference_markdown(inference, "Inference alone (backend.infer on one "
                                  "preallocated batch, built as the pipeline builds it; warm-up "
                                  f"= its warmup(), compilation included).{target}"))
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
