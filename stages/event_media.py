"""Event media: a JPEG snapshot and an MP4 clip per analytics event (``output.event_media``).

```
analytics stage (its thread)                         event-media thread (one)
  observe(batch, events):                              bounded queue (queue_size jobs)
    snapshot: copy the event frame's pixels ───job──>  I420 or NV12 -> BGR, box highlighted,
    clip, source with output.video: when the             [crop], JPEG -> <dir>/<id>.jpg,
      source passes event + post_s ────────────job──>    MQTT <prefix>/<source>/<region>/snapshot
    clip, source without: copy every frame into        stream copy of whole GOPs from the
      a ring (pre_s, ring_mb); the event's frames ─job─>   recording (PyAV, no encoder), or
      up to post_s ──────────────────────────────────>   encode the ring's frames (x264)
    event.snapshot / event.clip = the paths            -> <dir>/<id>.mp4
```

Where it goes: ``<dir>`` is the events file's path less ``.jsonl`` (``bikes.events.jsonl`` ->
``bikes.events/``), and an event's record names its files relative to the events file's folder
(``"snapshot": "bikes.events/20261130T231501.234Z-26-enter-kerb-0.jpg"``); the id is the
event frame's UTC capture time, frame, kind, region and track. Every file is written under a
``.partial`` name and renamed when complete: a file with the final name is whole. The paths
go into the record when the event happens (the events file, MQTT and webhooks carry them at
once); the snapshot follows within moments, the clip once ``post_s`` of video has passed (and,
from a recording, its next keyframe: up to ``sinks.FRAGMENT_S`` later).

Never in the way (the pipeline's thread only copies and appends):

- Every event is kept and passed on. An event whose media finds ``queue_size`` jobs waiting
  (snapshots, clips waiting for their frames or being made, all sources) gets none: its record
  has no ``snapshot`` or ``clip``, and ``dropped`` counts it. A job that fails (a recording
  that takes no frame for ``RECORDING_WAIT_S`` and does not yet hold the clip's frames, a
  write error) is logged once per kind and counted in ``failed``.
- The snapshot is taken from the frame's own pixels, copied in the analytics stage while the
  pipeline still holds its slot (``keep_images``), or downloaded from an NVDEC frame's
  pictures: one copy per frame that has events.
- A clip from the recording is whole GOPs (a keyframe every ``sinks.FRAGMENT_S``) from the last
  keyframe at or before ``pre_s`` before the event to the first one after ``post_s`` after it,
  copied packet for packet (no decoding). A source without a recording keeps copies of its
  recent I420 frames (at most ``pre_s`` and ``ring_mb``; a clip's frames up to ``post_s`` are
  shared with it) and encodes them with x264 in this thread.
- A clip's MP4 says where it starts in its source in its ``comment`` metadata (JSON:
  ``{"event", "start_frame", "start_pts"}``: the frame number and stream time of its first
  frame), and its timestamps start at 0.

Frames decoded on the GPU (NVDEC) have no host pixels. Their batches keep the decoder's
pictures (``FrameBatch.device_pictures``) while snapshots are on, and a frame with events is
downloaded once (NV12, ``stages.gpu_decode.download_nv12``): snapshots alone leave the
cameras on NVDEC. A clip without a recording needs every frame in the ring: ``clip`` makes
the build decode on the CPU, as ``output.video`` does (``pipeline.app.build.decoder_kind``).
"""

from __future__ import annotations

import json
import math
import os
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from typing import Any, Protocol

import av
import cv2
import numpy as np
import structlog

from pipeline.config import ClipConfig, EventMediaConfig, partial_path
from pipeline.records import AnalyticsEvent, BatchDetections
from stages.gpu_decode import download_nv12

log = structlog.get_logger("event_media")

