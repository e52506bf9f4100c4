"""Records that flow between stages: frames before the batcher, batches after it.

```
decode --Frame--> batcher --FrameBatch--> infer --ModelOutputs--> postprocess
       --BatchDetections--> [filter] --> [track] --> [analytics] --> [annotate]
       --> split by source once per batch --> sinks
```

Before the batcher the unit is one decoded ``Frame``. From the batcher on, the unit is the
batch: ``FrameBatch`` holds the batch's frames as columns (arrays of source, frame index,
pts, ...), ``BatchDetections`` holds all their detections in flat arrays with per-frame
offsets, and the per-frame ``Detections`` users see is a view of it; tracking adds each
detection's ``tracker_id``, analytics the batch's ``AnalyticsEvent`` records. Batch records
are validated once, in ``__post_init__``, not per frame. Arrays may be NumPy (host) or CuPy
(device) arrays where a docstring says so; the records never import CuPy themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

LETTERBOX_COLUMNS = ("scale_x", "scale_y", "pad_left", "pad_top", "src_width", "src_height")


def _check_shape(name: str, array: Any, expected: tuple[int | None, ...]) -> None:
    """Raise ValueError unless ``array.shape`` matches ``expected`` (None matches any size)."""
    shape = tuple(array.shape)
    ok = len(shape) == len(expected) and all(e is None or e == s for s, e in zip(shape, expected))
    if not ok:
        want = "(" + ", ".join("n" if e is None else str(e) for e in expected) + ")"
        raise ValueError(f"{name} must have shape {want}, got {shape}")


@dataclass
class Detections:
    """Detections of one frame, in original-frame pixel coordinates.

    Attributes:
        xyxy: (n, 4) float32 boxes as x1, y1, x2, y2; host (NumPy) or device (CuPy).
        confidence: (n,) float32 scores in [0, 1], same device as ``xyxy``.
        class_id: (n,) int32 class indices, same device as ``xyxy``.
        tracker_id: (n,) int64 track ids, same device as ``xyxy`` (-1: not tracked), or None
            when the source is not tracked.

    The layout matches ``supervision.Detections``, so
    ``sv.Detections(xyxy=d.xyxy, confidence=d.confidence, class_id=d.class_id,
    tracker_id=d.tracker_id)`` copies nothing.
    """

    xyxy: Any
    confidence: Any
    class_id: Any
    tracker_id: Any = None

    def __post_init__(self) -> None:
        _check_shape("xyxy", self.xyxy, (None, 4))
        n = self.xyxy.shape[0]
        _check_shape("confidence", self.confidence, (n,))
        _check_shape("class_id", self.class_id, (n,))
        if self.tracker_id is not None:
            _check_shape("tracker_id", self.tracker_id, (n,))

    @classmethod
    def empty(cls) -> Detections:
        """No detections: host arrays of length 0."""
        return cls(
            xyxy=np.empty((0, 4), np.float32),
            confidence=np.empty((0,), np.float32),
            class_id=np.empty((0,), np.int32),
        )

    def __len__(self) -> int:
        return int(self.xyxy.shape[0])

    def __getitem__(self, index: Any) -> Detections:
        """Select detections with a boolean mask, an index array or a slice."""
        if isinstance(index, (int, np.integer)):
            index = slice(int(index), int(index) + 1)
        return Detections(self.xyxy[index], self.confidence[index], self.class_id[index],
                          None if self.tracker_id is None else self.tracker_id[index])


@dataclass
class Frame:
    """One decoded video frame, before the batcher.

    Attributes:
        source: name of the source (unique in the config).
        index: 0-based frame number within the source (counts every decoded frame).
        pts: presentation time in seconds from the stream, or None when the stream has none.
        capture_time: wall-clock ``time.time()`` when the decoder produced the frame.
        width, height: size of the decoded picture in pixels (both even).
        rate: the source's nominal frame rate in frames per second, or None when unknown.
        image: the picture as I420 (YUV 4:2:0 planar): (height * 3 // 2, width) uint8 host
            array, rows 0..height-1 the Y plane, then the U and the V plane, each
            (height // 2) x (width // 2) stored contiguously -- PyAV's ``yuv420p`` layout.
            Usually a view of slot ``slot`` of the pipeline's ``pipeline.slots.SlotRing``
            (pinned host memory on the GPU path). None for a GPU-decoded frame.
        slot: the ring slot holding ``image``, or -1 when ``image`` is an array of its own
            (or there is none). Whoever drops or finishes with the frame returns the slot.
        pixel_format: layout of the frame's 4:2:0 samples: "i420" (planar U then V) or
            "nv12" (one interleaved UV plane, as GPU decoders write it).
        device_planes: a GPU-decoded frame's pictures: (Y (height, width) uint8, UV
            (height // 2, width // 2, 2) uint8) CuPy views of the decoder's output surface
            (row pitch ``strides[0]``, usually more than ``width``), valid on the legacy
            default stream of the CUDA primary context (FFmpeg queues its copies there); they
            hold a reference to the surface, so the decoder cannot reuse it while they live.
            None otherwise.
    """

    source: str
    index: int
    pts: float | None
    capture_time: float
    width: int
    height: int
    rate: Fraction | None = None
    image: Any = None
    slot: int = -1
    pixel_format: str = "i420"
    device_planes: tuple[Any, Any] | None = None

    def __post_init__(self) -> None:
        if self.width <= 0 or self.height <= 0 or self.width % 2 or self.height % 2:
            raise ValueError(f"frame size must be positive and even, got {self.width}x{self.height}")
        if self.image is not None:
            _check_shape("image", self.image, (self.height * 3 // 2, self.width))


@dataclass
class EndOfStream:
    """Marker that a source produced its last frame; flows through every stage after it.

    Attributes:
        source: name of the source that ended.
        frames: how many frames the source produced in total.
        error: a one-line reason when the source ended on an error, else None.
        stopped: it ended because it was asked to stop (a graceful stop, or the source
            removed), maybe before its end.
        total: the frames its file announces, or None (a stream, or not known).
        events: analytics events made when the source ended (the exits of the objects
            still inside a zone, on its last frame: ``AnalyticsStage``), for its events file.
    """

    source: str
    frames: int
    error: str | None = None
    stopped: bool = False
    total: int | None = None
    events: tuple[AnalyticsEvent, ...] = ()

    @property
    def cut_short(self) -> bool:
        """Stopped before its end: asked to stop before ``total`` frames (or, when the total
        is not known, asked to stop at all)."""
        return self.stopped and (self.total is None or self.frames < self.total)


@dataclass
class FrameBatch:
    """The frames of one inference call, as columns (batch order = the model's batch axis).

    Attributes:
        source_names: every source's name; ``source`` indexes it (shared by all batches).
        source: (n,) int32 host array, the source of each frame.
        index: (n,) int64 host array, frame numbers within their sources.
        pts: (n,) float64 host array, presentation times in seconds (NaN when unknown).
        capture_time: (n,) float64 host array, wall-clock capture times (``time.time()``).
        width, height: (n,) int32 host arrays, frame sizes in pixels.
        letterbox: (n, 6) float32 host array, how each frame was fitted into the model
            input; columns ``LETTERBOX_COLUMNS`` (scale_x, scale_y, pad_left, pad_top,
            src_width, src_height), as in ``kernels.preprocess.Letterbox``.
        slot: (n,) int32 host array, the ring slot holding each frame's image (-1: none).
        images: n host I420 arrays ((height * 3 // 2, width) uint8, views of ring slots),
            None for a frame decoded on the GPU; read by annotate and the video sink.
        rates: n nominal frame rates (frames/s) of the frames' sources, None when unknown.
        buffers: on the GPU path, the ``pipeline.gpu.BatchBuffers`` set that carries the batch
            through the device (its frames, model input, detections); None on the CPU path.
        detect: (n,) bool host array, False for a frame the detector skips (the source's
            ``detect_every`` / ``detect_fps``: it reaches the sinks with no detections of its
            own), or None when every frame is detected.
        device_pictures: n ``Frame.device_planes`` (a GPU-decoded frame's (Y, UV) CuPy views,
            None for a frame with host pixels), kept for the event snapshots
            (``output.event_media``: one download per frame with events) while the batch
            lives; None when they are not kept (the decoder's surfaces are let go earlier).
    """

    source_names: tuple[str, ...]
    source: np.ndarray
    index: np.ndarray
    pts: np.ndarray
    capture_time: np.ndarray
    width: np.ndarray
    height: np.ndarray
    letterbox: np.ndarray
    slot: np.ndarray
    images: list[Any]
    rates: list[Fraction | None]
    buffers: Any = None
    detect: np.ndarray | None = None
    device_pictures: list[Any] | None = None

    def __post_init__(self) -> None:
        n = self.source.shape[0]
        if self.detect is not None:
            _check_shape("detect", self.detect, (n,))
            if self.detect.dtype != np.bool_:
                raise ValueError(f"detect must be bool, got {self.detect.dtype}")
        for name, dtype in (("source", np.int32), ("index", np.int64), ("pts", np.float64),
                            ("capture_time", np.float64), ("width", np.int32),
                            ("height", np.int32), ("slot", np.int32)):
            array = getattr(self, name)
            _check_shape(name, array, (n,))
            if array.dtype != dtype:
                raise ValueError(f"{name} must be {np.dtype(dtype).name}, got {array.dtype}")
        _check_shape("letterbox", self.letterbox, (n, len(LETTERBOX_COLUMNS)))
        if self.device_pictures is not None and len(self.device_pictures) != n:
            raise ValueError(f"batch of {n} frames has {len(self.device_pictures)} device "
                             f"pictures")
        if len(self.images) != n or len(self.rates) != n:
            raise ValueError(f"batch of {n} frames has {len(self.images)} images and "
                             f"{len(self.rates)} rates")
        if n and not 0 <= int(self.source.min()) <= int(self.source.max()) < len(self.source_names):
            raise ValueError(f"source ids must index {len(self.source_names)} source names")

    def __len__(self) -> int:
        return int(self.source.shape[0])

    @classmethod
    def from_frames(cls, frames: list[Frame], source_ids: dict[str, int],
                    source_names: tuple[str, ...], letterbox: np.ndarray,
                    buffers: Any = None, detect: np.ndarray | None = None,
                    device_pictures: bool = False) -> FrameBatch:
        """Columns of ``frames`` (one pass over them).

        Args:
            frames: the frames, in batch order.
            source_ids: source name -> its index in ``source_names``.
            letterbox: (len(frames), 6) float32 host array (see the class docstring).
            detect: (len(frames),) bool host array, or None (see the class docstring).
            device_pictures: keep the GPU-decoded frames' ``device_planes`` in the batch
                (``FrameBatch.device_pictures``; None when no frame has any).
        """
        kept = [f.device_planes for f in frames] if device_pictures else []
        return cls(
            source_names=source_names,
            source=np.fromiter((source_ids[f.source] for f in frames), np.int32, len(frames)),
            index=np.fromiter((f.index for f in frames), np.int64, len(frames)),
            pts=np.fromiter((np.nan if f.pts is None else f.pts for f in frames), np.float64,
                            len(frames)),
            capture_time=np.fromiter((f.capture_time for f in frames), np.float64, len(frames)),
            width=np.fromiter((f.width for f in frames), np.int32, len(frames)),
            height=np.fromiter((f.height for f in frames), np.int32, len(frames)),
            letterbox=letterbox,
            slot=np.fromiter((f.slot for f in frames), np.int32, len(frames)),
            images=[f.image for f in frames],
            rates=[f.rate for f in frames],
            buffers=buffers,
            detect=None if detect is None or detect.all() else detect,
            device_pictures=kept if any(planes is not None for planes in kept) else None,
        )

    def select(self, rows: np.ndarray) -> FrameBatch:
        """The frames at ``rows`` ((k,) integer host array of batch positions), in that order.
        The result has no ``buffers``: only the whole batch owns its device set."""
        return FrameBatch(
            self.source_names, self.source[rows], self.index[rows], self.pts[rows],
            self.capture_time[rows], self.width[rows], self.height[rows], self.letterbox[rows],
            self.slot[rows], [self.images[i] for i in rows.tolist()],
            [self.rates[i] for i in rows.tolist()],
            detect=None if self.detect is None else self.detect[rows],
            device_pictures=None if self.device_pictures is None
            else [self.device_pictures[i] for i in rows.tolist()])

    @property
    def detect_rows(self) -> np.ndarray:
        """(d,) int64 host array: the batch positions of the frames the detector runs on."""
        if self.detect is None:
            return np.arange(len(self), dtype=np.int64)
        return np.flatnonzero(self.detect)

    def source_name(self, row: int) -> str:
        """The source name of the frame at batch position ``row``."""
        return self.source_names[int(self.source[row])]

    def pts_at(self, row: int) -> float | None:
        """The pts of the frame at ``row`` as in a JSON record (None when unknown)."""
        value = float(self.pts[row])
        return None if value != value else value


@dataclass
class ModelOutputs:
    """A batch after the model ran (the infer stage's output).

    Attributes:
        frames: the batch.
        outputs: CPU path: the raw float32 host model output of the frames at
            ``frames.detect_rows`` (d of them), (d, 4 + classes, anchors) or another layout of
            ``stages.backends.base.LAYOUTS`` (the postprocess knows it); None when d = 0.
            GPU path: None; the NMS already ran on the device and the detections of the d
            frames are on their way to rows 0..d-1 of ``frames.buffers``' pinned host buffer
            (its ``done`` event).
    """

    frames: FrameBatch
    outputs: Any = None

    def __len__(self) -> int:
        return len(self.frames)


@dataclass
class BatchDetections:
    """The detections of every frame of a batch, flat, in source-frame pixels (host arrays).

    Frame ``i``'s detections are rows ``offsets[i]:offsets[i + 1]``, best score first;
    ``batch[i]`` is a ``Detections`` view of them (no copy).

    Attributes:
        frames: the frames the detections belong to.
        xyxy: (m, 4) float32 boxes x1, y1, x2, y2, clipped to their frame.
        confidence: (m,) float32 scores.
        class_id: (m,) int32 class indices.
        offsets: (n + 1,) int64, non-decreasing, ``offsets[0] == 0``, ``offsets[n] == m``.
        tracker_id: (m,) int64 track ids (-1: not tracked: the source has no tracker, or the
            detection is not part of a confirmed track), or None when no source is tracked.
            On a frame the detector skipped (``frames.detect``), a tracked source's
            detections are its tracks' predicted boxes.
        events: the analytics events of these frames (zone entries and exits, line
            crossings), in batch order; empty when no source has analytics.
        pictures: n host copies of the frames' pictures, made for the Python API's
            ``frames`` option (``stages.pictures``): BGR (height, width, 3) uint8 or I420
            (height * 3 // 2, width) uint8 NumPy arrays, owned by the record (not ring
            slots); None when nobody asked for them.
    """

    frames: FrameBatch
    xyxy: np.ndarray
    confidence: np.ndarray
    class_id: np.ndarray
    offsets: np.ndarray
    tracker_id: np.ndarray | None = None
    events: tuple[AnalyticsEvent, ...] = ()
    pictures: tuple[np.ndarray, ...] | None = None

    def __post_init__(self) -> None:
        m, n = self.xyxy.shape[0], len(self.frames)
        if self.pictures is not None and len(self.pictures) != n:
            raise ValueError(f"pictures must hold one array per frame ({n}), got "
                             f"{len(self.pictures)}")
        _check_shape("xyxy", self.xyxy, (m, 4))
        _check_shape("confidence", self.confidence, (m,))
        _check_shape("class_id", self.class_id, (m,))
        _check_shape("offsets", self.offsets, (n + 1,))
        if self.tracker_id is not None:
            _check_shape("tracker_id", self.tracker_id, (m,))
            if self.tracker_id.dtype != np.int64:
                raise ValueError(f"tracker_id must be int64, got {self.tracker_id.dtype}")
        if int(self.offsets[0]) != 0 or int(self.offsets[-1]) != m or (
                n and bool((np.diff(self.offsets) < 0).any())):
            raise ValueError(f"offsets must rise from 0 to {m}, got {self.offsets.tolist()}")

    def __len__(self) -> int:
        """Number of frames."""
        return len(self.frames)

    def __getitem__(self, row: int) -> Detections:
        """The detections of the frame at batch position ``row``: views, no copy."""
        start, end = int(self.offsets[row]), int(self.offsets[row + 1])
        return Detections(self.xyxy[start:end], self.confidence[start:end],
                          self.class_id[start:end],
                          None if self.tracker_id is None else self.tracker_id[start:end])

    @property
    def counts(self) -> np.ndarray:
        """(n,) int64 host array: detections per frame."""
        return np.diff(self.offsets)

    def select(self, rows: np.ndarray) -> BatchDetections:
        """The frames at ``rows`` ((k,) integer host array of batch positions) with their
        detections, gathered into new flat arrays."""
        counts = self.counts[rows]
        offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        starts = self.offsets[rows]
        # Row numbers of every kept detection, frame by frame, in one vectorised gather.
        detection_rows = np.repeat(starts - offsets[:-1], counts) + np.arange(offsets[-1])
        frames = self.frames.select(rows)
        events = self.events
        if events:
            chosen = set(zip(frames.source.tolist(), frames.index.tolist()))
            ids = {name: i for i, name in enumerate(frames.source_names)}
            events = tuple(e for e in events if (ids[e.source], e.frame) in chosen)
        return BatchDetections(frames, self.xyxy[detection_rows],
                               self.confidence[detection_rows], self.class_id[detection_rows],
                               offsets,
                               None if self.tracker_id is None else self.tracker_id[detection_rows],
                               events, None if self.pictures is None
                               else tuple(self.pictures[i] for i in rows.tolist()))

    def keep(self, mask: np.ndarray) -> BatchDetections:
        """The same frames with only the detections where ``mask`` ((m,) bool host array) is
        true, in the same order."""
        kept_before = np.zeros(len(mask) + 1, np.int64)
        np.cumsum(mask, out=kept_before[1:])
        return BatchDetections(self.frames, self.xyxy[mask], self.confidence[mask],
                               self.class_id[mask], kept_before[self.offsets],
                               None if self.tracker_id is None else self.tracker_id[mask],
                               self.events, self.pictures)

    def by_source(self) -> list[tuple[str, BatchDetections]]:
        """The batch split by source (once per batch): (source name, its frames in batch
        order with their detections), one entry per source present."""
        source = self.frames.source
        if len(source) and (source == source[0]).all():
            return [(self.frames.source_names[int(source[0])], self)]
        order = np.argsort(source, kind="stable")
        ids, starts = np.unique(source[order], return_index=True)
        bounds = [*starts.tolist(), len(order)]
        return [(self.frames.source_names[int(ids[k])], self.select(order[bounds[k]:bounds[k + 1]]))
                for k in range(len(ids))]

    def spread(self, frames: FrameBatch, rows: np.ndarray) -> BatchDetections:
        """These detections, of the frames at ``rows`` ((k,) ascending int64 host array of
        positions in ``frames``), as the detections of all of ``frames``: the other frames
        get none (the frames the detector skipped)."""
        counts = np.zeros(len(frames), np.int64)
        counts[rows] = self.counts
        offsets = np.zeros(len(frames) + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        return BatchDetections(frames, self.xyxy, self.confidence, self.class_id, offsets,
                               self.tracker_id, self.events)

    @classmethod
    def from_padded(cls, frames: FrameBatch, boxes: np.ndarray, scores: np.ndarray,
                    class_ids: np.ndarray, counts: np.ndarray) -> BatchDetections:
        """Flatten per-image padded results (the GPU's layout) into a batch record.

        Args:
            boxes: (>= n, D, 4) float32 host array; image b's first ``counts[b]`` rows count.
            scores: (>= n, D) float32 host array.
            class_ids: (>= n, D) int32 host array.
            counts: (>= n,) integer host array, each at most D.
        """
        n = len(frames)
        counts = counts[:n].astype(np.int64)
        keep = np.arange(boxes.shape[1])[None, :] < counts[:, None]  # (n, D), row-major order
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        return cls(frames, boxes[:n][keep], scores[:n][keep], class_ids[:n][keep].astype(np.int32),
                   offsets)

    @classmethod
    def from_lists(cls, frames: FrameBatch, per_frame: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                   tracker_ids: list[np.ndarray] | None = None) -> BatchDetections:
        """Concatenate per-frame results (the CPU reference's layout): per frame (xyxy (k, 4)
        float32, scores (k,) float32, class_ids (k,) int32) host arrays in frame pixels, and
        when given, per frame the (k,) int64 host array of their track ids."""
        counts = [len(scores) for _, scores, _ in per_frame]
        offsets = np.zeros(len(per_frame) + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        tracker_id = None if tracker_ids is None else np.concatenate(
            [np.empty(0, np.int64), *(np.asarray(t, np.int64) for t in tracker_ids)])
        if not per_frame:
            return cls(frames, np.empty((0, 4), np.float32), np.empty(0, np.float32),
                       np.empty(0, np.int32), offsets, tracker_id)
        return cls(frames,
                   np.concatenate([np.asarray(x, np.float32).reshape(-1, 4) for x, _, _ in per_frame]),
                   np.concatenate([np.asarray(s, np.float32) for _, s, _ in per_frame]),
                   np.concatenate([np.asarray(c, np.int32) for _, _, c in per_frame]), offsets,
                   tracker_id)


# Kinds of analytics event, and whether each happens at a zone or at a line.
EVENT_KINDS = {"enter": "zone", "exit": "zone", "cross_in": "line", "cross_out": "line"}


@dataclass(frozen=True)
class AnalyticsEvent:
    """One analytics event: a track entered or left a zone, or crossed a line.

    Attributes:
        source: the source's name.
        kind: "enter" or "exit" (a zone), "cross_in" or "cross_out" (a line; in: from the
            left to the right of start -> end as the picture is shown).
        region: the name of the zone or line (unique within the source).
        frame: index of the frame on which the event was confirmed.
        pts: that frame's presentation time in seconds, or None when unknown.
        capture_time: that frame's wall-clock capture time (``time.time()``).
        tracker_id: the track's id (>= 0).
        class_id: the track's class: for a zone's enter and exit, its class when it entered
            (so each zone's entries and exits by class add up); for a crossing, its class then.
        class_name: the class's name, or None when the model has no names.
        confidence: the detection's score on that frame (the last detected one when the
            track is predicted or gone).
        xyxy: the track's box on that frame (its last box when it is gone), frame pixels.
        dwell_s: for an exit, seconds of the stream's timestamps from the first to the last
            frame the track was seen inside; None for the other kinds.
        snapshot: the event's JPEG (``output.event_media``), a path relative to the events
            file's folder (``bikes.events/<id>.jpg``), or None: none asked for, or dropped.
        clip: the event's MP4 clip, likewise; it appears under that name once written.
    """

    source: str
    kind: str
    region: str
    frame: int
    pts: float | None
    capture_time: float
    tracker_id: int
    class_id: int
    class_name: str | None
    confidence: float
    xyxy: tuple[float, float, float, float]
    dwell_s: float | None = None
    snapshot: str | None = None
    clip: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"kind must be one of {', '.join(EVENT_KINDS)}, got {self.kind!r}")
        if (self.dwell_s is not None) != (self.kind == "exit"):
            raise ValueError(f"dwell_s is set on exits only, got {self.dwell_s!r} on {self.kind}")
        if self.dwell_s is not None and not (self.dwell_s >= 0 and math.isfinite(self.dwell_s)):
            raise ValueError(f"dwell_s must be a finite number >= 0, got {self.dwell_s!r}")
        if self.tracker_id < 0 or self.frame < 0:
            raise ValueError(f"tracker_id and frame must be >= 0, got {self.tracker_id} and "
                             f"{self.frame}")
        if len(self.xyxy) != 4:
            raise ValueError(f"xyxy must have 4 values, got {len(self.xyxy)}")

    @property
    def region_type(self) -> str:
        """"zone" or "line": where the event happened."""
        return EVENT_KINDS[self.kind]

    def to_json(self) -> dict[str, Any]:
        """The event as a JSON-ready dict: ``{"source", "capture_time", "pts", "frame",
        "kind", "zone" or "line" (the name), "tracker_id", "class_id", "class_name",
        "confidence", "xyxy"}``, ``"dwell_s"`` on an exit (times rounded to 6 digits, the
        score to 4, the box to 2; ``class_name`` null when unknown), and ``"snapshot"`` and
        ``"clip"`` when the event has them."""
        record: dict[str, Any] = {
            "source": self.source,
            "capture_time": round(self.capture_time, 6),
            "pts": None if self.pts is None else round(self.pts, 6),
            "frame": self.frame,
            "kind": self.kind,
            self.region_type: self.region,
            "tracker_id": self.tracker_id,
            "class_id": self.class_id,
            "class_name": self.class_name,
            "confidence": round(self.confidence, 4),
            "xyxy": [round(float(v), 2) for v in self.xyxy],
        }
        if self.dwell_s is not None:
            record["dwell_s"] = round(self.dwell_s, 6)
        if self.snapshot is not None:
            record["snapshot"] = self.snapshot
        if self.clip is not None:
            record["clip"] = self.clip
        return record
