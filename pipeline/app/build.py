"""Wires the graph of stages from a validated configuration."""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import av
import structlog

from pipeline.app.preview import PreviewHub
from pipeline.app.workers import DecodeWorkerPool, default_worker_count
from pipeline.config import (
    ConfigError,
    PipelineConfig,
    SourceConfig,
    install_hint,
    is_stream_url,
)
from pipeline.engine_link import EngineLink
from pipeline.gpu import GpuContext, gpu_unavailable_reason
from pipeline.graph import Graph
from pipeline.records import BatchDetections
from pipeline.resume import EARLIER_VIDEO, RecordsSettings, file_origin
from pipeline.slots import SlotRing, i420_bytes
from pipeline.stage import SourceStage, Stage
from stages.analytics import AnalyticsStage, Region
from stages.annotate import AnnotateStage
from stages.backends.base import ModelInfo, read_model_info
from stages.batcher import BatcherStage, DetectionSchedule
from stages.decode import DecodeStage, decoder_threads
from stages.event_media import EventMedia
from stages.filters import DetectionFilterStage, SourceFilter
from stages.gpu_decode import GpuDecodeStage, gpu_decode_unavailable_reason
from stages.infer import InferStage, create_backend
from stages.pictures import PictureStage
from stages.postprocess import DeviceNms, PostprocessStage
from stages.preprocess import DevicePreprocess, HostPreprocess
from stages.remote_infer import RemoteInferStage
from stages.sinks import SinkStage
from stages.tracking import TrackerSettings, TrackerStage

if TYPE_CHECKING:
    from pipeline.app.mqtt import MqttPublisher
    from pipeline.app.webhooks import WebhookPublisher

log = structlog.get_logger("build")

DEFAULT_FRAME_SIZE = (1920, 1080)  # staging slot size when no source announces a larger one
TRACK_GONE_MARGIN_S = 0.5  # analytics: a track unseen this long past tracker_lost_s is gone
BATCH_SETS = 3  # batch sets: one being copied in, one on the GPU, one being read back
DECODE_NICE = 10  # a GPU-path source worker's CPU decode processes yield the CPU to the rest


class DeviceUnavailable(ConfigError):
    """``inference.device: cuda`` was asked for and the GPU path cannot run."""


def read_class_names(path: str | None) -> list[str] | None:
    """Class names, one per line, or None when no file is configured.

    Raises:
        ConfigError: the file is not UTF-8 text (a new user's video given as the names
            file ended with a bare UnicodeDecodeError and exit status 1).
    """
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"model.class_names: {path!r} is not a text file of class names "
                          f"(UTF-8, one per line): byte {error.start} is not UTF-8") from None
    return [line.strip() for line in text.splitlines() if line.strip()]


def create_gpu_context(config: PipelineConfig, profile: bool = False) -> GpuContext | None:
    """The GPU context when ``inference.device`` resolves to cuda, else None."""
    device = config.inference.device
    if device == "cpu":
        return None
    reason = gpu_unavailable_reason()
    if reason is not None:
        if device == "cuda":
            raise DeviceUnavailable(f"inference.device: 'cuda' cannot be used: {reason}")
        log.info("using the CPU path", reason=reason)
        return None
    return GpuContext(config.inference.gpu_id, profile=profile)


def first_file_source(config: PipelineConfig) -> str | None:
    """The first source that is a file (INT8 calibration's default video), or None."""
    return next((s.uri for s in config.sources if not is_stream_url(s.uri)), None)


PROBE_TIMEOUT_S = 20.0  # the longest a start waits for the files' first frames


def probe_frame_size(uri: str) -> tuple[int, int]:
    """Open a video file and decode its first frame: (width, height) of that frame, rounded
    down to even. A file probed before in this process, unchanged since (size and
    modification time), is not opened again (a run's checks and its engine both ask).

    Raises:
        ConfigError: the file cannot be opened, has no video stream, or no frame of it
            decodes (the message says which, in FFmpeg's words).
    """
    try:
        stat = os.stat(uri)
        return _probed_size(uri, stat.st_size, stat.st_mtime_ns)
    except OSError:
        return _probed_size(uri, -1, -1)  # av.open says what is wrong with it