HIGHLIGHT_BGR = (0, 255, 0)  # the event's box in its snapshot: pure green
DEFAULT_RATE = Fraction(25)
RECORDING_WAIT_S = 30.0  # wall seconds a clip waits for its recording to be written to
RETRY_S = 0.25  # between looks at a recording that does not hold a clip's frames yet
RETENTION_EVERY_S = 600.0
CLOSE_WAIT_S = 20.0  # the longest close() waits for the jobs still queued
_MEDIA_NAME = re.compile(r"\d{8}T\d{6}\.\d{3}Z-.+?(\.partial)?\.(jpg|mp4)")


class SnapshotPublisher(Protocol):
    """Where snapshots go besides the file (``pipeline.app.mqtt.MqttPublisher``)."""

    def publish_snapshot(self, source: str, region: str, jpeg: bytes) -> None: ...


class RecordingWriter(Protocol):
    """A source's recording as the media reads it (``stages.sinks.VideoWriter``)."""

    path: Path
    rate: Fraction
    closed: bool
    frames: int  # frames written so far

    @property
    def first_index(self) -> int: ...


class RecordingSource(Protocol):
    """A source's sink, asked where a frame is recorded (``stages.sinks.SinkStage``)."""

    video_path: Path | None

    def recording_of(self, frame: int) -> RecordingWriter | None: ...


def event_id(event: AnalyticsEvent) -> str:
    """``20261130T231501.234Z-26-enter-kerb-0``: the event frame's UTC capture time (to the
    millisecond), frame, kind, region and track id; unique within a source across runs."""
    seconds = math.floor(event.capture_time)
    millis = min(999, int((event.capture_time - seconds) * 1000))
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(seconds))
    return f"{stamp}.{millis:03d}Z-{event.frame}-{event.kind}-{event.region}-{event.tracker_id}"


def media_dir(events_path: Path) -> Path:
    """The folder of a source's event media: its events file less ``.jsonl``."""
    return events_path.with_suffix("") if events_path.suffix == ".jsonl" else \
        events_path.with_name(events_path.name + ".media")


def highlight_thickness(width: int, height: int) -> int:
    """The highlight's line width in pixels for a frame size (at least 3)."""
    return max(3, round(min(width, height) / 120))


def snapshot_jpeg(image: np.ndarray, width: int, height: int,
                  box: Sequence[float], label: str, crop: bool = False, quality: int = 90,
                  pixel_format: str = "i420") -> tuple[bytes, tuple[int, int]]:
    """The JPEG of one frame with ``box`` outlined in ``HIGHLIGHT_BGR`` (the line centred on
    the box's edges, ``highlight_thickness`` wide) and ``label`` above it.

    Args:
        image: (height * 3 // 2, width) uint8 host array (not modified): I420 (the Y plane,
            then U, then V), or NV12 (the Y plane, then interleaved UV rows) with
            ``pixel_format`` "nv12".
        box: x1, y1, x2, y2 in frame pixels.
        crop: keep only the box and as much again around it (half its size each side, at
            least 32 pixels), within the frame.

    Returns:
        (JPEG bytes, (x, y) of the picture's top-left corner in the frame: (0, 0) uncropped).
    """
    bgr = cv2.cvtColor(np.ascontiguousarray(image).reshape(height * 3 // 2, width),
                       cv2.COLOR_YUV2BGR_NV12 if pixel_format == "nv12" else cv2.COLOR_YUV2BGR_I420)
    x1, y1, x2, y2 = (int(round(float(v))) for v in box)
    thickness = highlight_thickness(width, height)
    cv2.rectangle(bgr, (x1, y1), (x2, y2), HIGHLIGHT_BGR, thickness)
    scale = max(0.4, min(width, height) / 900)
    (text_w, text_h), base = cv2.getTextSize(label, cv2.FONT_HERSHEY_SIMPLEX, scale, 1)
    # above the box; where the box touches the frame's top, inside it (as the video's labels)
    bottom = (y1 - thickness if y1 - thickness - text_h - base >= 0
              else min(height, y1 + thickness + text_h + base))
    top = bottom - text_h - base
    cv2.rectangle(bgr, (x1, top), (x1 + text_w + 4, bottom), HIGHLIGHT_BGR, -1)
    cv2.putText(bgr, label, (x1 + 2, bottom - base), cv2.FONT_HERSHEY_SIMPLEX, scale,
                (0, 0, 0), 1, cv2.LINE_AA)
    origin = (0, 0)
    if crop:
        pad_x, pad_y = max(32, (x2 - x1) // 2), max(32, (y2 - y1) // 2)
        left, up = max(0, x1 - pad_x), max(0, min(y1, top) - pad_y)
        right, down = min(width, x2 + pad_x), min(height, max(y2, bottom) + pad_y)
        bgr, origin = bgr[up:down, left:right], (left, up)
    ok, data = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, int(quality)])
    if not ok:
        raise ValueError("JPEG encoding failed")
    return data.tobytes(), origin


