"""What the parts of a run reach alone, beside what the whole run holds (``capacity``):

- decode alone: a clip decoded as fast as possible by K parallel decoders, nothing else, where
  the pipeline would decode it (``build.decoder_kind``): on the CPU by the pipeline's own
  worker processes and decoder settings (``default_worker_count``, ``decoder_threads``),
  each frame's slot given back at once; on NVDEC by K ``GpuDecodeStage`` threads, then, as
  the GPU path has both kinds of decoder, the CPU's alone (one per usable core) and NVDEC's
  and the CPU's at once (each kind's frames/s in the same window, and their sum). Each
  decoder starts the clip again at its end, so any clip is long enough.
- engine alone: the model at the configured batch size, on a batch made from the clip's
  first frames (preprocessed as the CPU path does, ``kernels.preprocess``), the backend made
  as the pipeline makes it (``stages.infer.create_backend``, then ``warmup()``); images/s,
  CUDA-event timed on the GPU.

Each runs in a child process, so the process that measures never creates a CUDA context:

    python -m pipeline.app.ceilings decode --config C.yaml [--decoders K] [--seconds S]
    python -m pipeline.app.ceilings engine --config C.yaml [--seconds S]
    python -m pipeline.app.ceilings split --config C.yaml --cpu-cores 4,6 [--seconds S]

``split`` measures NVDEC and the CPU at once with the cores shared out between them: for each
N of ``--cpu-cores``, N CPU decoders pinned to the last N usable cores and the NVDEC
decoders' threads (FFmpeg's too) to the others; one JSON line per N (``SplitRate``).

``C.yaml`` is a run's configuration; its first source's ``uri`` is the clip. Each prints one
JSON line (``DecodeRate`` or ``EngineRate``); errors are one ``error:`` line on stderr, exit
status 2 for a configuration the machine cannot run (``inference.device: cuda`` without a
GPU, say), 1 for any other failure.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import ConfigError, PipelineConfig, SourceConfig, load_config
from pipeline.records import Frame

SLOTS_PER_SOURCE = 4
START_S = 2.0  # decode alone: opening and first frames, before the window
NVDEC_DECODERS = 16  # decode alone on NVDEC: streams enough to keep its engines busy
CLIP_FRAMES = 16  # engine alone: distinct frames of the clip in its batch (repeated to fill it)


@dataclass
class DecodeRate:
    """Decode alone: ``fps`` frames/s of ``decoders`` parallel decoders in ``mode``, where
    the run decodes its cameras (``build.decoder_kind``: gpu is NVDEC; cpu: ``processes``
    worker processes, ``cpu_s_per_frame`` their CPU seconds per frame). On the GPU path
    also the CPU's decoders alone (``cpu_fps``: ``cpu_decoders`` in ``cpu_processes``
    worker processes) and both kinds at once (``both_nvdec_fps`` + ``both_cpu_fps`` =
    ``both_fps``: NVDEC and CPU decoders in the same window)."""

    fps: float
    decoders: int
    mode: str
    processes: int = 0
    cpu_s_per_frame: float | None = None
    cpu_fps: float | None = None
    cpu_decoders: int = 0
    cpu_processes: int = 0
    both_nvdec_fps: float | None = None
    both_cpu_fps: float | None = None

    @property
    def both_fps(self) -> float | None:
        if self.both_nvdec_fps is None or self.both_cpu_fps is None:
            return None
        return self.both_nvdec_fps + self.both_cpu_fps


@dataclass
class EngineRate:
    """Engine alone: ``images_s`` images/s of ``backend`` at ``batch``; ``warmup_s`` the
    seconds its ``warmup()`` took (compilation, CUDA graph captures)."""

    images_s: float
    batch: int
    backend: str
    device: str
    warmup_s: float


# ---- decode alone ----------------------------------------------------------------------


def _isolated_worker(clip: str, names: list[str], threads: int, size: tuple[int, int],
                     counter: Any, start: Any, stop: Any, cpus: list[int] | None = None) -> None:
    from pipeline.logging import configure_logging
    from pipeline.slots import SlotRing, i420_bytes
    from stages.decode import DecodeStage

    if cpus:  # before FFmpeg starts its threads: they inherit it
        os.sched_setaffinity(0, cpus)
    configure_logging(level="warning")
    ended = threading.Event()
    ring = SlotRing(SLOTS_PER_SOURCE * len(names), i420_bytes(*size))

    def decode(name: str) -> None:
        while not ended.is_set():  # from the start again at its end: any clip is long enough
            stage = DecodeStage(SourceConfig(name=name, uri=clip), ring, ended, 0, threads)
            for item in stage.frames(ended):
                if isinstance(item, Frame):
                    ring.release([item.slot])
                    with counter.get_lock():
                        counter.value += 1
                elif item.error:
                    return

    start.wait()
    workers = [threading.Thread(target=decode, args=(name,), daemon=True) for name in names]
    for thread in workers:
        thread.start()
    stop.wait()
    ended.set()
    for thread in workers:
        thread.join(10)


class CpuDecoders:
    """``decoders`` sources of ``clip`` decoded on the CPU by the worker processes the pipeline
    would start for them (``default_worker_count``, sources dealt round-robin,
    ``decoder_threads`` FFmpeg threads each), each into a private slot ring (the planes
    copied as in the pipeline), each slot given back at once: nothing crosses a process
    boundary per frame. ``cpus``: the cores they run on (None: any)."""

    def __init__(self, clip: Path, decoders: int, cpus: list[int] | None = None) -> None:
        from pipeline.app.build import probe_frame_size
        from pipeline.app.workers import default_worker_count
        from stages.decode import decoder_threads

        context = multiprocessing.get_context("spawn")
        self.decoders = decoders
        self.processes = default_worker_count(decoders)
        self._counter = context.Value("q", 0)
        self._start, self._stop = context.Event(), context.Event()
        names = [f"cam{i:03d}" for i in range(decoders)]
        size = probe_frame_size(str(clip))
        self._procs = [context.Process(target=_isolated_worker, daemon=True,
                                       args=(str(clip), names[k::self.processes],
                                             decoder_threads(decoders), size, self._counter,
                                             self._start, self._stop, cpus))
                       for k in range(self.processes)]
        self.cpu_s = 0.0  # CPU s of the children reaped by stop(): its own when run alone

    def start(self) -> None:
        self._before = resource.getrusage(resource.RUSAGE_CHILDREN)
        for proc in self._procs:
            proc.start()
        self._start.set()

    def frames(self) -> int:
        return int(self._counter.value)

    def stop(self) -> None:
        self._stop.set()
        for proc in self._procs:
            proc.join(30)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.cpu_s = ((after.ru_utime - self._before.ru_utime)
                      + (after.ru_stime - self._before.ru_stime))


class NvdecDecoders:
    """``decoders`` threads each decoding ``clip`` on NVDEC (``GpuDecodeStage``; the pictures
    stay on the device and are dropped). ``cpus``: the cores they (and FFmpeg's threads
    they start) run on (None: any)."""

    def __init__(self, clip: Path, decoders: int, device_id: int,
                 cpus: list[int] | None = None) -> None:
        from stages.gpu_decode import GpuDecodeStage  # not installed: raised here, not lost

        self._stage = GpuDecodeStage
        self.clip, self.decoders, self.device_id = clip, decoders, device_id
        self.cpus = cpus
        self._ended = threading.Event()
        self._counts = [0] * decoders
        self.failures: list[str] = []
        self._threads = [threading.Thread(target=self._decode, args=(i,), daemon=True)
                         for i in range(decoders)]

    def _decode(self, index: int) -> None:
        if self.cpus:  # this thread, and the threads it starts
            os.sched_setaffinity(0, self.cpus)
        source = SourceConfig(name=f"cam{index:03d}", uri=str(self.clip))
        try:
            while not self._ended.is_set():  # from the start again at its end
                for item in self._stage(source, self.device_id).frames(self._ended):
                    if isinstance(item, Frame):
                        self._counts[index] += 1  # one writer per item: no lock needed
                    elif item.error:
                        self.failures.append(item.error)
                        return
        except Exception as error:  # noqa: BLE001 - reported by measure_at_once
            self.failures.append(f"{type(error).__name__}: {error}")

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def frames(self) -> int:
        return sum(self._counts)

    def stop(self) -> None:
        self._ended.set()
        for thread in self._threads:
            thread.join(30)


def measure_at_once(groups: list[Any], seconds: float) -> list[float]:
    """Frames/s of each of ``groups`` of decoders (``CpuDecoders``, ``NvdecDecoders``), all
    decoding at the same time, counted over ``seconds`` after ``START_S``.

    Raises:
        RuntimeError: an NVDEC decoder failed (its reason).
    """
    started = []
    try:
        for group in groups:
            group.start()
            started.append(group)
        time.sleep(START_S)
        first, t0 = [group.frames() for group in groups], time.perf_counter()
        time.sleep(seconds)
        last, t1 = [group.frames() for group in groups], time.perf_counter()
    finally:
        for group in started:
            group.stop()
    for group in groups:
        if getattr(group, "failures", None):
            raise RuntimeError(group.failures[0])
    return [(b - a) / (t1 - t0) for a, b in zip(first, last, strict=True)]


def measure_isolated(clip: Path, cameras: int, seconds: float) -> tuple[float, int, float]:
    """(frames/s, worker processes, worker CPU s per frame) of ``cameras`` sources of ``clip``
    decoded on the CPU alone (``CpuDecoders``), counted over ``seconds`` after ``START_S``."""
    decoders = CpuDecoders(clip, cameras)
    (fps,) = measure_at_once([decoders], seconds)
    return fps, decoders.processes, decoders.cpu_s / max(decoders.frames(), 1)


def measure_nvdec(clip: Path, decoders: int, seconds: float, device_id: int) -> float:
    """Frames/s of ``decoders`` NVDEC decoders alone (``NvdecDecoders``), counted over
    ``seconds`` after ``START_S``.

    Raises:
        RuntimeError: a decoder failed (its reason).
    """
    (fps,) = measure_at_once([NvdecDecoders(clip, decoders, device_id)], seconds)
    return fps


def decode_rate(config: PipelineConfig, decoders: int | None, seconds: float) -> DecodeRate:
    """Decode alone for ``config``'s first source, where the pipeline would decode it, by
    ``decoders`` parallel decoders (None: ``NVDEC_DECODERS`` on NVDEC, one per usable core
    on the CPU); on NVDEC then the CPU's decoders alone (one per usable core) and both at
    once, each over ``seconds``."""
    from pipeline.app.build import create_gpu_context, decoder_kind
    from stages.decode import usable_cores

    source = config.sources[0]
    gpu = create_gpu_context(config)
    mode = decoder_kind(config, source, "sources[0]", gpu)
    decoders = decoders or (NVDEC_DECODERS if mode == "gpu" else usable_cores())
    clip = Path(source.uri)
    if mode == "cpu":
        fps, processes, cpu = measure_isolated(clip, decoders, seconds)
        return DecodeRate(fps, decoders, mode, processes, cpu)
    device = config.inference.gpu_id
    rate = DecodeRate(measure_nvdec(clip, decoders, seconds, device), decoders, mode)
    cpu_decoders = usable_cores()
    rate.cpu_fps, rate.cpu_processes, rate.cpu_s_per_frame = measure_isolated(
        clip, cpu_decoders, seconds)
    rate.cpu_decoders = cpu_decoders
    rate.both_nvdec_fps, rate.both_cpu_fps = measure_at_once(
        [NvdecDecoders(clip, decoders, device), CpuDecoders(clip, cpu_decoders)], seconds)
    return rate


@dataclass
class SplitRate:
    """NVDEC and the CPU decoding at once on disjoint cores: ``cpu_cores`` cores for
    ``cpu_cores`` CPU decoders, the other ``nvdec_cores`` for the NVDEC decoders' threads."""

    cpu_cores: int
    nvdec_cores: int
    nvdec_fps: float
    cpu_fps: float

    @property
    def both_fps(self) -> float:
        return self.nvdec_fps + self.cpu_fps