@functools.lru_cache(maxsize=1024)
def _probed_size(uri: str, size: int, mtime_ns: int) -> tuple[int, int]:
    """``probe_frame_size`` of a file as it is (``size``, ``mtime_ns``: the cache key)."""
    try:
        with av.open(uri) as container:
            if not container.streams.video:
                raise ConfigError(f"cannot read {uri!r}: it has no video stream")
            for frame in container.decode(container.streams.video[0]):
                return frame.width & ~1, frame.height & ~1
    except av.FFmpegError as error:
        reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
        raise ConfigError(f"cannot read {uri!r}: {reason}") from None
    except OSError as error:
        raise ConfigError(f"cannot read {uri!r}: {error.strerror or error}") from None
    raise ConfigError(f"cannot read {uri!r}: no video frame decodes")


def probe_file_sources(config: PipelineConfig) -> dict[int, tuple[int, int]]:
    """Decode the first frame of every file source, in parallel threads (FFmpeg decodes
    without the interpreter lock), before anything else starts: a file that cannot be read
    stops the start here, with one line naming it, instead of after the model loaded.

    Returns:
        source position -> the (width, height) of its first frame, for every file source.

    Raises:
        ConfigError: ``sources[i].uri (source 'name'): cannot read ...`` for the first
            unreadable file in config order, or a file not probed within PROBE_TIMEOUT_S.
    """
    from concurrent.futures import ThreadPoolExecutor
    from concurrent.futures import TimeoutError as ProbeTimeout

    files = [(i, s) for i, s in enumerate(config.sources) if not is_stream_url(s.uri)]
    if not files:
        return {}
    pool = ThreadPoolExecutor(max_workers=min(len(files), 8), thread_name_prefix="probe")
    try:
        futures = [(i, s, pool.submit(probe_frame_size, s.uri)) for i, s in files]
        deadline = time.monotonic() + PROBE_TIMEOUT_S
        sizes = {}
        for i, source, future in futures:
            key = f"sources[{i}].uri (source {source.name!r})"
            try:
                sizes[i] = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except ConfigError as error:
                raise ConfigError(f"{key}: {error}") from None
            except ProbeTimeout:
                raise ConfigError(f"{key}: its first frame did not decode within "
                                  f"{PROBE_TIMEOUT_S:g} s") from None
        return sizes
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def frame_slots(config: PipelineConfig, sources: int | None = None) -> int:
    """How many ring slots: ``runtime.staging_slots``, or enough for every batch set in
    flight plus two frames per source (one being decoded, one waiting), and as much again
    for the sinks' queues when the sinks read the images (video is written).

    Args:
        sources: the sources the graph is sized for (default: every configured one).
    """
    if config.runtime.staging_slots:
        return config.runtime.staging_slots
    batch = config.inference.batch_size
    sources = len(config.sources) if sources is None else sources
    slots = batch * (BATCH_SETS + 2) + 2 * sources
    if config.output.video is not None or config.runtime.http is not None \
            or config.output.event_media is not None:
        slots += batch * 2 + 2 * sources
    return slots


@dataclass(frozen=True)
class ModelSetup:
    """What the build settled on for the model: its ``ModelInfo`` and class names (the
    file's, else the model's metadata, else None)."""

    info: ModelInfo
    class_names: list[str] | None


def model_setup(config: PipelineConfig) -> ModelSetup:
    """Read the model's shape and class names.

    Raises:
        ConfigError: the model cannot be read, or ``model.class_names`` does not match it.
    """
    try:
        info = read_model_info(config.model.path, config.model.layout)
    except ValueError as error:
        raise ConfigError(f"model.path: {error}") from None
    class_names = read_class_names(config.model.class_names)
    if class_names is None and info.names is not None:
        class_names = list(info.names)
    elif class_names is not None and info.num_classes and len(class_names) != info.num_classes:
        raise ConfigError(f"model.class_names: {len(class_names)} names in "
                          f"{config.model.class_names!r}, but the model has {info.num_classes} "
                          "classes (one name per line, in class order)")
    return ModelSetup(info, class_names)


def check_sources(config: PipelineConfig, model: ModelSetup,
                  frame_sizes: dict[int, tuple[int, int]]) -> tuple[bool, bool, list[str]]:
    """Check every source's classes, ROI, tracker and zones against the model (the messages
    name ``sources[i]``), before anything starts.

    Returns:
        (some source filters its detections, some source is tracked, the names of the
        sources with zones or lines): the stages the graph needs.

    Raises:
        ConfigError: a class the model does not have, or a region outside a file's frame.
    """
    num_classes = model.info.num_classes
    filters = [SourceFilter.from_config(f"sources[{i}]", source, model.class_names, num_classes)
               for i, source in enumerate(config.sources)]
    regions = analytics_regions(config, model.class_names, num_classes, dict(frame_sizes))
    tracked = any(TrackerSettings.from_config(source) is not None for source in config.sources)
    return any(f is not None for f in filters), tracked, list(regions)