def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """``write`` the file under its ``.partial`` name, then rename it to ``path``."""
    partial = partial_path(path)
    try:
        write(partial)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def cut_recording(source: Path, target: Path, start_s: float, end_s: float, complete: bool,
                  describe: Callable[[float], dict[str, Any]]) -> tuple[float, int] | None:
    """Copy the whole GOPs of ``source`` (an MP4, maybe still being written) that cover
    video times ``start_s`` .. ``end_s`` into ``target``, packet for packet (no decoding),
    timestamps from 0.

    Args:
        start_s, end_s: video times from the recording's first frame (the muxer may start
            its timestamps later, past B-frame delay: ``start_time`` is taken off).
        complete: ``source`` grows no more: take what it holds; else wait (None) until it
            holds a keyframe after ``end_s`` (the GOPs before it are then whole).
        describe: the clip's ``comment`` metadata (JSON) given the video time of its first
            frame.

    Returns:
        (the video time of the clip's first frame, its packets), or None: not there yet.
    """
    with av.open(str(source)) as recording:
        stream = recording.streams.video[0]
        origin = float(stream.start_time * stream.time_base) if stream.start_time else 0.0
        start_s, end_s = start_s + origin, end_s + origin
        found = _gops(recording, stream, start_s, end_s, seek=start_s > origin)
        if found is not None and found[0] > start_s > origin:  # the seek went past it: read all
            recording.seek(0, stream=stream, backward=True)
            found = _gops(recording, stream, start_s, end_s, seek=False)
        if found is None or not (found[2] or complete):
            return None
        first_key, chosen, _ = found
        first_key -= origin
        offset = min(p.dts for p in chosen)

        def write(path: Path) -> None:
            with av.open(str(path), "w", format="mp4") as clip:
                clip.metadata["comment"] = json.dumps(describe(first_key))
                out = clip.add_stream_from_template(stream)
                for packet in chosen:
                    packet.pts -= offset
                    packet.dts -= offset
                    packet.stream = out
                    clip.mux(packet)

        _write_atomic(target, write)
        return first_key, len(chosen)


def _gops(recording: Any, stream: Any, start_s: float, end_s: float, seek: bool
          ) -> tuple[float, list[Any], bool] | None:
    """The packets (decode order) from the last keyframe at or before ``start_s`` (or the
    first one read) to the first keyframe after ``end_s``: (the first one's video time, the
    packets, whether that later keyframe was read); None without any packet (also a
    recording whose first fragment is not written yet, where even a seek fails)."""
    base = stream.time_base
    if seek:
        try:
            recording.seek(int(start_s / base), stream=stream, backward=True)
        except av.FFmpegError:
            try:
                recording.seek(0, stream=stream, backward=True)
            except av.FFmpegError:  # no fragment written yet (FFmpeg says EPERM): not there
                return None
    chosen: list[Any] = []
    first_key: float | None = None
    try:
        for packet in recording.demux(stream):
            if packet.pts is None or packet.dts is None:
                continue
            t = float(packet.pts * base)
            if packet.is_keyframe:
                if t > end_s and first_key is not None:
                    return first_key, chosen, True
                if t <= start_s or first_key is None:
                    chosen, first_key = [], t
            if first_key is not None:
                chosen.append(packet)
    except av.FFmpegError:
        pass  # a fragment being written: what came before it is whole
    return None if first_key is None else (first_key, chosen, False)