def split_rates(config: PipelineConfig, cpu_cores: list[int], seconds: float,
                decoders: int | None = None) -> list[SplitRate]:
    """``SplitRate`` for each count of ``cpu_cores`` (``split``, module docstring).

    Raises:
        ConfigError: a count leaves no core for NVDEC, or the first source is not decoded
            on NVDEC.
    """
    from pipeline.app.build import create_gpu_context, decoder_kind
    from stages.decode import usable_cores

    source = config.sources[0]
    if decoder_kind(config, source, "sources[0]", create_gpu_context(config)) != "gpu":
        raise ConfigError("split: sources[0] is not decoded on NVDEC here")
    cores = sorted(os.sched_getaffinity(0))[:usable_cores()]
    rates = []
    for count in cpu_cores:
        if not 0 < count < len(cores):
            raise ConfigError(f"--cpu-cores: {count} leaves no core for one of the two "
                              f"({len(cores)} usable)")
        nvdec, cpu = cores[:-count], cores[-count:]
        nvdec_fps, cpu_fps = measure_at_once(
            [NvdecDecoders(Path(source.uri), decoders or NVDEC_DECODERS,
                           config.inference.gpu_id, nvdec),
             CpuDecoders(Path(source.uri), count, cpu)], seconds)
        rates.append(SplitRate(count, len(nvdec), nvdec_fps, cpu_fps))
    return rates


