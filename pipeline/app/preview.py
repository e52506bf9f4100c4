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
with ``stages.annotate.draw_detections``.

**GPU-decoded sources** have no host image in their parts. Their decode stage
(``stages.gpu_decode.GpuDecodeStage``, given this hub as its ``PictureTap``) asks
``wanted`` at most ``preview_fps`` times a second and, only while it is, downloads one
frame's NV12 planes and hands them over with ``offer_picture``, keyed by the frame's index,
before the frame goes on. The hub holds that picture pending until the sink offers the part
holding that index, and keeps it then with that frame's detections (drawn at encode time,
NV12 rearranged to I420 first): picture and boxes always belong to the same frame. A pending
picture whose frame never reaches the sink (dropped) is replaced by the next one offered.

```
decode thread (GPU source)                 sink thread
  hub.offer_picture(src, index, nv12)        hub.offer_part(part): part.frames.index holds
    pending = (index, nv12)  --------------->   pending.index? keep it with part[row]
```
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
class _Pending:
    """A GPU-decoded frame's host picture, offered before its frame reached the sink."""

    index: int
    nv12: np.ndarray  # (height * 3 // 2, width) uint8 NV12 host array, ours
    width: int
    height: int


@dataclass
class _Source:
    """Per-source state; every field is guarded by the hub's lock, except ``encode_lock``
    and the JPEG cache it guards."""

    activity: SourceActivity = field(default_factory=SourceActivity)
    viewers: int = 0
    wanted_until: float = 0.0
    kept_at: float = float("-inf")
    picture: np.ndarray | None = None  # (height * 3 // 2, width) uint8, our own copy
    picture_format: str = "i420"  # its layout: "i420", or "nv12" (downloaded from the GPU)
    detections: Detections | None = None  # to draw at encode time (picture not annotated)
    pending: _Pending | None = None  # a GPU-decoded picture waiting for its frame's part
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
            _count(state.activity, frames, capture_time, now)
            keep = (image is not None and (state.viewers > 0 or now < state.wanted_until)
                    and now - state.kept_at >= self.period_s)
            if keep:
                state.kept_at = now  # claimed: a concurrent offer of this source keeps none
        if not keep:
            return
        picture = np.array(image, dtype=np.uint8, copy=True)  # outside the lock: ~1 ms at 1080p
        self._keep(state, picture, "i420", width, height,
                   detections if not annotated else None)

    def offer_picture(self, source: str, index: int, nv12: np.ndarray, width: int,
                      height: int) -> None:
        """A GPU-decoded frame's picture, downloaded because ``wanted(source)`` said so: held
        until the sink offers the part holding frame ``index`` (then kept with that frame's
        detections), or replaced by a later one. Call it before the frame goes on to the
        batcher, so that its part cannot reach the sink first.

        Args:
            source: the source's name.
            index: the frame's index (``Frame.index``).
            nv12: (height * 3 // 2, width) uint8 NV12 host array (Y rows, then interleaved
                UV rows); the hub takes it over (not copied: the caller must not reuse it).
            width, height: the frame's size in pixels.
        """
        with self._lock:
            self._source(source).pending = _Pending(index, nv12, width, height)

    def _keep(self, state: _Source, picture: np.ndarray, picture_format: str, width: int,
              height: int, detections: Detections | None) -> None:
        """Make ``picture`` (ours) the source's latest, with host copies of ``detections`` to
        draw at encode time (None: draw nothing)."""
        drawn = None
        if detections is not None and len(detections):
            drawn = Detections(np.array(detections.xyxy, np.float32),
                               np.array(detections.confidence, np.float32),
                               np.array(detections.class_id, np.int32),
                               None if detections.tracker_id is None
                               else np.array(detections.tracker_id, np.int64))
        with self._lock:
            state.picture, state.picture_format, state.detections = picture, picture_format, drawn
            state.activity.picture_seq += 1
            state.activity.width, state.activity.height = width, height

    def offer_part(self, part: BatchDetections, annotated: bool) -> None:
        """``offer`` a sink's batch part (one source's frames, in frame order): every frame
        counts, the last one with a host image is the picture. A part without host images
        (GPU-decoded) keeps the pending ``offer_picture`` picture when it holds that frame.
        O(1) in the part's length except for finding that frame.

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
        if frames.images[row] is None:  # decoded on the GPU: pictures come by offer_picture
            self._offer_device_part(part)
            return
        self.offer(frames.source_name(row), frames.images[row], int(frames.width[row]),
                   int(frames.height[row]), float(frames.capture_time[count - 1]),
                   part[row] if not annotated else None, annotated, count)

    def _offer_device_part(self, part: BatchDetections) -> None:
        """``offer_part`` of a part without host images: count its frames; when it holds the
        frame of the pending picture, keep that picture with the frame's detections."""
        frames = part.frames
        count = len(frames)
        with self._lock:
            state = self._source(frames.source_name(0))
            _count(state.activity, count, float(frames.capture_time[count - 1]),
                   time.monotonic())
            pending = state.pending
            if pending is None:
                return
            rows = np.flatnonzero(frames.index == pending.index)
            if not len(rows):
                return  # a later part holds it, or it was dropped: a later picture replaces it
            state.pending = None
        self._keep(state, pending.nv12, "nv12", pending.width, pending.height,
                   part[int(rows[0])])

    def end(self, source: str, error: str | None = None) -> None:
        """``source``'s stream ended (``error``: why, when it failed)."""
        with self._lock:
            state = self._source(source)
            state.activity.ended, state.activity.error = True, error
            state.pending = None  # a source added again under this name counts from 0

    def restart(self, source: str) -> None:
        """A new source takes the name ``source`` (the one before it ended or was removed):
        what the hub kept of the earlier one (its last frame, picture, end) is forgotten; the
        open streams and a snapshot's wish of that name stay."""
        with self._lock:
            old = self._sources.get(source)
            if old is not None:
                self._sources[source] = _Source(viewers=old.viewers,
                                                wanted_until=old.wanted_until)

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

    def picture(self, source: str) -> tuple[np.ndarray, int, int] | None:
        """The latest kept picture of ``source`` as (a (height * 3 // 2, width) uint8 I420
        copy, width, height), boxes not drawn; None when none was kept yet."""
        with self._lock:
            state = self._sources.get(source)
            if state is None or state.picture is None:
                return None
            picture, picture_format = state.picture, state.picture_format
            width, height = state.activity.width, state.activity.height
        return as_i420(picture, picture_format, width, height, copy=True), width, height

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
                picture_format = state.picture_format
                width, height = state.activity.width, state.activity.height
            if picture is None:
                return None
            if seq == state.jpeg_seq:
                return seq, state.jpeg
            picture = as_i420(picture, picture_format, width, height)
            state.jpeg_seq, state.jpeg = seq, encode_jpeg(picture, width, height, detections,
                                                          self.class_names, self.jpeg_quality)
            return seq, state.jpeg