def build_graph(config: PipelineConfig,
                on_batch_done: Callable[[str, BatchDetections], None] | None = None,
                profile_gpu: bool = False, start_sources: bool = True,
                expected_sources: int | None = None, stop_when: str | None = None,
                cores: int | None = None, engine: tuple[EngineLink, int] | None = None,
                frames: str | None = None) -> Graph:
    """Create every stage the configuration asks for, connect them, and add the configured
    sources (``start_sources``) through ``graph.control``, the path every source takes.

    sources (decode into the slot ring) -> batch -> infer -> postprocess -> [filter] ->
    [track] -> [analytics] -> [annotate] -> sinks. On the GPU path every device buffer is
    allocated here; the model is warmed up and every kernel compiled when the graph opens the
    infer stage (``Graph.run``), before any source starts.

    Args:
        start_sources: add every source of ``config``; False: none (a pipeline host, to
            which its supervisor adds sources); the stages the graph has are those the
            configured sources need, either way.
        expected_sources: how many sources the ring and the decode workers are sized for
            (default: every configured one).
        stop_when: overrides ``runtime.stop_when`` (a host's graph: ``never``).
        cores: the cores its decode workers and FFmpeg threads are sized for (default: the
            cores this process may use; a supervisor gives each of its hosts a share).
        engine: (the engine's link, this worker's number): build a source worker, whose
            frames are detected by its GPU's engine process (``stages.remote_infer`` stands
            for the batch, infer and postprocess stages; the model is not loaded here) and
            decoded in threads of this process into its share of the engine's rings.
        frames: "bgr" or "i420": every batch part reaching the sinks carries a host copy of
            its frames' pictures (``stages.pictures``, for the Python API); every source
            then decodes on the CPU (``decode: gpu`` is an error). None: no copies.
    """
    from pipeline.app.control import SourceControl  # it builds sources with this module

    check_extras(config)
    model = model_setup(config)
    info, class_names = model.info, model.class_names
    # A source worker's files were probed and checked by its supervisor (``run.prepare``); it
    # probes a file when the file is placed on it (``SourceControl``), not every file of the run.
    frame_sizes = probe_file_sources(config) if engine is None else {}
    filtered, tracked, with_regions = check_sources(config, model, frame_sizes)
    stop = threading.Event()
    video = config.output.video is not None
    http = config.runtime.http
    preview = PreviewHub(http.preview_fps, class_names) if http is not None else None
    host_frames = frames is not None
    media = create_event_media(config, with_regions)
    # The sinks (or the picture stage, or the event media's copies) read the images: the
    # sinks release them.
    keep_images = video or preview is not None or host_frames or media is not None
    # NVDEC frames: the event snapshots download their frame's pictures (one per frame with
    # events), so the decoder's surfaces stay with the batch until the analytics stage
    device_pictures = media is not None and media.config.snapshot
    size = (info.input_height, info.input_width)
    pool = None
    if engine is not None:
        link, worker = engine
        gpu = GpuContext(link.device) if link.device_share else None  # NVDEC, no model
        ring = SlotRing.attach(link.host_ring, link.host_slots, link.slot_bytes,
                               list(link.host_shares[worker]))
        kinds = [decoder_kind(config, source, f"sources[{i}]", gpu, host_frames)
                 for i, source in enumerate(config.sources)]
        expected = len(config.sources) if expected_sources is None else expected_sources
        on_cpu = math.ceil(kinds.count("cpu") * expected / max(1, len(config.sources)))
        threads = decoder_threads(max(1, on_cpu), cores)
        # On the GPU path its CPU-decoded share decodes in processes of lower priority: in
        # threads here, FFmpeg's threads took the cores (and the GIL) that NVDEC's feeding
        # and this worker's own stages need (150 cameras on the H200 collapsed to 382
        # frames/s, results-h200.md); on the CPU path, in threads of this process.
        count = config.runtime.decode_workers
        count = min(on_cpu, default_worker_count(on_cpu, cores) if count is None else count)
        if gpu is not None and count > 0:
            pool = DecodeWorkerPool(config, ring, count, threads, nice=DECODE_NICE)
            log.info("decoding in worker processes", workers=count, sources=on_cpu, nice=DECODE_NICE,
                     setting="auto" if config.runtime.decode_workers is None
                     else "runtime.decode_workers")
        remote = RemoteInferStage("remote_infer", link, worker, ring, size, keep_images, stop,
                                  on_drop=lambda frame, reason: None,
                                  keep_device_pictures=device_pictures)
        chain: list[Stage] = [remote]
    else:
        gpu = create_gpu_context(config, profile_gpu)
        ring, pool, threads, chain, kinds = model_stages(
            config, info, frame_sizes, gpu, stop, keep_images, expected_sources, cores,
            host_frames, device_pictures)
    if filtered:
        chain.append(DetectionFilterStage("filter", {}))
    if tracked:
        chain.append(TrackerStage("track", {}))
    publishers = [p for p in (create_publisher(config, with_regions),
                              create_webhooks(config, with_regions)) if p is not None]
    if media is not None:
        media.publishers = tuple(p for p in publishers if hasattr(p, "publish_snapshot"))
    if with_regions:
        chain.append(AnalyticsStage("analytics", {}, class_names, {}, publishers, media))
    if host_frames:  # before annotate: the pictures are never drawn on
        chain.append(PictureStage("pictures", frames))
    if video:
        chain.append(AnnotateStage("annotate", class_names, {}, config.output.trails))
    graph = Graph([], chain, {}, config.runtime.queue_size, on_batch_done, stop=stop,
                  ring=ring, release_at_sink=keep_images,
                  stop_when=stop_when or config.runtime.stop_when)
    if engine is not None:
        remote.on_drop = graph.drop_frame
        graph.add_service(lambda: None, ring.close_view)
    else:
        graph.add_service(lambda: None, ring.close)
    for publisher in publishers:
        graph.add_service(publisher.start, publisher.close)
    if media is not None:  # closes before the publishers: its last snapshots reach MQTT
        graph.add_service(media.start, media.close)
    if pool is not None:
        graph.add_service(pool.start, pool.close, with_sources=True)
    graph.gpu = gpu
    graph.preview = preview
    known_sizes = {config.sources[i].uri: wh for i, wh in frame_sizes.items()}

    def make_decoder(index: int, source: SourceConfig, key: str) -> SourceStage:
        if decoder_kind(config, source, key, gpu, host_frames) == "gpu":
            return GpuDecodeStage(source, gpu.device_id, ring, preview)
        return DecodeStage(source, ring, stop, decoder_threads=threads)

    def make_sink(cfg: PipelineConfig, source: SourceConfig, tracked: bool,
                  has_analytics: bool) -> SinkStage:
        sink = build_sink(cfg, source, class_names, ring, keep_images, tracked, has_analytics,
                          preview)
        if media is not None and has_analytics:
            media.add_source(source.name, sink.events_path or cfg.output_path(
                "{source}.events.jsonl", source.name), sink)
        return sink

    graph.control = SourceControl(
        config, graph, ring, pool, class_names, info.num_classes, make_sink,
        lambda uri: known_sizes.get(uri) or probe_frame_size(uri), make_decoder,
        lambda source, key: decoder_kind(config, source, key, gpu, host_frames) == "cpu",
        track_gone_margin_s=TRACK_GONE_MARGIN_S)
    if start_sources:
        for source in config.sources:
            graph.control.add(source)
    return graph