# ---- engine alone ----------------------------------------------------------------------


def clip_batch(clip: Path, batch: int, width: int, height: int, dtype: Any) -> np.ndarray:
    """(batch, 3, height, width) host array of ``dtype``: the first ``CLIP_FRAMES`` frames of
    ``clip`` letterboxed as the pipeline's preprocess does, repeated to fill the batch."""
    import av

    from kernels.preprocess import letterbox_geometry, preprocess_reference

    images = np.empty((batch, 3, height, width), dtype)
    made = 0
    with av.open(str(clip)) as container:
        for picture in container.decode(container.streams.video[0]):
            w, h = max(picture.width & ~1, 2), max(picture.height & ~1, 2)
            yuv = picture.reformat(width=w, height=h, format="yuv420p").to_ndarray()
            preprocess_reference(yuv, w, h, letterbox_geometry(w, h, width, height),
                                 out=images[made])
            made += 1
            if made == min(batch, CLIP_FRAMES):
                break
    if not made:
        raise ValueError(f"{clip}: no frame decodes")
    for row in range(made, batch):
        images[row] = images[row % made]
    return images


def engine_rate(config: PipelineConfig, seconds: float, clip: Path | None = None
                ) -> EngineRate:
    """Engine alone: ``backend.infer`` at ``inference.batch_size`` on one preallocated batch
    (from ``clip``'s frames, or random images when None), for about ``seconds``, the backend
    made as the pipeline makes it and warmed up first."""
    from pipeline.app.build import create_gpu_context, first_file_source
    from stages.backends.base import read_model_info
    from stages.infer import create_backend

    batch = config.inference.batch_size
    info = read_model_info(config.model.path, config.model.layout)
    gpu = create_gpu_context(config)
    backend = create_backend(config.inference, Path(config.model.path), info, gpu,
                             first_file_source(config))
    try:
        started = time.perf_counter()
        backend.warmup()
        warmup_s = time.perf_counter() - started
        shape = (batch, 3, info.input_height, info.input_width)
        dtype = np.dtype(getattr(backend, "input_dtype", backend.info.input_dtype))
        host = (clip_batch(clip, batch, info.input_width, info.input_height, dtype)
                if clip is not None else None)
        if gpu is None:
            if host is None:
                host = np.random.default_rng(0).random(shape, np.float32).astype(dtype)
            started, runs = time.perf_counter(), 0
            while runs < 3 or time.perf_counter() - started < seconds:
                backend.infer(host)
                runs += 1
            images_s = batch * runs / (time.perf_counter() - started)
        else:
            import cupy

            stream = gpu.compute_stream
            images = (backend.input_buffer(batch) if hasattr(backend, "input_buffer")
                      else cupy.empty(shape, dtype))
            with stream:
                source = (cupy.random.random(shape, np.float32) if host is None
                          else cupy.asarray(host))
                images[...] = source.astype(images.dtype)
            images_s = infer_rate(backend, images, stream, seconds)
        return EngineRate(images_s, batch, backend.name, backend.device, warmup_s)
    finally:
        backend.close()