def encode_clip(target: Path, frames: Sequence[RingFrame], rate: Fraction,
                comment: dict[str, Any]) -> int:
    """Encode ``frames`` (in frame order) to an H.264 MP4 at ``target`` (x264 veryfast,
    yuv420p), each timed by its frame number from the first one's at ``rate`` (a dropped
    frame keeps its time); frames of another size than the first are scaled to it.
    Returns the frames written."""

    def write(path: Path) -> None:
        first = frames[0]
        with av.open(str(path), "w", format="mp4") as clip:
            clip.metadata["comment"] = json.dumps(comment)
            stream = clip.add_stream("libx264", rate=rate)
            stream.width, stream.height, stream.pix_fmt = first.width, first.height, "yuv420p"
            stream.time_base = 1 / rate
            stream.options = {"crf": "23", "preset": "veryfast"}
            last = -1
            for frame in frames:
                picture = av.VideoFrame.from_ndarray(frame.image, format="yuv420p")
                if (frame.width, frame.height) != (first.width, first.height):
                    picture = picture.reformat(width=first.width, height=first.height)
                picture.pts = last = max(last + 1, frame.index - first.index)
                clip.mux(stream.encode(picture))
            clip.mux(stream.encode(None))

    _write_atomic(target, write)
    return len(frames)


@dataclass(frozen=True)
class RingFrame:
    """One frame kept for clips.

    Attributes:
        index: its frame number; t: its stream time in seconds; pts: its pts (NaN: none).
        image: (height * 3 // 2, width) uint8 I420 host array, a copy of its own.
    """

    index: int
    t: float
    pts: float
    image: np.ndarray
    width: int
    height: int


@dataclass
class _Clip:
    """A clip waiting for its frames (or being made)."""

    source: str
    event: AnalyticsEvent
    path: Path
    t: float  # the event's stream time
    rate: Fraction
    frames: list[RingFrame] | None = None  # ring mode: its frames so far
    deadline: float = 0.0  # recording mode: monotonic time it gives up at
    recorded: int = 0  # recording mode: its recording's frames at the last look


@dataclass
class _Snapshot:
    """A snapshot to make: ``image`` is the event frame's (height * 3 // 2, width) uint8
    host copy, in ``pixel_format`` ("i420", or "nv12" downloaded from an NVDEC frame)."""

    source: str
    event: AnalyticsEvent
    path: Path
    image: np.ndarray
    width: int
    height: int
    pixel_format: str = "i420"


@dataclass
class _Source:
    """What the media knows of one source."""

    folder: Path
    sink: RecordingSource | None
    ring: deque[RingFrame] = field(default_factory=deque)
    ring_bytes: int = 0
    pending: list[_Clip] = field(default_factory=list)  # clips collecting later frames

    @property
    def ring_mode(self) -> bool:
        """Its clips come from a ring of copies: it has no recording."""
        return self.sink is None or self.sink.video_path is None


@dataclass(frozen=True)
class EventMediaStats:
    """Counts since the start: files written, events whose media was dropped (queue full),
    jobs that failed, and jobs waiting now."""

    snapshots: int
    clips: int
    dropped: int
    failed: int
    waiting: int