def _count(activity: SourceActivity, frames: int, capture_time: float, now: float) -> None:
    """``frames`` more frames reached the sink, the latest captured at ``capture_time``;
    the caller holds the hub's lock."""
    activity.frames += frames
    activity.last_capture_time = capture_time
    activity.last_frame_at = now


def nv12_to_i420(picture: np.ndarray, width: int, height: int) -> np.ndarray:
    """The I420 layout of an NV12 picture: the same samples, U and V de-interleaved (exact).

    Args:
        picture: (height * 3 // 2, width) uint8 NV12 host array: Y rows, then
            height // 2 rows of interleaved U, V.

    Returns:
        A new (height * 3 // 2, width) uint8 I420 array (Y, then the U plane, then V).
    """
    out = np.empty((height * 3 // 2, width), np.uint8)
    out[:height] = picture[:height]
    uv = picture[height:height * 3 // 2].reshape(height // 2, width // 2, 2)
    chroma = out[height:].reshape(2, height // 2, width // 2)  # a view: U plane, V plane
    chroma[0], chroma[1] = uv[..., 0], uv[..., 1]
    return out


def as_i420(picture: np.ndarray, picture_format: str, width: int, height: int,
            copy: bool = False) -> np.ndarray:
    """``picture`` in I420: itself (a copy when ``copy``) when it is I420 already, else
    ``nv12_to_i420`` of it (always a new array)."""
    if picture_format == "nv12":
        return nv12_to_i420(picture, width, height)
    return picture.copy() if copy else picture


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
