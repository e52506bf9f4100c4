"""Throughput at scale: N synthetic cameras through the real pipeline, each stage alone, and a
naive sequential pipeline, in one run and one table.

    python -m benchmarks.throughput [--small] [--cameras 1,8,32,64] [--seconds 10] [--out t.md]

Full mode (a GPU): every camera reads a 1080p H.264 clip made from bikes.mp4 (natural footage
at 4 Mbps, like a camera) in a loop, as fast as the pipeline takes it; the model is the real
YOLOv8s export (``samples.yolov8``, dynamic batch) at 640, torch backend, FP16, JSONL sink
only. For each N and each decode mode (cpu; gpu where a GPU decoder is usable) it measures:

- the pipeline (``pipeline.build.build_graph``): frames/s at steady state (completions after
  the first 10%), capture-to-sink latency p50/p99 (``graph.source_metrics``), and the mean GPU
  utilisation over that window (NVML, else ``nvidia-smi``: the share of time a kernel ran);
- decode alone: N sources of the same kind decoded in N threads, frames dropped at once;
- inference alone: ``backend.infer`` on one preallocated random batch, CUDA-event timed;
- pipeline / slowest stage: 1.0 means the pipeline is as fast as its bottleneck allows;
- against a naive pipeline measured in the same run: one thread decodes a frame, converts it,
  uploads it, preprocesses, infers at batch 1, runs NMS and copies the detections back before
  it touches the next frame (no overlap, no batching).

``--small`` runs the same on a machine without a GPU (what CI runs): bikes.mp4 as it is, the
YOLOv3-tiny sample on onnxruntime, a couple of cameras, a few seconds. A measurement that
fails writes its error into its row instead of ending the run.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.overlap_benchmark import make_1080p_clip
from pipeline.config import PipelineConfig, SourceConfig, parse_config
from pipeline.records import EndOfStream, Frame
from pipeline.stage import SourceStage
from samples.fetch import SamplePaths, ensure_samples

WARMUP_SHARE = 0.1  # the first 10% of a window's completions are start-up, not steady state
CLIP_BITRATE = 4_000_000


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
    notes: list[str] = field(default_factory=list)

    @property
    def slowest(self) -> tuple[str, float] | None:
        stages = [(n, v) for n, v in (("decode", self.decode_fps), ("infer", self.infer_fps)) if v]
        return min(stages, key=lambda s: s[1]) if stages else None


class LoopingSource(SourceStage):
    """A synthetic camera: its source's clip read again and again until the run stops
    (the frame index keeps counting); a failure of the source ends it with its error."""

    def __init__(self, inner: SourceStage) -> None:
        super().__init__(inner.name)
        self.inner = inner

    def frames(self, stop_reading: threading.Event) -> Iterator[Frame | EndOfStream]:
        index = 0
        while not stop_reading.is_set():
            first = index
            for item in self.inner.frames(stop_reading):
                if isinstance(item, EndOfStream):
                    if item.error:
                        yield EndOfStream(self.name, index, item.error)
                        return
                    break
                item.index, index = index, index + 1
                yield item
            if index == first:
                break  # an empty clip would loop forever
        yield EndOfStream(self.name, index)

    def close(self) -> None:
        self.inner.close()


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


def steady_rate(times: list[float]) -> tuple[float, float, float]:
    """(items/s, start, end) over sorted completion ``times``, the first 10% left out."""
    times = sorted(times)
    first = int(len(times) * WARMUP_SHARE)
    if len(times) - first < 2 or times[-1] <= times[first]:
        raise RuntimeError(f"too few completions to measure ({len(times)})")
    return (len(times) - 1 - first) / (times[-1] - times[first]), times[first], times[-1]


def pipeline_config(setup: Setup, cameras: int, decode: str, batch: int, out: Path
                    ) -> PipelineConfig:
    sources = [{"name": f"cam{i:02d}", "uri": str(setup.clip), "decode": decode}
               for i in range(cameras)]
    return parse_config({
        "sources": sources,
        "model": {"path": str(setup.model),
                  "class_names": str(setup.names) if setup.names else None},
        "inference": {"device": setup.device, "backend": setup.backend, "precision": "fp16",
                      "batch_size": batch, "batch_timeout_ms": 5.0},
        "output": {"dir": str(out), "video": None, "jsonl": "{source}.jsonl"},
        "runtime": {"progress": False, "log_level": "warning"},
    })


def measure_pipeline(setup: Setup, row: Row, out: Path) -> None:
    from pipeline.build import build_graph

    config = pipeline_config(setup, row.cameras, row.decode, row.batch, out)
    done: list[float] = []
    graph: Any = None

    def frame_done(frame: Frame) -> None:
        if not done:  # the window starts with the first result, after every start-up cost
            timer = threading.Timer(setup.seconds, graph.request_stop)
            timer.daemon = True
            timer.start()
        done.append(time.perf_counter())

    graph = build_graph(config, on_frame_done=frame_done)
    graph.sources = [LoopingSource(source) for source in graph.sources]
    with UtilisationSampler(setup.device == "cuda") as sampler:
        graph.run()
    errors = {m.error for m in graph.source_metrics.values() if m.error}
    if errors:
        raise RuntimeError("; ".join(sorted(errors)))
    row.fps, start, end = steady_rate(done)
    latencies = sorted(s for m in graph.source_metrics.values() for s in m.latency_s)
    row.p50_ms, row.p99_ms = (1000 * float(np.percentile(latencies, q)) for q in (50, 99))
    row.gpu_util = sampler.mean(start, end)
    # Host time inside each stage's hooks per frame (GIL waits included): the bottleneck hint.
    busiest = sorted(((m.busy_s / m.frames, name) for name, m in graph.stage_metrics.items()
                      if m.frames), reverse=True)[:3]
    row.notes.append("busiest threads (ms/frame): "
                     + ", ".join(f"{name} {1000 * busy:.2f}" for busy, name in busiest))


def make_source(setup: Setup, decode: str, index: int) -> SourceStage:
    source = SourceConfig(name=f"cam{index:02d}", uri=str(setup.clip))
    if decode == "gpu":
        from stages.gpu_decode import GpuDecodeStage

        return GpuDecodeStage(source)
    from stages.decode import DecodeStage

    return DecodeStage(source)


def measure_decode(setup: Setup, decode: str, cameras: int) -> float:
    """Frames/s of ``cameras`` sources decoded in as many threads, nothing else."""
    stop = threading.Event()
    done: list[float] = []
    failures: list[str] = []

    def read(source: SourceStage) -> None:
        for item in source.frames(stop):
            if isinstance(item, Frame):
                done.append(time.perf_counter())  # list.append is atomic: no lock needed
            elif item.error:
                failures.append(item.error)

    threads = [threading.Thread(target=read, args=(LoopingSource(make_source(setup, decode, i)),),
                                daemon=True) for i in range(cameras)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + setup.seconds + 30  # + start-up (opening, first frames)
    while time.monotonic() < deadline and not failures:
        if done and time.perf_counter() - done[0] >= setup.seconds:
            break
        time.sleep(0.05)
    stop.set()
    for thread in threads:
        thread.join(30)
    if failures:
        raise RuntimeError(failures[0])
    return steady_rate(done)[0]


def measure_inference(setup: Setup, batch: int) -> float:
    """Images/s of ``backend.infer`` on one preallocated batch of random images."""
    from pipeline.build import create_gpu_context
    from stages.backends.base import read_model_info
    from stages.infer import create_backend

    config = pipeline_config(setup, 1, "cpu", batch, Path("."))
    info = read_model_info(setup.model)
    gpu = create_gpu_context(config)
    backend = create_backend(config.inference, setup.model, info, gpu)
    try:
        backend.warmup()
        shape = (batch, 3, info.input_height, info.input_width)
        if gpu is None:
            images = np.random.default_rng(0).random(shape, np.float32)
            started, runs = time.perf_counter(), 0
            while runs < 3 or time.perf_counter() - started < setup.seconds / 2:
                backend.infer(images)
                runs += 1
            return batch * runs / (time.perf_counter() - started)
        import cupy

        stream = gpu.compute_stream
        images = backend.input_buffer(batch) if hasattr(backend, "input_buffer") else cupy.empty(
            shape, backend.input_dtype)
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
        return batch * runs / (cupy.cuda.get_elapsed_time(start, end) / 1000)
    finally:
        backend.close()


def measure_naive(setup: Setup, row: Row) -> None:
    """One thread, one frame at a time: decode, convert, upload, preprocess, infer, NMS, D2H."""
    from kernels.preprocess import letterbox_geometry
    from pipeline.build import create_gpu_context
    from stages.backends.base import read_model_info
    from stages.infer import create_backend

    config = pipeline_config(setup, 1, "cpu", 1, Path("."))
    info, nms = read_model_info(setup.model), config.nms
    gpu = create_gpu_context(config)
    backend = create_backend(config.inference, setup.model, info, gpu)
    warm = backend.warmup()
    process = naive_cpu_step(backend, nms) if gpu is None else naive_gpu_step(
        backend, nms, gpu, warm)
    stop = threading.Event()
    done: list[float] = []
    latencies: list[float] = []
    letterboxes: dict[tuple[int, int], Any] = {}
    try:
        for item in LoopingSource(make_source(setup, "cpu", 0)).frames(stop):
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


def naive_gpu_step(backend: Any, nms: Any, gpu: Any, warm: Any) -> Callable[[Frame, Any], Any]:
    import cupy

    from kernels.nms_cuda import CudaNms, stream_from_cupy, to_host
    from kernels.preprocess_cuda import launch_preprocess_frame, warmup_preprocess

    stream, nstream = gpu.compute_stream, stream_from_cupy(gpu.compute_stream)
    images = backend.input_buffer(1)
    cuda_nms = CudaNms(1, warm.shape[2], warm.shape[1] - 4, nms.conf_threshold,
                       nms.iou_threshold, nms.class_agnostic, nms.max_detections)
    cuda_nms.warmup(warm.dtype)
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


def attempt(row: Row, what: str, measure: Callable[[], Any]) -> Any:
    """Run one measurement; a failure is noted in the row (traceback on stderr), not raised."""
    try:
        return measure()
    except Exception as error:  # noqa: BLE001 - the table shows it; the run goes on
        traceback.print_exc(file=sys.stderr)
        row.notes.append(f"{what} failed: {type(error).__name__}: {' '.join(str(error).split())}")
        return None
    finally:
        gc.collect()


def decode_modes(setup: Setup) -> list[tuple[str, str | None]]:
    """(mode, why it cannot run or None) for cpu and, on the GPU path, gpu decode."""
    if setup.device != "cuda":
        return [("cpu", None)]
    from stages.gpu_decode import gpu_decode_unavailable_reason

    return [("cpu", None), ("gpu", gpu_decode_unavailable_reason())]


def run_benchmark(setup: Setup, cameras: list[int]) -> list[Row]:
    """Every row of the table (see the module docstring)."""
    rows: list[Row] = []
    infer_fps: dict[int, float | None] = {}
    naive = Row("naive sequential", 1, 1)
    attempt(naive, "naive pipeline", lambda: measure_naive(setup, naive))
    with tempfile.TemporaryDirectory() as tmp:
        for mode, unavailable in decode_modes(setup):
            for count in cameras:
                row = Row(mode, count, min(setup.batch_cap, max(8, count)))
                rows.append(row)
                if unavailable:
                    row.notes.append(f"gpu decode unavailable: {unavailable}")
                    continue
                measure_row(setup, row, infer_fps, Path(tmp) / "out")
                row.naive_fps = naive.fps
                # Each row as it is done, so a run cut short still shows what it measured.
                print(markdown([row], f"measured {mode} decode, {count} cameras:"),
                      file=sys.stderr, flush=True)
    return [*rows, naive]


def measure_row(setup: Setup, row: Row, infer_fps: dict[int, float | None], out: Path) -> None:
    """Inference alone (once per batch size), decode alone, then the pipeline."""
    if row.batch not in infer_fps:
        infer_fps[row.batch] = attempt(row, "inference alone",
                                       lambda: measure_inference(setup, row.batch))
    row.infer_fps = infer_fps[row.batch]
    row.decode_fps = attempt(row, "decode alone",
                             lambda: measure_decode(setup, row.decode, row.cameras))
    attempt(row, "pipeline", lambda: measure_pipeline(setup, row, out))


def markdown(rows: list[Row], header: str) -> str:
    """The table, with a line of context above it."""
    def num(value: float | None, digits: int = 0) -> str:
        return "" if value is None else f"{value:,.{digits}f}"

    lines = [header, "",
             "| decode | cameras | batch | pipeline fps | p50 ms | p99 ms | GPU util % | decode "
             "alone fps | infer alone fps | slowest | pipeline / slowest | x naive | notes |",
             "|" + "---|" * 13]
    for row in rows:
        slowest = row.slowest
        ratio = row.fps / slowest[1] if row.fps and slowest else None
        speedup = row.fps / row.naive_fps if row.fps and row.naive_fps else None
        lines.append("| " + " | ".join([
            row.decode, str(row.cameras), str(row.batch), num(row.fps), num(row.p50_ms, 1),
            num(row.p99_ms, 1), num(row.gpu_util), num(row.decode_fps), num(row.infer_fps),
            slowest[0] if slowest else "", num(ratio, 2), num(speedup, 1),
            "; ".join(row.notes)]) + " |")
    return "\n".join(lines) + "\n"


def make_setup(args: argparse.Namespace) -> tuple[Setup, str]:
    """The clip, model and backend of the mode asked for, fetched or built when missing."""
    assets = Path(args.assets)
    samples = SamplePaths.under(assets)
    if not (samples.bikes.exists() and samples.model.exists() and samples.names.exists()):
        samples = ensure_samples(assets, log=print)
    if args.small:
        setup = Setup(samples.bikes, samples.model, samples.names, "cpu", "onnxruntime",
                      args.seconds or 2.0, args.batch or 4)
        what = "yolov3-tiny 416, onnxruntime on the CPU, bikes.mp4 640x272"
    else:
        from samples.yolov8 import ensure_yolov8

        model, names = ensure_yolov8(assets, log=print)
        clip = make_1080p_clip(samples.bikes, assets / "cache" / "bikes_1080p_4mbps.mp4",
                               bitrate=CLIP_BITRATE)
        setup = Setup(clip, model, names, "cuda", "torch", args.seconds or 10.0, args.batch or 64)
        what = "YOLOv8s 640, torch FP16 on the GPU, bikes.mp4 upscaled to 1080p H.264 4 Mbps"
    return setup, (f"Throughput, {what}; {setup.seconds:g} s per measurement; each camera "
                   f"loops the clip as fast as it is taken.")


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
                        help="largest batch (default 64; small: 4); batch = min(this, max(8, N))")
    parser.add_argument("--assets", default="assets", help="assets folder (models, clips)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here (md)")
    args = parser.parse_args(argv)
    cameras = [int(n) for n in (args.cameras or ("1,2" if args.small else "1,8,32,64")).split(",")]
    from pipeline.logging import configure_logging

    configure_logging(level="warning")
    setup, header = make_setup(args)
    if setup.device == "cuda":
        try:
            import cupy

            name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
            header += f" GPU: {name}."
        except Exception as error:  # noqa: BLE001 - the rows will say what fails
            header += f" GPU: not usable ({type(error).__name__})."
    table = markdown(run_benchmark(setup, cameras), header)
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