def model_stages(config: PipelineConfig, info: ModelInfo,
                 frame_sizes: dict[int, tuple[int, int]], gpu: GpuContext | None,
                 stop: threading.Event, keep_images: bool, expected_sources: int | None,
                 cores: int | None, host_frames: bool = False, device_pictures: bool = False
                 ) -> tuple[SlotRing, DecodeWorkerPool | None, int, list[Stage], list[str]]:
    """The model's part of a whole pipeline (the model in this process): the frame ring,
    the decode worker pool, and the batch, infer and postprocess stages (``device_pictures``:
    the batches keep the GPU-decoded frames' pictures, ``BatcherStage``).

    Returns:
        (ring, decode worker pool or None, FFmpeg threads per source, [batcher, infer,
        postprocess], each configured source's decoder kind).
    """
    inference = config.inference
    backend = create_backend(inference, Path(config.model.path), info, gpu,
                             first_file_source(config))
    sizes = sorted({s for i, src in enumerate(config.sources)
                    if not src.is_live and (s := frame_sizes.get(i)) is not None})
    largest = max([DEFAULT_FRAME_SIZE, *sizes], key=lambda wh: wh[0] * wh[1])
    slot_bytes = i420_bytes(*largest)
    kinds = [decoder_kind(config, source, f"sources[{i}]", gpu, host_frames)
             for i, source in enumerate(config.sources)]
    expected = len(config.sources) if expected_sources is None else expected_sources
    on_cpu = math.ceil(kinds.count("cpu") * expected / max(1, len(config.sources)))
    workers = config.runtime.decode_workers
    workers = min(on_cpu, default_worker_count(on_cpu, cores) if workers is None else workers)
    ring = SlotRing(frame_slots(config, expected), slot_bytes, pinned=gpu is not None,
                    shared=workers > 0)
    log.info("frame slots allocated", slots=ring.slots, pinned=ring.pinned,
             shared=ring.shm_name is not None, mb=round(ring.slots * slot_bytes / 2**20, 1))
    threads = decoder_threads(on_cpu, cores)
    pool = DecodeWorkerPool(config, ring, workers, threads) if workers else None
    if pool is not None:
        log.info("decoding in worker processes", workers=len(pool.workers), sources=on_cpu,
                 setting="auto" if config.runtime.decode_workers is None else "runtime.decode_workers")
    size = (info.input_height, info.input_width)
    batcher = BatcherStage("batch", size, inference.batch_size, inference.batch_timeout_ms,
                           (), gpu, ring, stop, DetectionSchedule([], []), device_pictures)
    if gpu is None:
        infer = InferStage("infer", backend, HostPreprocess(size, info.input_dtype,
                                                           inference.batch_size))
    else:
        gpu.allocate(BATCH_SETS, inference.batch_size, slot_bytes, config.nms.max_detections)
        formats = ["i420", *(["nv12"] if "gpu" in kinds else [])]
        geometries = [(batcher.letterbox(w, h), fmt) for w, h in sizes for fmt in formats]
        infer = InferStage("infer", backend, DevicePreprocess(geometries), gpu,
                           DeviceNms(config.nms, inference.batch_size, info.layout))
    release = None if keep_images else ring.release
    postprocess = PostprocessStage("postprocess", config.nms, gpu, release, info.layout)
    return ring, pool, threads, [batcher, infer, postprocess], kinds