class EventMedia:
    """The snapshots and clips of every source's events (module docstring).

    ``observe`` and ``end`` run in the analytics stage's thread; ``start`` and ``close`` are
    the graph's service calls; ``stats`` any thread.

    Args:
        config: ``output.event_media``.
        publishers: each snapshot also goes to these (MQTT's retained snapshot topic).
        clock: wall time, for retention (Unix seconds).
    """

    def __init__(self, config: EventMediaConfig,
                 publishers: Sequence[SnapshotPublisher] = (),
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clip: ClipConfig | None = config.clip
        self.publishers = tuple(publishers)
        self.clock = clock
        self._sources: dict[str, _Source] = {}
        self._jobs: queue.Queue[_Snapshot | _Clip | None] = queue.Queue()
        self._lock = threading.Lock()
        self._outstanding = 0
        self.snapshots = self.clips = self.dropped = self.failed = 0
        self._failures_logged: set[str] = set()
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._retained_at = -math.inf

    # -- wiring ----------------------------------------------------------------------------
    def add_source(self, source: str, events_path: Path, sink: RecordingSource | None) -> None:
        """Make media for ``source`` (a source with analytics), beside ``events_path``; its
        clips come from ``sink``'s recording when it writes video, else from a ring. Any
        thread, before the source's first frame."""
        folder = media_dir(events_path)
        self._sources = {**self._sources, source: _Source(folder, sink)}

    def start(self) -> None:
        """Start the media thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="event-media", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Make what is queued (the sources ended: recordings are final now), for up to
        ``CLOSE_WAIT_S``, stop the thread and log the summary (``event media summary``, with
        the sources it made media for) when a source joined (``add_source``): a source worker
        that never ran a source with analytics (with ``runtime.workers: 2``, the other worker
        and the spare) made none, and its line of zeros read as the run's real count."""
        if self._closing.is_set():
            return
        for name in list(self._sources):
            self.end(name)
        self._closing.set()
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join(CLOSE_WAIT_S)
            if self._thread.is_alive():
                log.warning("event media still working at close; left unfinished")
        if not self._sources:
            return
        stats = self.stats()
        log.info("event media summary", snapshots=stats.snapshots, clips=stats.clips,
                 dropped=stats.dropped, failed=stats.failed, unfinished=stats.waiting,
                 sources=sorted(self._sources))

    def stats(self) -> EventMediaStats:
        with self._lock:
            return EventMediaStats(self.snapshots, self.clips, self.dropped, self.failed,
                                   self._outstanding)

    # -- the analytics stage's thread -------------------------------------------------------
    def observe(self, item: BatchDetections, events: list[AnalyticsEvent]
                ) -> list[AnalyticsEvent]:
        """One batch (every batch, in order): keep ring frames, hand due clips over, and
        start the media of ``events`` (of this batch). Returns the events, each with its
        ``snapshot`` and ``clip`` paths when its media was taken on."""
        frames = item.frames
        sources = self._sources
        taken: dict[int, AnalyticsEvent] = {}  # position in ``events`` -> with its media
        on_frame: dict[tuple[str, int], list[int]] = {}
        for k, event in enumerate(events):
            on_frame.setdefault((event.source, event.frame), []).append(k)
        for row, (index, pts) in enumerate(zip(frames.index.tolist(), frames.pts.tolist())):
            name = frames.source_name(row)
            state = sources.get(name)
            if state is None:
                continue
            rate = frames.rates[row] or DEFAULT_RATE
            t = pts if pts == pts else index / float(rate)
            if self.clip is not None and state.ring_mode:
                self._keep(state, frames.images[row], index, t, pts,
                           int(frames.width[row]), int(frames.height[row]))
            self._due(name, state, t)
            copy: list[np.ndarray] = []  # the frame's one copy, for its snapshots
            for k in on_frame.get((name, index), ()):
                taken[k] = self._take(events[k], state, item, row, copy)
        return [taken.get(k, event) for k, event in enumerate(events)]

    def end(self, source: str) -> None:
        """``source`` ended: its clips waiting for later frames are made with what there is."""
        state = self._sources.get(source)
        if state is not None:
            self._due(source, state, math.inf)

    def _keep(self, state: _Source, image: np.ndarray | None, index: int, t: float,
              pts: float, width: int, height: int) -> None:
        """Copy a frame into the source's ring and its clips collecting frames."""
        if image is None:
            return
        assert self.clip is not None
        frame = RingFrame(index, t, pts, np.array(image, copy=True), width, height)
        state.ring.append(frame)
        state.ring_bytes += frame.image.nbytes
        limit = self.clip.ring_mb * 2**20
        while state.ring and (state.ring_bytes > limit or state.ring[0].t < t - self.clip.pre_s):
            state.ring_bytes -= state.ring.popleft().image.nbytes
        for clip in state.pending:
            if clip.frames is not None and t <= clip.t + self.clip.post_s:
                clip.frames.append(frame)

    def _due(self, source: str, state: _Source, t: float) -> None:
        """Hand over the clips whose last frame (event + post_s) is at or before ``t``."""
        if not state.pending or self.clip is None:
            return
        keep = []
        for clip in state.pending:
            if t > clip.t + self.clip.post_s or math.isinf(t):
                clip.deadline = time.monotonic() + RECORDING_WAIT_S
                self._jobs.put(clip)
            else:
                keep.append(clip)
        state.pending = keep

    def _take(self, event: AnalyticsEvent, state: _Source, item: BatchDetections, row: int,
              copy: list[np.ndarray]) -> AnalyticsEvent:
        """Start the media of one event, or drop it (queue full): the event, with its paths."""
        frames = item.frames
        image = frames.images[row]
        device = None if frames.device_pictures is None else frames.device_pictures[row]
        snapshot = self.config.snapshot and (image is not None or device is not None)
        clip = self.clip is not None
        needed = snapshot + clip
        if not needed:
            return event
        with self._lock:
            if self._outstanding + needed > self.config.queue_size:
                self.dropped += 1
                return event
            self._outstanding += needed
        name = event_id(event)
        state.folder.mkdir(parents=True, exist_ok=True)
        relative = state.folder.name
        changes: dict[str, str] = {}
        if snapshot:
            if not copy:  # the host pixels, else one download of the NVDEC frame's
                copy.append(np.array(image, copy=True) if image is not None
                            else download_nv12(*device))
            path = state.folder / f"{name}.jpg"
            self._jobs.put(_Snapshot(event.source, event, path, copy[0],
                                     int(frames.width[row]), int(frames.height[row]),
                                     "i420" if image is not None else "nv12"))
            changes["snapshot"] = f"{relative}/{path.name}"
        if clip:
            assert self.clip is not None
            rate = frames.rates[row] or DEFAULT_RATE
            pts = frames.pts[row]
            t = float(pts) if pts == pts else event.frame / float(rate)
            path = state.folder / f"{name}.mp4"
            low, high = t - self.clip.pre_s, t + self.clip.post_s
            job = _Clip(event.source, event, path, t, rate,
                        [f for f in state.ring if low <= f.t <= high] if state.ring_mode
                        else None)
            state.pending.append(job)
            changes["clip"] = f"{relative}/{path.name}"
        return replace(event, **changes)

    # -- the media thread -------------------------------------------------------------------
    def _run(self) -> None:
        waiting: list[_Clip] = []  # clips whose recording does not hold their frames yet
        while True:
            self._retention()
            try:
                job = self._jobs.get(timeout=RETRY_S if waiting else 1.0)
            except queue.Empty:
                job = None
                if self._closing.is_set() and not waiting:
                    return
            if job is not None:
                self._do(job, waiting)
            elif self._closing.is_set() and self._jobs.empty():
                for clip in waiting:  # the recordings are final: take what they hold
                    self._do(clip, [], final=True)
                return
            for clip in list(waiting):
                waiting.remove(clip)
                self._do(clip, waiting)

    def _do(self, job: _Snapshot | _Clip, waiting: list[_Clip], final: bool = False) -> None:
        """Make one job; a recording clip whose frames are not written yet goes to
        ``waiting`` (until its deadline)."""
        kind = "snapshot" if isinstance(job, _Snapshot) else "clip"
        try:
            if isinstance(job, _Snapshot):
                self._snapshot(job)
            elif not self._clip(job, final) and not final and (
                    time.monotonic() < job.deadline or self._recording_moved(job)):
                waiting.append(job)
                return
            elif not job.path.exists():
                raise TimeoutError("the recording never held the clip's frames")
        except Exception as error:  # noqa: BLE001 - a job's failure never stops the run
            with self._lock:
                self.failed += 1
            if kind not in self._failures_logged:
                self._failures_logged.add(kind)
                log.warning(f"event {kind} failed (logged once per kind)", source=job.source,
                            path=str(job.path), error=f"{type(error).__name__}: {error}")
        with self._lock:
            self._outstanding -= 1
            if job.path.exists():
                if kind == "snapshot":
                    self.snapshots += 1
                else:
                    self.clips += 1

    def _snapshot(self, job: _Snapshot) -> None:
        event = job.event
        label = (f"{event.kind} {event.region} #{event.tracker_id} "
                 f"{event.class_name or event.class_id}")
        data, _ = snapshot_jpeg(job.image, job.width, job.height, event.xyxy, label,
                                self.config.crop, self.config.jpeg_quality, job.pixel_format)
        _write_atomic(job.path, lambda path: path.write_bytes(data))
        for publisher in self.publishers:
            publisher.publish_snapshot(job.source, event.region, data)

    def _clip(self, job: _Clip, final: bool) -> bool:
        """Make the clip; False when its recording does not hold its frames yet."""
        assert self.clip is not None
        event = job.event
        comment: dict[str, Any] = {"event": job.path.stem}
        if job.frames is not None:
            if not job.frames:
                raise ValueError("no frame of the clip was kept")
            first = job.frames[0]
            comment.update(start_frame=first.index,
                           start_pts=None if first.pts != first.pts else first.pts)
            encode_clip(job.path, job.frames, job.rate, comment)
            job.frames = None  # its frames go back
            return True
        writer = self._recording(job)
        if writer is None:
            return False
        rate = float(writer.rate)
        event_video_s = (event.frame - writer.first_index) / rate

        def describe(start_video_s: float) -> dict[str, Any]:
            start_pts = None if event.pts is None else \
                round(event.pts - (event_video_s - start_video_s), 6)
            return {**comment, "start_frame": writer.first_index + round(start_video_s * rate),
                    "start_pts": start_pts}

        complete = final or writer.closed
        source = writer.path if writer.path.exists() else partial_path(writer.path)
        if not source.exists():
            source = writer.path  # renamed meanwhile
        return cut_recording(source, job.path, event_video_s - self.clip.pre_s,
                             event_video_s + self.clip.post_s, complete, describe) is not None

    def _recording(self, job: _Clip) -> RecordingWriter | None:
        """The recording that holds (or will hold) ``job``'s event frame, None when none yet."""
        sink = self._sources[job.source].sink
        return sink.recording_of(job.event.frame) if sink is not None else None

    def _recording_moved(self, job: _Clip) -> bool:
        """Whether ``job``'s recording took frames since the last look; if so its wait starts
        again (``RECORDING_WAIT_S``): on a slow machine the encoder can take longer than that to
        reach a clip's frames while it is still on its way; a recording that stalls (its
        writer failed) gives its clips up."""
        writer = self._recording(job)
        if writer is None or writer.closed or writer.frames <= job.recorded:
            return False
        job.recorded = writer.frames
        job.deadline = time.monotonic() + RECORDING_WAIT_S
        return True

    def _retention(self) -> None:
        """Delete media files (``_MEDIA_NAME``) older than ``keep_hours``, every
        ``RETENTION_EVERY_S``."""
        keep_hours = self.config.keep_hours
        now = time.monotonic()
        if keep_hours is None or now - self._retained_at < RETENTION_EVERY_S:
            return
        self._retained_at = now
        oldest = self.clock() - keep_hours * 3600
        for state in list(self._sources.values()):
            if not state.folder.is_dir():
                continue
            for path in state.folder.iterdir():
                try:
                    if _MEDIA_NAME.fullmatch(path.name) and path.stat().st_mtime < oldest:
                        path.unlink()
                        log.info("old event media deleted", path=str(path))
                except OSError:
                    continue