def infer_rate(backend: Any, images: Any, stream: Any, seconds: float, min_runs: int = 10
               ) -> float:
    """Images/s of ``backend.infer(images, stream)`` over about ``seconds`` of runs, timed
    with CUDA events on ``stream`` after one warm run.

    Args:
        images: (B, 3, H, W) CuPy array of the backend's input dtype, valid on ``stream``
            (the backend's own input buffer saves it a copy).
    """
    import cupy

    backend.infer(images, stream)
    stream.synchronize()
    probe = time.perf_counter()
    backend.infer(images, stream)
    stream.synchronize()
    runs = max(min_runs, int(seconds / max(time.perf_counter() - probe, 1e-4)))
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    for _ in range(runs):
        backend.infer(images, stream)
    end.record(stream)
    end.synchronize()
    return images.shape[0] * runs / (cupy.cuda.get_elapsed_time(start, end) / 1000)


# ---- the child's command line ----------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """One measurement (module docstring); its JSON on stdout, errors on stderr."""
    from pipeline.logging import configure_logging
    from stages.infer import BackendUnavailable

    parser = argparse.ArgumentParser(prog="python -m pipeline.app.ceilings",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("decode", "engine", "split"))
    parser.add_argument("--config", required=True, help="a run's YAML; sources[0].uri: the clip")
    parser.add_argument("--decoders", type=int, default=None,
                        help="decode: parallel decoders (default: 16 on NVDEC, one per core "
                             "on the CPU)")
    parser.add_argument("--seconds", type=float, default=5.0, help="the measured window")
    parser.add_argument("--cpu-cores", default="4",
                        help="split: the cores given to CPU decode, one measurement each "
                             "(comma-separated)")
    args = parser.parse_args(argv)
    configure_logging(level="warning")
    try:
        config = load_config(args.config)
        if args.what == "split":
            counts = [int(n) for n in args.cpu_cores.split(",") if n.strip()]
            for rate in split_rates(config, counts, args.seconds, args.decoders):
                print(json.dumps({**asdict(rate), "both_fps": rate.both_fps}), flush=True)
            return 0
        if args.what == "decode":
            found: Any = decode_rate(config, args.decoders, args.seconds)
        else:
            found = engine_rate(config, args.seconds, Path(config.sources[0].uri))
    except (ConfigError, BackendUnavailable) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - one line for the user
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(json.dumps({**asdict(found), **({"both_fps": found.both_fps}
                                          if isinstance(found, DecodeRate) else {})}),
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