def build_sink(config: PipelineConfig, source: SourceConfig, class_names: list[str] | None,
               ring: SlotRing, keep_images: bool, tracked: bool, has_analytics: bool,
               preview: PreviewHub | None) -> SinkStage:
    """The sink of one source: its outputs as ``config.output`` names them.

    Args:
        keep_images: the sinks read the frames' images (video or previews): the sink then
            returns the slots to ``ring``.
        tracked: the source is tracked (its records carry ``tracker_id``).
        has_analytics: the source has zones or lines (its events are written).
    """
    output = config.output
    return SinkStage(
        f"sink:{source.name}",
        config.output_path(output.video, source.name) if output.video is not None else None,
        config.output_path(output.jsonl, source.name) if output.jsonl else None,
        class_names,
        output.video_crf,
        release_slots=ring.release if keep_images else None,
        live=source.is_live,
        tracked=tracked,
        events_path=(config.output_path(output.events, source.name)
                     if output.events and has_analytics else None),
        preview=preview,
        segment_s=output.segment_s,  # live sources only (SinkStage ignores it for files)
        keep_hours=output.keep_hours,
        origin=None if source.is_live else file_origin(source.uri),  # checked on resume
        settings=None if source.is_live else RecordsSettings.of(config, source),  # and these
        earlier_video=(config.output_path(EARLIER_VIDEO, source.name)
                       if output.video is None else None),
    )


def analytics_regions(config: PipelineConfig, class_names: list[str] | None, num_classes: int,
                      frame_sizes: dict[int, tuple[int, int] | None]) -> dict[str, list[Region]]:
    """Each source's zones and lines (only sources that have some), resolved against the
    model's classes.

    Args:
        frame_sizes: source position -> the (width, height) probed from its file, or None;
            a camera's size is known at its first frame only (the analytics stage checks it
            then, and leaves a region outside the frame out with an error in the log).

    Raises:
        ConfigError: a class the model does not have, or a region outside a file's frame.
    """
    regions: dict[str, list[Region]] = {}
    for i, source in enumerate(config.sources):
        found = [Region.from_config(f"sources[{i}].analytics[{k}]", region, source, class_names,
                                    num_classes)
                 for k, region in enumerate(source.analytics or ())]
        size = frame_sizes.get(i)
        for region in found if size is not None else ():
            if (reason := region.frame_error(*size)) is not None:
                raise ConfigError(f"{reason} of source {source.name!r}")
        if found:
            regions[source.name] = found
    return regions


