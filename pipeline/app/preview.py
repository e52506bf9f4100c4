"""The live view's pictures: the latest annotated frame of each source, kept only while
someone watches it, and encoded to JPEG by the HTTP server's threads.

```
sink thread (per source)                          HTTP server threads (per request)
  SinkStage.process(part)                           snapshot.jpg / stream.mjpg
    hub.offer_part(part, annotated)  --latest-->      hub.jpeg(source): I420 -> BGR -> JPEG,
      counts the frames; when watched and at           once per kept picture (cached), at
      most preview_fps: copies ONE picture             most preview_fps per source
  SinkStage.end_of_stream(eos)
    hub.end(source, error)
```

The sink side pays, per batch part: a dict lookup and a few attribute writes under a lock
held for microseconds (never an encode, never a wait on a viewer). Only while a viewer
wants the source (an open MJPEG stream, or a snapshot asked for in the last
``WANT_WINDOW_S`` seconds) does it also copy the part's last picture, at most
``preview_fps`` times a second: the frame's image is a view of a ring slot the sink hands
back right after, so a reference would not survive it. A frame that was not annotated
(``output.video`` off: no annotate stage) gets its boxes drawn on the copy, at encode time,
with ``stages.annotate.draw_detections``. A GPU-decoded frame has no host image: its source
counts frames but has no picture.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import cv2
import numpy as np

from pipeline.records import BatchDetections, Detections
from stages.annotate import draw_detections

WANT_WINDOW_S = 5.0  # a snapshot request keeps its source's pictures coming this long
JPEG_QUALITY = 80


@dataclass
class SourceActivity:
    """What the sink side reported for one source (a copy: safe to read anywhere).

    Attributes:
        frames: frames that reached the sink (every frame of every offered part).
        last_capture_time: wall-clock ``time.time()`` capture time of the latest frame, or
            None before the first.
        last_frame_at: ``time.monotonic()`` when the latest frame reached the sink, or None.
        picture_seq: number of the latest kept picture (0: none kept yet).
        width, height: that picture's size in pixels (0 when none).
        ended: the source's stream ended (``end`` was called).
        error: why it ended early, or None.
    """

    frames: int = 0
    last_capture_time: float | None = None
    last_frame_at: float | None = None
    picture_seq: int = 0
    width: int = 0
    height: int = 0
    ended: bool = False
    error: str | None = None


@dataclass
class _Source:
    """Per-source state; every field is guarded by the hub's lock, except ``encode_lock``
    and the JPEG cache it guards."""

    activity: SourceActivity = field(default_factory=SourceActivity)
    viewers: int = 0
    wanted_until: float = 0.0
    kept_at: float = float("-inf")
    picture: np.ndarray | None = None  # (height * 3 // 2, width) uint8 I420, our own copy
    detections: Detections | None = None  # to draw at encode time (picture not annotated)
    encode_lock: threading.Lock = field(default_factory=threading.Lock)
    jpeg_seq: int = 0
    jpeg: bytes = b""


class PreviewHub:
    """Latest pictures of every source for the live view (see the module docstring).

    Args:
        preview_fps: most pictures kept (and so encoded) per second and source, > 0.
        class_names: names indexed by class id, for boxes drawn on frames that were not
            annotated; None prints ids.
        jpeg_quality: cv2's JPEG quality, 0..100.
    """

    def __init__(self, preview_fps: float = 5.0, class_names: list[str] | None = None,
                 jpeg_quality: int = JPEG_QUALITY) -> None:
        if preview_fps <= 0:
            raise ValueError(f"preview_fps must be > 0, got {preview_fps}")
        self.preview_fps = preview_fps
        self.period_s = 1.0 / preview_fps
        self.class_names = class_names
        self.jpeg_quality = jpeg_quality
        self._lock = threading.Lock()
        self._sources: dict[str, _Source] = {}

    def _source(self, name: str) -> _Source:
        """The state of ``name``, created on first use; the caller holds ``_lock``."""
        state = self._sources.get(name)
        if state is None:
            state = self._sources[name] = _Source()
        return state

    # -- the sink side ------------------------------------------------------------------
    def offer(self, source: str, image: np.ndarray | None, width: int, height: int,
              capture_time: float, detections: Detections | None = None,
              annotated: bool = True, frames: int = 1) -> None:
        """Report frames of ``source`` that reached its sink; keep a copy of ``image`` when a
        viewer wants the source and the last kept one is at least ``1 / preview_fps`` old.
        Never encodes, never waits on a viewer; call it before the image's slot is released.

        Args:
            source: the source's name.
            image: the latest of these frames as a (height * 3 // 2, width) uint8 I420 host
                array (a view of a ring slot is fine: it is copied), or None when there is no
                host image (decoded on the GPU).
            width, height: its size in pixels.
            capture_time: its wall-clock capture time (``time.time()``).
            detections: its detections (host arrays, frame pixels), drawn on the copy when
                ``annotated`` is False; None draws nothing.
            annotated: the image already shows its detections (the annotate stage ran).
            frames: how many frames this call reports (a batch part's length).
        """
        now = time.monotonic()
        with self._lock:
            state = self._source(source)
            activity = state.activity
            activity.frames += frames
            activity.last_capture_time = capture_time
            activity.last_frame_at = now
            keep = (image is not None and (state.viewers > 0 or now < state.wanted_until)
                    and now - state.kept_at >= self.period_s)
            if keep:
                state.kept_at = now  # claimed: a concurrent offer of this source keeps none
        if not keep:
            return
        picture = np.array(image, dtype=np.uint8, copy=True)  # outside the lock: ~1 ms at 1080p
        drawn = None
        if not annotated and detections is not None and len(detections):
            drawn = Detections(np.array(detections.xyxy, np.float32),
                               np.array(detections.confidence, np.float32),
                               np.array(detections.class_id, np.int32),
                               None if detections.tracker_id is None
                               else np.array(detections.tracker_id, np.int64))
        with self._lock:
            state.picture, state.detections = picture, drawn
            activity.picture_seq += 1
            activity.width, activity.height = width, height

    def offer_part(self, part: BatchDetections, annotated: bool) -> None:
        """``offer`` a sink's batch part (one source's frames, in frame order): every frame
        counts, the last one with a host image is the picture. O(1) in the part's length
        except for finding that frame.

        Args:
            part: the part, as the sink gets it; its images must still be valid (call before
                the sink releases their slots).
            annotated: its images show their detections (``output.video`` on: the annotate
                stage drew them).
        """
        frames = part.frames
        count = len(frames)
        if not count:
            return
        row = count - 1
        while row > 0 and frames.images[row] is None:
            row -= 1
        self.offer(frames.source_name(row), frames.images[row], int(frames.width[row]),
                   int(frames.height[row]), float(frames.capture_time[count - 1]),
                   part[row] if not annotated else None, annotated, count)

    def end(self, source: str, error: str | None = None) -> None:
        """``source``'s stream ended (``error``: why, when it failed)."""
        with self._lock:
            activity = self._source(source).activity
            activity.ended, activity.error = True, error

    # -- the viewer side ----------------------------------------------------------------
    def activity(self, source: str) -> SourceActivity:
        """A copy of what the sink side reported for ``source`` (zeros before anything)."""
        with self._lock:
            state = self._sources.get(source)
            return SourceActivity() if state is None else SourceActivity(**vars(state.activity))

    def wanted(self, source: str) -> bool:
        """Whether ``source``'s pictures are being kept now (a viewer wants them)."""
        with self._lock:
            state = self._sources.get(source)
            return state is not None and (state.viewers > 0
                                          or time.monotonic() < state.wanted_until)

    def request(self, source: str) -> None:
        """A snapshot was asked for: keep ``source``'s pictures coming for ``WANT_WINDOW_S``."""
        with self._lock:
            self._source(source).wanted_until = time.monotonic() + WANT_WINDOW_S

    @contextmanager
    def watching(self, source: str) -> Iterator[None]:
        """An open stream of ``source``: its pictures are kept while the block runs."""
        with self._lock:
            self._source(source).viewers += 1
        try:
            yield
        finally:
            with self._lock:
                self._source(source).viewers -= 1

    def viewers(self, source: str) -> int:
        """Open streams of ``source`` now."""
        with self._lock:
            state = self._sources.get(source)
            return 0 if state is None else state.viewers

    def jpeg(self, source: str) -> tuple[int, bytes] | None:
        """The latest kept picture of ``source`` as (its number, JPEG bytes), or None when
        none was kept yet. Encodes each picture once (I420 -> BGR -> JPEG, boxes drawn first
        when it was not annotated), in the calling thread (an HTTP server thread); callers
        asking for the same picture share the bytes."""
        with self._lock:
            state = self._sources.get(source)
        if state is None:
            return None
        with state.encode_lock:
            with self._lock:
                seq, picture, detections = (state.activity.picture_seq, state.picture,
                                            state.detections)
                width, height = state.activity.width, state.activity.height
            if picture is None:
                return None
            if seq == state.jpeg_seq:
                return seq, state.jpeg
            state.jpeg_seq, state.jpeg = seq, encode_jpeg(picture, width, height, detections,
                                                          self.class_names, self.jpeg_quality)
            return seq, state.jpeg


def encode_jpeg(picture: np.ndarray, width: int, height: int, detections: Detections | None,
                class_names: list[str] | None, quality: int = JPEG_QUALITY) -> bytes:
    """A JPEG of an I420 picture, with ``detections`` drawn on a copy first when given.

    Args:
        picture: (height * 3 // 2, width) uint8 I420 host array (not modified).
        detections: host arrays in frame pixels, or None.

    Raises:
        ValueError: OpenCV could not encode it.
    """
    if detections is not None and len(detections):
        picture = picture.copy()
        draw_detections(picture, width, height, detections, class_names)
    bgr = cv2.cvtColor(picture.reshape(height * 3 // 2, width), cv2.COLOR_YUV2BGR_I420)
    ok, data = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise ValueError(f"cannot encode a {width}x{height} preview as JPEG")
    return data.tobytes()