def create_publisher(config: PipelineConfig, sources: list[str]) -> MqttPublisher | None:
    """The MQTT publisher of the analytics of ``sources`` when ``output.mqtt`` is set, else
    None (paho-mqtt is imported only then). Not started: ``graph.add_service`` starts it."""
    if config.output.mqtt is None:
        return None
    if not sources:
        log.warning("output.mqtt is set but no source has analytics: nothing to publish")
        return None
    from pipeline.app.mqtt import MqttPublisher

    return MqttPublisher(config.output.mqtt, sources)


def create_event_media(config: PipelineConfig, sources: list[str]) -> EventMedia | None:
    """The event media (``output.event_media``) of the sources with analytics, or None
    when it is not set or no source has analytics. Not started: ``graph.add_service``
    starts it; sources join it as their sinks are built."""
    if config.output.event_media is None:
        return None
    if not sources:
        log.warning("output.event_media is set but no source has analytics: no events")
        return None
    return EventMedia(config.output.event_media)


def create_webhooks(config: PipelineConfig, sources: list[str]) -> WebhookPublisher | None:
    """The publisher of the analytics events to ``output.webhooks`` when any is set and
    ``sources`` (those with analytics) is not empty, else None. Not started:
    ``graph.add_service`` starts it."""
    if not config.output.webhooks:
        return None
    if not sources:
        log.warning("output.webhooks is set but no source has analytics: nothing to send")
        return None
    from pipeline.app.webhooks import WebhookPublisher

    return WebhookPublisher(config.output.webhooks)


def check_extras(config: PipelineConfig) -> None:
    """Raise ``ConfigError`` (one line) when a feature the config asks for needs a package of
    an extra that is not installed: the base install is what the CPU demo needs."""
    import importlib.util

    wants = [(f"sources[{i}].tracker", "trackers", "analytics")
             for i, s in enumerate(config.sources) if s.tracker != "none"]
    wants += [(f"sources[{i}].analytics", "supervision", "analytics")
              for i, s in enumerate(config.sources) if s.analytics]
    if config.output.mqtt is not None:
        wants.append(("output.mqtt", "paho", "analytics"))
    if config.output.webhooks:
        wants.append(("output.webhooks", "httpx", "analytics"))
    if config.runtime.http is not None:
        wants += [("runtime.http", "starlette", "live"), ("runtime.http", "uvicorn", "live")]
    for key, module, extra in wants:
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"{key}: needs the Python package {module!r}, which is not "
                              f"installed: {install_hint(extra)}")


def host_outputs_reason(config: PipelineConfig) -> str | None:
    """Why ``config``'s outputs need every frame in host memory (so no source decodes on
    NVDEC), or None when they do not."""
    if config.output.video is not None:
        return "output.video needs the frames on the host"
    media = config.output.event_media
    if media is not None and media.clip is not None:  # a ring of recent frames (no recording)
        return "output.event_media.clip needs the frames on the host"
    return None


def decoder_kind(config: PipelineConfig, source: SourceConfig, key: str,
                 gpu: GpuContext | None, host_frames: bool = False) -> str:
    """Where ``source`` is decoded: "gpu" (NVDEC) or "cpu" (its ``decode``; ``key``: its
    name in messages, ``sources[i]``). ``host_frames``: the Python API hands the frames'
    pictures over (``Pipeline(frames=...)``), from host memory: never NVDEC.

    Raises:
        DeviceUnavailable: ``decode: gpu`` was asked for and cannot run (the message says why).
    """
    if source.decode == "cpu":
        return "cpu"
    reason = ("inference does not run on the GPU" if gpu is None else
              "the Python API's frames are handed over from host memory" if host_frames else
              host_outputs_reason(config) or gpu_decode_unavailable_reason())
    if reason is None:
        return "gpu"
    if source.decode == "gpu":
        raise DeviceUnavailable(f"{key}.decode: 'gpu' cannot be used: {reason}")
    return "cpu"
