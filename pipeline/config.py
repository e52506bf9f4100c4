"""The YAML configuration: a documented schema of dataclasses, validated up front.

Every section is a dataclass whose fields carry their documentation in ``metadata["doc"]``;
``python run.py --help-config`` prints them. Loading merges the user's YAML over the defaults
and rejects unknown keys, wrong types and bad values with a ``ConfigError`` naming the key
(``inference.batch_size``), the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import os
import re
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml


class ConfigError(ValueError):
    """A configuration value is wrong; the message is one line meant for the user."""


def install_hint(extra: str) -> str:
    """How to install an extra's packages, as the one-line errors say it (the project is
    installed from its folder, not from PyPI)."""
    return f"pip install -e '.[{extra}]' in the project's folder (the {extra} extra)"


# Frames of one inference call: the pinned frame ring and the device batch sets grow with it
# (at 1080p, 512 frames are 1.6 GB per batch set).
MAX_BATCH_SIZE = 512

# The shortest output.segment_s: a segment holds at least a few fragments (a keyframe every
# 2 s), and a folder does not fill with a file every few seconds.
SEGMENT_MIN_S = 10.0


# The stream URL schemes a source may use (FFmpeg reads them all); anything else is refused.
STREAM_SCHEMES = {"rtsp", "rtsps", "rtmp", "rtmps", "http", "https", "udp", "tcp", "srt"}


def _doc(text: str, **extra: Any) -> dict[str, Any]:
    return {"doc": text, **extra}


@dataclass
class AnalyticsRegionConfig:
    """A counting zone or line of one source (the source needs ``tracker: bytetrack``).

    An object's place is the bottom centre of its box (where it stands). Only tracks seen in
    at least ``min_track_frames`` frames count, and a change (entering, leaving, crossing)
    counts once the object has been on its new side, more than ``margin_px`` from the line
    or edge, for ``min_frames`` frames in a row: a box jittering on the line counts once.
    """

    type: Literal["zone", "line"] = field(
        metadata=_doc("zone: a polygon; objects inside now, enter and exit events with the "
                      "time spent inside. line: a directed line; in and out crossings."))
    name: str = field(metadata=_doc("Name unique within the source, used in events, counts "
                                    "and metrics (letters, digits, '_', '-', '.')."))
    polygon: list[list[float]] | None = field(
        default=None,
        metadata=_doc("zone: its corners [[x, y], ...] (at least 3, frame pixels, inside the "
                      "frame), in order around it: its edges may not cross."))
    start: list[float] | None = field(
        default=None, metadata=_doc("line: its start point [x, y] (frame pixels)."))
    end: list[float] | None = field(
        default=None,
        metadata=_doc("line: its end point [x, y]. Direction: standing on start and looking "
                      "at end (as the picture is shown), an object crossing from the left to "
                      "the right counts as in, from the right to the left as out."))
    classes: list[str | int] | None = field(
        default=None, metadata=_doc("Count only these classes (names or ids), or null for all."))
    min_track_frames: int = field(
        default=3,
        metadata=_doc("A track counts only once it has been in this many frames (a brief "
                      "false track never counts).", min=1))
    min_frames: int = field(
        default=2,
        metadata=_doc("Frames in a row an object must be seen on its new side before entering, "
                      "leaving or crossing counts.", min=1))
    margin_px: float = field(
        default=3.0,
        metadata=_doc("Hysteresis: an object closer than this to the line or to the zone's "
                      "edge keeps the side it had (a zone's edges on the frame's border "
                      "excepted: nothing crosses the border).", min=0.0))

    @property
    def points(self) -> list[list[float]]:
        """The polygon's corners (zone) or [start, end] (line)."""
        if self.type == "zone":
            return self.polygon or []
        return [p for p in (self.start, self.end) if p is not None]

    def check(self, key: str) -> None:
        """Raise ConfigError unless the region is well formed (``key``: where it sits,
        ``sources[0].analytics[1]``); that it lies inside the frame is checked once the
        frame size is known (``outside_frame``)."""
        if not _NAME_PATTERN.match(self.name):
            raise ConfigError(f"{key}.name: expected letters, digits, '_', '-' or '.', got "
                              f"{self.name!r}")
        if self.classes is not None and not self.classes:
            raise ConfigError(f"{key}.classes: expected class names or ids, or null for all, "
                              "got an empty list")
        if self.type == "zone":
            for other in ("start", "end"):
                if getattr(self, other) is not None:
                    raise ConfigError(f"{key}.{other}: a zone has a polygon, not a start and "
                                      "an end (or use type: line)")
            if (self.polygon is None or len(self.polygon) < 3
                    or any(len(p) != 2 for p in self.polygon)):
                raise ConfigError(f"{key}.polygon: zone {self.name!r} needs a polygon of at "
                                  f"least 3 [x, y] points, got {self.polygon!r}")
            if not all(math.isfinite(v) for p in self.polygon for v in p):
                return  # not a place in the frame: outside_frame names it
            check_polygon(f"{key}.polygon", f"zone {self.name!r}", self.polygon)
            return
        if self.polygon is not None:
            raise ConfigError(f"{key}.polygon: a line has a start and an end, not a polygon "
                              "(or use type: zone)")
        for end in ("start", "end"):
            point = getattr(self, end)
            if point is None or len(point) != 2:
                raise ConfigError(f"{key}.{end}: line {self.name!r} needs an [x, y] {end} "
                                  f"point, got {point!r}")
        if self.start == self.end:
            raise ConfigError(f"{key}.end: line {self.name!r} has zero length (start and end "
                              f"are both {self.start!r})")

    def outside_frame(self, width: int, height: int) -> list[float] | None:
        """The first point of the region outside a ``width`` x ``height`` frame (x in
        0..width, y in 0..height), or None when all are inside."""
        return next((p for p in self.points
                     if not (0 <= p[0] <= width and 0 <= p[1] <= height)), None)


def check_polygon(key: str, what: str, polygon: list[list[float]]) -> None:
    """Raise ``ConfigError`` (one line, ``key``: ``what`` ...) unless ``polygon`` (at least 3
    finite [x, y] points) encloses an area with edges that do not cross, overlap or touch."""
    if _collinear(polygon):
        raise ConfigError(f"{key}: {what} encloses no area (its points lie on one line): "
                          f"{polygon!r}")
    crossing = _crossing_edges(polygon)
    if crossing is not None:
        how, first, second = crossing
        raise ConfigError(f"{key}: {what} has edges that {how} ({_edge_text(polygon, first)} "
                          f"and {_edge_text(polygon, second)}); list its corners in order "
                          "around it")
    xs, ys = [p[0] for p in polygon], [p[1] for p in polygon]
    doubled_area = sum(xs[i - 1] * ys[i] - xs[i] * ys[i - 1] for i in range(len(xs)))
    if doubled_area == 0:  # only by rounding: uncrossed edges off one line enclose area
        raise ConfigError(f"{key}: {what} encloses no area: {polygon!r}")


def _orientation(a: list[float], b: list[float], c: list[float]) -> float:
    """Twice the signed area of the triangle a, b, c: > 0 when c is left of a -> b (counter-
    clockwise in y-up axes), < 0 right of it, 0 on its line."""
    return (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0])


def _collinear(points: list[list[float]]) -> bool:
    """Whether all ``points`` lie on one line (or are one point)."""
    other = next((p for p in points if p != points[0]), None)
    return other is None or all(_orientation(points[0], other, p) == 0 for p in points)


def _within(a: list[float], b: list[float], c: list[float]) -> bool:
    """Whether ``c``, on the line of a -> b, lies on the segment a -> b (ends included)."""
    return (min(a[0], b[0]) <= c[0] <= max(a[0], b[0])
            and min(a[1], b[1]) <= c[1] <= max(a[1], b[1]))


def _segments_meet(p: list[float], q: list[float], r: list[float], s: list[float]) -> str | None:
    """How the segments p -> q and r -> s meet: "cross" (each passes through the other),
    "overlap" (on one line, sharing more than a point), "touch" (sharing a point, an end of
    one on the other), or None when they do not meet."""
    d1, d2 = _orientation(r, s, p), _orientation(r, s, q)
    d3, d4 = _orientation(p, q, r), _orientation(p, q, s)
    if d1 * d2 < 0 and d3 * d4 < 0:
        return "cross"
    if d1 == d2 == d3 == d4 == 0:  # on one line: compare their spans along it
        axis = 0 if p[0] != q[0] or r[0] != s[0] else 1
        low = max(min(p[axis], q[axis]), min(r[axis], s[axis]))
        high = min(max(p[axis], q[axis]), max(r[axis], s[axis]))
        return "overlap" if low < high else "touch" if low == high else None
    if ((d1 == 0 and _within(r, s, p)) or (d2 == 0 and _within(r, s, q))
            or (d3 == 0 and _within(p, q, r)) or (d4 == 0 and _within(p, q, s))):
        return "touch"
    return None


def _crossing_edges(points: list[list[float]]) -> tuple[str, int, int] | None:
    """The first two edges of the closed polygon ``points`` (not all on one line) that meet
    other than at the corner between them: (how, as ``_segments_meet``, edge, edge), an edge
    ``i`` running from ``points[i]`` to the next corner; None for a simple polygon. A corner
    repeated right after itself (an edge of zero length) is one corner. O(n^2): zones have
    few corners."""
    n = len(points)
    edges = [i for i in range(n) if points[i] != points[(i + 1) % n]]
    ends = [(points[i], points[(i + 1) % n]) for i in edges]
    boxes = [(min(p[0], q[0]), min(p[1], q[1]), max(p[0], q[0]), max(p[1], q[1]))
             for p, q in ends]
    m = len(edges)
    for a in range(m):
        (p, q), box = ends[a], boxes[a]
        for b in range(a + 1, m):
            (r, s), other = ends[b], boxes[b]
            if (box[0] > other[2] or other[0] > box[2] or box[1] > other[3]
                    or other[1] > box[3]):
                continue  # far apart
            if b == a + 1 or (a == 0 and b == m - 1):
                # Neighbours share a corner: they meet elsewhere only by doubling back on
                # one line (the far end of one towards the other).
                corner, far, other_far = (q, p, s) if b == a + 1 else (p, q, r)
                if (_orientation(corner, far, other_far) == 0
                        and ((far[0] - corner[0]) * (other_far[0] - corner[0])
                             + (far[1] - corner[1]) * (other_far[1] - corner[1])) > 0):
                    return "overlap", edges[a], edges[b]
                continue
            how = _segments_meet(p, q, r, s)
            if how is not None:
                return how, edges[a], edges[b]
    return None


def _number_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def _edge_text(points: list[list[float]], index: int) -> str:
    """Edge ``index`` of the polygon ``points`` as messages show it: ``edge 1 [0,150]->[640,272]``
    (numbered from 1)."""
    start, end = points[index], points[(index + 1) % len(points)]
    return (f"edge {index + 1} [{_number_text(start[0])},{_number_text(start[1])}]->"
            f"[{_number_text(end[0])},{_number_text(end[1])}]")


@dataclass
class SourceConfig:
    """One video source: a camera or a file."""

    name: str = field(metadata=_doc("Unique name used in logs, metrics and output paths "
                                    "(letters, digits, '_', '-', '.'; not starting with '.')."))
    uri: str = field(metadata=_doc(
        "A video file path, or a stream URL with one of the schemes "
        + ", ".join(f"{scheme}://" for scheme in sorted(STREAM_SCHEMES))
        + " (read through FFmpeg; a stream is live and reconnects by default)."))
    live: bool | None = field(
        default=None,
        metadata=_doc(
            "Live sources drop the oldest waiting frame when the pipeline falls behind; file "
            "sources block and never lose a frame. Default: true for stream URLs and looped "
            "files (loop), false for other files."
        ),
    )
    rtsp_transport: Literal["tcp", "udp"] = field(
        default="tcp", metadata=_doc("RTSP transport protocol.")
    )
    pace_fps: float | None = field(
        default=None,
        metadata=_doc("Deliver the frames at this rate in real time, like a camera (a file "
                      "played as a simulated camera, with live: true), or null for as fast as "
                      "the pipeline takes them.", min=0.1),
    )
    loop: bool = field(
        default=False,
        metadata=_doc("Files only: play the file again from its start whenever it ends, "
                      "forever: a simulated camera (with pace_fps) that ends only when stopped "
                      "or removed. A looped file is live (live: false is refused): its frame "
                      "numbers keep rising across passes, its pts go on from the previous "
                      "pass's last (each pass later by the file's duration), a paced one keeps "
                      "its schedule across the wrap, and start_frame numbers its frames from "
                      "there as for a stream (playing from the file's start)."),
    )
    max_lag_ms: float | None = field(
        default=500.0,
        metadata=_doc("Live sources: when decoding falls this many milliseconds behind the "
                      "source's real time (a paced source: its frame's due time; a stream: its "
                      "own clock), stop decoding and skip to the next keyframe at which it is "
                      "back within this lag; the frames skipped count as dropped and keep their "
                      "frame numbers. At least 1; null: never skip. Files never skip.",
                      min=1.0),
    )
    decode: Literal["auto", "cpu", "gpu"] = field(
        default="auto",
        metadata=_doc("Where to decode: gpu keeps frames on the GPU (NVDEC through PyAV), cpu "
                      "decodes with FFmpeg on the CPU. auto: gpu when inference runs on the GPU, "
                      "a GPU decoder is usable and no annotated video is written, else cpu."),
    )
    open_timeout_s: float = field(
        default=10.0, metadata=_doc("Seconds to wait when opening the source.", min=0.1)
    )
    read_timeout_s: float = field(
        default=10.0,
        metadata=_doc("Seconds without data before a stream counts as lost (then reconnects).",
                      min=0.1),
    )
    reconnect: bool | None = field(
        default=None,
        metadata=_doc("Reconnect a stream after any failure or its end, until the run stops; "
                      "the frame index keeps counting. Default: true for live sources. Files "
                      "never reconnect."),
    )
    reconnect_initial_s: float = field(
        default=0.5,
        metadata=_doc("First wait before reconnecting; doubles after each failed attempt "
                      "(with jitter: each wait is 50-100% of its nominal value).", min=0.01),
    )
    reconnect_max_s: float = field(
        default=10.0, metadata=_doc("Longest wait between reconnection attempts.", min=0.01)
    )
    classes: list[str | int] | None = field(
        default=None,
        metadata=_doc("Keep only detections of these classes (names or ids), or null for all."),
    )
    roi: list[list[float]] | None = field(
        default=None,
        metadata=_doc("Region of interest: a polygon [[x, y], ...] (at least 3 points, frame "
                      "pixels, in order around it: its edges may not cross); a detection whose "
                      "bottom-centre point lies outside is dropped. "
                      "null: the whole frame."),
    )
    detect_every: int = field(
        default=1,
        metadata=_doc("Run the detector on every Nth frame of this source only; the frames in "
                      "between still reach the video and the records (with the tracker's "
                      "predictions when tracking is on, else no detections).", min=1),
    )
    detect_fps: float | None = field(
        default=None,
        metadata=_doc("Run the detector at most this many times a second of the source's "
                      "timestamps (instead of detect_every), or null.", min=0.01),
    )
    tracker: Literal["none", "bytetrack"] = field(
        default="none",
        metadata=_doc("Track objects across frames: bytetrack gives each detection a "
                      "tracker_id (ByteTrack of roboflow's trackers package; on frames the "
                      "detector skips, the tracks' predicted boxes); none: no tracking."),
    )
    tracker_new_confidence: float = field(
        default=0.3,
        metadata=_doc("bytetrack: a detection scoring at least this starts a new track (and "
                      "is matched first); weaker ones only continue tracks. Suits the small "
                      "sample model; detectors with higher scores do better with ~0.6.",
                      min=0.0, max=1.0),
    )
    tracker_lost_s: float = field(
        default=1.0,
        metadata=_doc("bytetrack: seconds a track whose object is no longer detected is kept, "
                      "to give the object its id back when it is found again.", min=0.0),
    )
    tracker_class_aware: bool = field(
        default=False,
        metadata=_doc("bytetrack: track each class apart (one ByteTrack per class, one id "
                      "space), so a track never changes class: a detection only continues a "
                      "track of its own class. false: one tracker for all classes (a track "
                      "takes the class of its latest detection)."),
    )
    analytics: list[AnalyticsRegionConfig] | None = field(
        default=None,
        metadata=_doc("Counting zones and lines (needs tracker: bytetrack); events go to "
                      "output.events. null: none."),
    )
    start_frame: int = field(
        default=0,
        metadata=_doc("Resume at this frame: a file decodes and skips the frames before it "
                      "(their numbers are kept, nothing before it is written), a stream or a "
                      "looped file numbers its frames from it. The cluster supervisor sets it "
                      "when it moves a source (runtime.gpus, runtime.workers, --ray): the frame "
                      "after the source's last written record.", min=0),
    )
    start_pts: float | None = field(
        default=None,
        metadata=_doc("Live sources: the pts of the last frame written before this one, so "
                      "the pts go on after it (seconds; null: the first frame's pts is 0). "
                      "The supervisor sets it with start_frame when it moves a live source: "
                      "the pts of its last written record."),
    )

    @property
    def is_live(self) -> bool:
        return self.live if self.live is not None else (is_stream_url(self.uri) or self.loop)

    @property
    def should_reconnect(self) -> bool:
        """Whether this source reconnects after a failure (streams only)."""
        if not is_stream_url(self.uri):
            return False
        return self.reconnect if self.reconnect is not None else self.is_live

    def check(self, key: str, base_dir: Path) -> None:
        """Raise ConfigError unless the URI is an existing file or a well-formed stream URL.

        Args:
            key: where the source sits in the config (``sources[0]``), for the message.
            base_dir: folder a relative file path is resolved against.
        """
        if self.roi is not None:
            if (len(self.roi) < 3 or any(len(p) != 2 for p in self.roi)
                    or not all(math.isfinite(v) for p in self.roi for v in p)):
                raise ConfigError(f"{key}.roi: expected a polygon of at least 3 [x, y] points, "
                                  f"got {self.roi!r}")
            check_polygon(f"{key}.roi", "the region of interest", self.roi)
        if self.detect_fps is not None and self.detect_every != 1:
            raise ConfigError(f"{key}.detect_fps: set detect_every or detect_fps, not both (got "
                              f"detect_every {self.detect_every}, detect_fps {self.detect_fps})")
        if self.classes is not None and not self.classes:
            raise ConfigError(f"{key}.classes: expected class names or ids, or null for all, "
                              "got an empty list")
        self._check_analytics(key)
        where = f"{key}.uri (source {self.name!r})"
        if not self.uri:
            raise ConfigError(f"{where}: expected a file path or a URL, got ''")
        if not is_stream_url(self.uri):
            _check_file(where, self.uri, base_dir, "a video file")
            if self.reconnect:
                raise ConfigError(f"{key}.reconnect: files never reconnect; only stream URLs can")
            if self.loop and self.live is False:
                raise ConfigError(f"{key}.live: a looped file never ends, so it is live; drop "
                                  "live: false (or loop: true)")
            return
        shown = redact_url(self.uri)
        parts = urlsplit(self.uri)
        if parts.scheme not in STREAM_SCHEMES:
            allowed = ", ".join(sorted(STREAM_SCHEMES))
            raise ConfigError(f"{where}: unsupported URL scheme {parts.scheme!r} in {shown!r}; "
                              f"allowed: {allowed}")
        if self.loop:
            raise ConfigError(f"{key}.loop: only a file loops; {shown!r} is a stream URL (it "
                              "reconnects instead: reconnect)")
        try:
            port = parts.port
        except ValueError:
            hint = " (percent-encode '/', ':' and '@' inside credentials)" * ("@" in self.uri)
            raise ConfigError(f"{where}: bad port in {shown!r}{hint}") from None
        if not parts.hostname or any(c.isspace() for c in self.uri):
            raise ConfigError(f"{where}: expected scheme://host[:port]/path, got {shown!r}")
        if port == 0:
            raise ConfigError(f"{where}: bad port in {shown!r}")
        if self.reconnect_max_s < self.reconnect_initial_s:
            raise ConfigError(
                f"{key}.reconnect_max_s: expected a value >= reconnect_initial_s "
                f"({self.reconnect_initial_s}), got {self.reconnect_max_s}")

    def _check_analytics(self, key: str) -> None:
        if self.analytics is None:
            return
        if self.analytics and self.tracker == "none":
            raise ConfigError(f"{key}.analytics: zones and lines count tracked objects; set "
                              f"{key}.tracker: bytetrack")
        names: set[str] = set()
        for index, region in enumerate(self.analytics):
            region.check(f"{key}.analytics[{index}]")
            if region.name in names:
                raise ConfigError(f"{key}.analytics[{index}].name: duplicate name "
                                  f"{region.name!r} in this source's analytics")
            names.add(region.name)


@dataclass
class ModelConfig:
    """The detection model."""

    path: str = field(
        default="assets/models/yolov3-tiny.onnx",
        metadata=_doc("ONNX file of a YOLO-family detector (see layout)."),
    )
    class_names: str | None = field(
        default="assets/models/coco.names",
        metadata=_doc("Text file with one class name per line, or null: the names in the "
                      "model's metadata (Ultralytics exports carry them), else numeric ids."),
    )
    layout: Literal["auto", "yolov8", "yolov5", "end2end"] = field(
        default="auto",
        metadata=_doc("The output's layout. auto: from its shape. yolov8 (batch, 4 + classes, "
                      "anchors): YOLOv8/YOLO11; yolov5 (batch, anchors, 5 + classes): YOLOv5/"
                      "YOLOv7; end2end (batch, detections, 6: x1, y1, x2, y2, score, class): "
                      "YOLOv10, YOLO26 and exports with NMS inside (no NMS is run)."),
    )


@dataclass
class InferenceConfig:
    """How and where the model runs."""

    backend: Literal["auto", "onnxruntime", "torch", "tensorrt"] = field(
        default="auto",
        metadata=_doc("Inference backend; auto picks tensorrt, then torch on a GPU, else onnxruntime."),
    )
    device: Literal["auto", "cpu", "cuda"] = field(
        default="auto", metadata=_doc("auto uses the GPU when one is usable, else the CPU.")
    )
    precision: Literal["fp32", "fp16", "int8"] = field(
        default="fp16", metadata=_doc("Numeric precision on the GPU (the CPU path runs fp32).")
    )
    batch_size: int = field(
        default=4, metadata=_doc("Most frames, from any sources, in one inference call.", min=1,
                                 max=MAX_BATCH_SIZE)
    )
    batch_buckets: list[int] | None = field(
        default=None,
        metadata=_doc("torch backend on the GPU: the batch sizes captured as CUDA graphs at "
                      "start; a batch of n frames runs in the graph of the smallest bucket >= n "
                      "(the padding rows are never read). Each must be 1..batch_size; "
                      "batch_size is always a bucket. null: 2, 4, 8, then every 8 up to 64, every "
                      "16 up to 128, every 32 up to 256, every 64 beyond, up to batch_size."),
    )
    batch_timeout_ms: float = field(
        default=5.0,
        metadata=_doc("Longest wait for a batch to fill before running a partial one.", min=0.0),
    )
    gpu_id: int = field(default=0, metadata=_doc("CUDA device ordinal used on the GPU path.", min=0))
    calibration_video: str | None = field(
        default=None,
        metadata=_doc("int8 (tensorrt): a video file of the deployment scene to calibrate on; "
                      "default: the first file source."),
    )
    calibration_method: Literal["entropy", "minmax", "percentile"] = field(
        default="entropy", metadata=_doc("int8 (tensorrt): how quantisation ranges are chosen.")
    )
    calibration_frames: int = field(
        default=64, metadata=_doc("int8 (tensorrt): frames used for calibration.", min=1)
    )
    engine_cache: str = field(
        default="assets/engines",
        metadata=_doc("Folder for built TensorRT engines and torch compile artefacts."),
    )
    compile: bool = field(
        default=True,
        metadata=_doc("torch backend: compile the model with torch.compile (inductor) before "
                      "capturing CUDA graphs; artefacts are cached under engine_cache, so a "
                      "second start is fast. false runs the converted module eagerly."),
    )

    def buckets(self) -> list[int]:
        """The batch sizes captured as CUDA graphs: ``batch_buckets`` with ``batch_size`` added,
        or the default ladder (:func:`default_batch_buckets`), ascending."""
        if self.batch_buckets is None:
            return default_batch_buckets(self.batch_size)
        return sorted({*self.batch_buckets, self.batch_size})


def default_batch_buckets(batch_size: int) -> list[int]:
    """2, 4, 8, then every 8 up to 64, every 16 up to 128, every 32 up to 256, every 64 beyond,
    cut at ``batch_size``, which is always the last (``[1]`` for a batch_size of 1).

    A batch of n frames runs in the smallest bucket >= n, so from 33 frames up it computes at
    most a fifth more images than it has (37 run as 40); 1 is left out because its graph needs
    a compilation of its own (torch specialises a batch of 1), and a frame alone runs as 2.
    Each bucket costs about 0.1 s at start (measured on the H200, YOLOv8s 640): 11 for 64.
    """
    if batch_size == 1:
        return [1]
    ladder, size = [], 2
    while size < batch_size:
        ladder.append(size)
        size = size * 2 if size < 8 else size + max(8, 1 << (size.bit_length() - 3))
    return [*ladder, batch_size]



@dataclass
class NmsConfig:
    """Filtering of the model's candidates."""

    conf_threshold: float = field(
        default=0.25, metadata=_doc("Keep candidates scoring above this.", min=0.0, max=1.0)
    )
    iou_threshold: float = field(
        default=0.45,
        metadata=_doc("Suppress boxes overlapping a better one by more than this IoU.", min=0.0, max=1.0),
    )
    class_agnostic: bool = field(
        default=False, metadata=_doc("Suppress overlapping boxes across classes too.")
    )
    max_detections: int = field(
        default=300, metadata=_doc("Most detections kept per frame.", min=1)
    )


@dataclass
class OutputConfig:
    """What is written for each source. Paths may use {source}."""

    dir: str = field(default="output", metadata=_doc("Folder the outputs go into."))
    video: str | None = field(
        default="{source}.mp4",
        metadata=_doc("Annotated H.264 MP4 per source, or null for none."),
    )
    jsonl: str | None = field(
        default="{source}.jsonl",
        metadata=_doc("JSON Lines file, one record per frame, or null for none."),
    )
    video_crf: int = field(
        default=23, metadata=_doc("x264 quality (0 best .. 51 worst).", min=0, max=51)
    )
    trails: int = field(
        default=0,
        metadata=_doc("On the annotated video (and tracked sources only): each track's trail, "
                      "a line through the centres of its boxes on the source's last N frames, "
                      "fading with age. 0: no trails.", min=0, max=1000),
    )
    events: str | None = field(
        default="{source}.events.jsonl",
        metadata=_doc("JSON Lines file of analytics events (enter, exit, cross_in, cross_out), "
                      "one per event, for the sources with analytics; null for none."),
    )
    mqtt: MqttConfig | None = field(
        default=None,
        metadata=_doc("Publish the analytics events and counts to an MQTT broker, or null."),
    )
    webhooks: list[WebhookConfig] | None = field(
        default=None,
        metadata=_doc("POST each analytics event (the JSON of its events file line) to these "
                      "HTTP endpoints, in order, retried while one is down; or null."),
    )
    segment_s: float | None = field(
        default=None,
        metadata=_doc("Live sources: start new files (video, detections and events together) "
                      "whenever the capture time passes a multiple of this many seconds "
                      "since the Unix epoch (900: at :00, :15, :30 and :45), each named with "
                      "its first frame's UTC time (cam.mp4 -> cam.20261130T231500Z.mp4) and "
                      "renamed from its .partial name when the next one starts; at least 10. "
                      "null: one file per source. File sources are never segmented (their "
                      "outputs follow the file and end with it).",
                      min=SEGMENT_MIN_S),
    )
    event_media: EventMediaConfig | None = field(
        default=None,
        metadata=_doc("Per analytics event, a JPEG snapshot and an MP4 clip in a folder "
                      "named after the events file (bikes.events.jsonl -> bikes.events/), "
                      "referenced from "
                      "the event record (snapshot, clip); made off the pipeline's path, "
                      "dropped and counted when behind (events never are); or null."),
    )
    keep_hours: float | None = field(
        default=None,
        metadata=_doc("With segment_s: delete a live source's segments (only files with its "
                      "segment names, finished or .partial) last written more than this many "
                      "hours ago (at least one segment), at start and at every new segment. "
                      "null: keep everything."),
    )

    def check(self) -> None:
        """Raise ConfigError unless ``keep_hours`` comes with ``segment_s`` and keeps at
        least one segment, every webhook is well formed, each URL once, and the event
        media settings can work."""
        if self.event_media is not None:
            self.event_media.check("output.event_media")
            if self.events is None:
                raise ConfigError("output.event_media: needs output.events (the records that "
                                  "name each snapshot and clip, in <events file>/); set it, "
                                  "or output.event_media: null")
        urls: dict[str, int] = {}
        for i, webhook in enumerate(self.webhooks or ()):
            webhook.check(f"output.webhooks[{i}]")
            if (first := urls.setdefault(webhook.url, i)) != i:
                raise ConfigError(f"output.webhooks[{i}].url: the same URL as "
                                  f"output.webhooks[{first}] (one entry per URL: list both "
                                  f"entries' events in one)")
        if self.keep_hours is None:
            return
        if self.segment_s is None:
            raise ConfigError(f"output.keep_hours: deletes old segments, so it needs "
                              f"output.segment_s; got keep_hours {self.keep_hours:g} and "
                              f"segment_s null")
        if self.keep_hours * 3600 < self.segment_s:
            raise ConfigError(f"output.keep_hours: expected at least one segment "
                              f"({self.segment_s:g} s = {self.segment_s / 3600:.4g} h), got "
                              f"{self.keep_hours:g}")


@dataclass
class ClipConfig:
    """The clip of an analytics event: from ``pre_s`` before to ``post_s`` after it."""

    pre_s: float = field(default=5.0, metadata=_doc("Seconds of video before the event.",
                                                    min=0.0, max=60.0))
    post_s: float = field(default=5.0, metadata=_doc("Seconds of video after the event.",
                                                     min=0.0, max=60.0))
    ring_mb: float = field(
        default=64.0,
        metadata=_doc("A source without output.video: MB of recent frames (I420 copies) kept "
                      "in memory per source for its clips (fewer than pre_s of them when they "
                      "do not fit: the clip starts later).", min=1.0))


@dataclass
class EventMediaConfig:
    """A snapshot and a clip per analytics event (``stages/event_media.py``)."""

    snapshot: bool = field(
        default=True,
        metadata=_doc("Write a JPEG of the event's frame with the object's box highlighted "
                      "(and publish it, retained, to <prefix>/<source>/<zone or line>/snapshot "
                      "with output.mqtt)."))
    crop: bool = field(
        default=False,
        metadata=_doc("Crop the snapshot to the box plus half its width and height on each "
                      "side (at least 32 pixels), within the frame."))
    jpeg_quality: int = field(default=90, metadata=_doc("JPEG quality.", min=1, max=100))
    clip: ClipConfig | None = field(
        default_factory=ClipConfig,
        metadata=_doc("The event's clip: stream-copied from the source's own recording "
                      "(output.video) where it is written, else encoded from a ring of recent "
                      "frames in memory (so the sources decode on the CPU, not NVDEC); null for "
                      "none."))
    queue_size: int = field(
        default=128,
        metadata=_doc("Jobs waiting to be made, all sources together (a snapshot and a clip "
                      "are a job each: 128 holds 64 events); an event that finds it full gets "
                      "no media (dropped and counted; the event itself is kept).", min=1))
    keep_hours: float | None = field(
        default=None,
        metadata=_doc("Delete snapshots and clips (only names this run makes) last written "
                      "more than this many hours ago, at start and every 10 minutes; null: "
                      "keep everything.", min=0.0))

    def check(self, key: str) -> None:
        """Raise ConfigError unless some media is asked for and the numbers are finite
        (``key``: where it sits, ``output.event_media``)."""
        if not self.snapshot and self.clip is None:
            raise ConfigError(f"{key}: asks for nothing (snapshot false and clip null); "
                              f"set output.event_media to null instead")
        for name, value in (("keep_hours", self.keep_hours),
                            *((f"clip.{k}", getattr(self.clip, k))
                              for k in ("pre_s", "post_s", "ring_mb") if self.clip)):
            if value is not None and not math.isfinite(value):
                raise ConfigError(f"{key}.{name}: expected a finite number, got {value!r}")


@dataclass
class MqttConfig:
    """An MQTT broker the analytics events are published to (paho-mqtt)."""

    host: str = field(metadata=_doc("Broker host name or address."))
    port: int = field(default=1883, metadata=_doc("Broker port (8883 is usual with TLS).",
                                                  min=1, max=65535))
    username: str | None = field(default=None, metadata=_doc("User name, or null."))
    password: str | None = field(
        default=None, repr=False,
        metadata=_doc("Password, or null; use ${VAR} to keep it out of the file. Never logged."))
    tls: bool = field(default=False, metadata=_doc("Connect with TLS."))
    ca_file: str | None = field(
        default=None, metadata=_doc("TLS: CA certificate file to trust; null: the system's."))
    client_id: str = field(default="streamdet", metadata=_doc("MQTT client id."))
    topic_prefix: str = field(
        default="streamdet",
        metadata=_doc("Topics are <prefix>/<source>/events (QoS 1), <prefix>/<source>/counts "
                      "(retained) and <prefix>/availability (online/offline, last will)."))
    queue_size: int = field(
        default=10000,
        metadata=_doc("Messages kept while the broker is away; beyond that the oldest are "
                      "dropped and counted.", min=1))
    keepalive_s: int = field(default=30, metadata=_doc("MQTT keepalive in seconds.", min=5))


WEBHOOK_SCHEMES = ("http", "https")


@dataclass
class WebhookConfig:
    """An HTTP endpoint every analytics event is POSTed to (``pipeline/app/webhooks.py``)."""

    url: str = field(
        metadata=_doc("http:// or https:// URL the events are POSTed to (a JSON body each, "
                      "Content-Type application/json); use ${VAR} for a secret in it. Shown "
                      "in logs and metrics with credentials hidden."))
    events: list[str] | None = field(
        default=None,
        metadata=_doc("The kinds of event sent: enter, exit (zones), cross_in, cross_out "
                      "(lines); null for all."))
    headers: dict[str, str] | None = field(
        default=None, repr=False,
        metadata=_doc("Extra request headers ({Authorization: \"Bearer ${TOKEN}\"}), or null. "
                      "Never logged."))
    timeout_s: float = field(
        default=5.0,
        metadata=_doc("Seconds one request may take (connect, send, answer); a request that "
                      "takes longer is sent again (same Idempotency-Key)."))
    queue_size: int = field(
        default=10000,
        metadata=_doc("Events kept while the endpoint is down; beyond that the oldest are "
                      "dropped and counted.", min=1))

    def check(self, key: str) -> None:
        """Raise ConfigError unless the URL, the event kinds, the headers and the timeout
        can work (``key``: where it sits, ``output.webhooks[0]``)."""
        from pipeline.records import EVENT_KINDS

        parts = urlsplit(self.url)
        if parts.scheme.lower() not in WEBHOOK_SCHEMES or not parts.hostname:
            raise ConfigError(f"{key}.url: expected an http:// or https:// URL with a host, got "
                              f"{redact_url(self.url)!r}")
        if any(c.isspace() for c in self.url):
            raise ConfigError(f"{key}.url: expected a URL without spaces, got "
                              f"{redact_url(self.url)!r}")
        if self.events is not None:
            if not self.events:
                raise ConfigError(f"{key}.events: expected event kinds ({', '.join(EVENT_KINDS)}),"
                                  " or null for all, got an empty list")
            for i, kind in enumerate(self.events):
                if kind not in EVENT_KINDS:
                    raise ConfigError(f"{key}.events[{i}]: unknown event kind {kind!r}; expected "
                                      f"one of {', '.join(EVENT_KINDS)}")
        for name, value in (self.headers or {}).items():
            if not _HEADER_NAME.match(name):
                raise ConfigError(f"{key}.headers: {name!r} is not an HTTP header name")
            if any(c in value for c in "\r\n\0"):
                raise ConfigError(f"{key}.headers.{name}: a header value cannot hold a line "
                                  "break or NUL")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ConfigError(f"{key}.timeout_s: expected a number of seconds > 0, got "
                              f"{self.timeout_s!r}")


_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an HTTP token (RFC 9110)


@dataclass
class HttpConfig:
    """The live view: a read-only HTTP API and a page with every source's preview, state
    and counters (``pipeline/app/http.py``)."""

    host: str = field(
        default="127.0.0.1",
        metadata=_doc("Address to bind: 127.0.0.1 (this machine only), 0.0.0.0 (every "
                      "interface) or one of this machine's addresses; anything but loopback "
                      "needs token."))
    port: int = field(default=8080, metadata=_doc("TCP port; 0 picks a free one (logged).",
                                                  min=0, max=65535))
    token: str | None = field(
        default=None,
        metadata=_doc("Token every request must carry (Authorization: Bearer TOKEN; the page "
                      "asks for it once), or null; required when host is not a loopback "
                      "address. Use ${VAR} to keep it out of the file. Never logged."))
    preview_fps: float = field(
        default=5.0,
        metadata=_doc("Most pictures a second per source in the previews (JPEG, encoded only "
                      "while someone watches, never by a pipeline thread).", min=0.1, max=30.0))

    def check(self, key: str) -> None:
        """Raise ConfigError unless a token is set whenever ``host`` is not loopback, and
        is not empty (``key``: ``runtime.http``)."""
        if self.token is not None and not self.token.strip():
            raise ConfigError(f"{key}.token: expected a non-empty token (an unset variable?), "
                              "got ''")
        if self.token is None and not is_loopback(self.host):
            raise ConfigError(f"{key}.token: required when {key}.host is not a loopback "
                              f"address (got {self.host!r}); use token: ${{VAR}}")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


@dataclass
class RuntimeConfig:
    """Threads and queues."""

    queue_size: int = field(
        default=8, metadata=_doc("Capacity of every queue between stages, in items.", min=1)
    )
    log_format: Literal["console", "json"] = field(
        default="console", metadata=_doc("Log lines as readable text or as JSON objects.")
    )
    log_level: Literal["debug", "info", "warning", "error"] = field(
        default="info", metadata=_doc("Least severe log level printed.")
    )
    progress: bool = field(
        default=True, metadata=_doc("Show a progress bar for file sources (on a terminal).")
    )
    metrics_port: int | None = field(
        default=None,
        metadata=_doc("Serve Prometheus metrics at http://HOST:PORT/metrics (frames, time and "
                      "fps per stage and source, drops, queue depths, reconnections, latency "
                      "histogram, each source's state and last error), or null for none.",
                      min=1, max=65535),
    )
    metrics_host: str = field(
        default="127.0.0.1",
        metadata=_doc("Address the metrics server binds: 127.0.0.1 (this machine only), "
                      "0.0.0.0 (every interface, for a remote Prometheus) or one of this "
                      "machine's addresses; anything but loopback needs metrics_token."))
    metrics_token: str | None = field(
        default=None, repr=False,
        metadata=_doc("Token every metrics request must carry (Authorization: Bearer TOKEN; "
                      "Prometheus: authorization: {credentials: ...}), or null; required when "
                      "metrics_host is not a loopback address. Use ${VAR}. Never logged."))
    decode_workers: int | None = field(
        default=None,
        metadata=_doc("The whole pipeline in one process (runtime.workers: 1): processes that "
                      "decode the CPU-decoded sources, each owning a share of them; frames "
                      "reach the pipeline through shared memory. null: one per source, at most "
                      "the core count less 2, at least 1 (logged). 0: decode in threads of the "
                      "pipeline process. Source workers (runtime.workers > 1) on the GPU path "
                      "decode their CPU-decoded sources in such processes too, at lower "
                      "priority (nice 10: NVDEC's feeding and the workers' stages come first; "
                      "the count sized for their share of the cores); on the CPU path, in "
                      "threads of their own process.", min=0),
    )
    nvdec_fps: float = field(
        default=4500.0,
        metadata=_doc("1080p frames/s one GPU's NVDEC decodes (H.264 through PyAV; the H200 "
                      "measured 4,185 to 4,823 in different runs, hence the default 4,500: "
                      "run.py capacity prints yours as decode alone). On the "
                      "GPU path, decode: auto sources fill NVDEC up to 80% of this, then go "
                      "to CPU decode (runtime.cpu_decode_fps); past both, they are shared in "
                      "proportion to the two; unpaced files always are (logged).", min=1.0),
    )
    cpu_decode_fps: float = field(
        default=0.0,
        metadata=_doc("1080p frames/s CPU decode adds beside NVDEC on this machine (see "
                      "runtime.nvdec_fps); 0 (the default): decode: auto never places a "
                      "source on CPU decode. Set it from run.py capacity's 'NVDEC and the CPU "
                      "at once' only where that beats NVDEC alone: on the H200's 16-core host "
                      "it did not (both at once 3,163 frames/s against NVDEC alone's 4,185 in "
                      "the same run: NVDEC's feeding through PyAV needs those cores too).",
                      min=0.0),
    )
    http: HttpConfig | None = field(
        default=None,
        metadata=_doc("Serve the live view (HTTP API and page: every source's preview, state "
                      "and counters; GET /api/health), or null for none."))
    stop_when: Literal["all_ended", "files_ended", "never"] = field(
        default="all_ended",
        metadata=_doc("When the run ends by itself: all_ended: once every source ended (a "
                      "camera ends only by failing for good, so a run with cameras goes on "
                      "until Ctrl-C or SIGTERM, its files finalised as each ends); "
                      "files_ended: once every file source ended, stopping the cameras then "
                      "too; never: only on Ctrl-C or SIGTERM (sources are added and removed "
                      "through the HTTP API)."))
    gpus: list[int] | Literal["all"] | None = field(
        default=None,
        metadata=_doc("Use the GPUs listed ([0, 1]; all: every GPU of this machine): one "
                      "engine process per GPU (the model) and runtime.workers source workers "
                      "for each, the sources shared out by load (width x height x frame "
                      "rate); a worker that dies has its sources moved to the others (files "
                      "resume after their last written record) and is restarted with "
                      "backoff, an engine that dies is restarted and its workers go on. "
                      "null: inference.gpu_id (or the CPU path). With --ray: one unit per "
                      "GPU listed (the list's length; the cluster must have that many)."),
    )
    workers: int | None = field(
        default=None,
        metadata=_doc("Source worker processes per GPU (on the CPU path: in all). Each owns "
                      "a share of the sources end to end but the model: decoding (NVDEC or "
                      "CPU), tracking, analytics, outputs; one engine process per GPU holds "
                      "the model and batches every worker's frames together. 1: the whole "
                      "pipeline in one process (the Python API's per-frame results need "
                      "this). null: one per source, at most 5 per GPU and half the cores (logged). With "
                      "--ray: per unit (one unit per GPU of the Ray cluster, else per node: "
                      "an actor holding that GPU's engine and its workers); null: one per "
                      "source of its share, at most 5 and half its share of the cores.", min=1),
    )
    spare_workers: int | None = field(
        default=None,
        metadata=_doc("Idle source workers per GPU (on the CPU path: in all), started with "
                      "the others and connected to the engine, that take every source of a "
                      "worker that dies at once: its cameras go on within seconds and the "
                      "other workers are not touched (without a spare, its sources are "
                      "shared out among them); the dead worker, restarted, becomes the "
                      "spare. null: 1 where there are two or more source workers, else 0. "
                      "With --ray: per unit.", min=0),
    )
    standby_engine: bool = field(
        default=True,
        metadata=_doc("Keep a standby beside each engine process: started once the engine "
                      "is ready, it does what a start does before it touches the GPU (the "
                      "imports; with torch, the model converted on the host) and waits, "
                      "holding no GPU memory (host memory: about 0.8 GB with torch, 0.2 GB "
                      "on the CPU path). When the engine dies it takes over at once: on the "
                      "H200 at 100 cameras, every camera delivered again 11-18 s after an "
                      "engine's kill -9 (17-25 s without it). A new standby starts once it "
                      "is ready. false: none (a dead engine is started anew after a "
                      "backoff). Not with runtime.workers: 1 (no engine process)."),
    )
    cuda_mps: bool | Literal["auto"] = field(
        default="auto",
        metadata=_doc("GPU path with an engine process: run the engine and source workers "
                      "as clients of a CUDA MPS server of the run's own (a control daemon "
                      "started in a private folder, quit at the end), so the GPU runs their "
                      "work side by side instead of time-slicing between their contexts. On "
                      "an H200 with 1080p cameras at 30 fps: 150 held (120 without: 150 "
                      "delivered 4,122-4,208 of 4,500 frames/s). Under MPS a "
                      "fatal GPU error of one process (not a kill) ends the GPU work of every "
                      "process of the run on that GPU. auto: on where "
                      "nvidia-cuda-mps-control (the NVIDIA driver's utilities) is on PATH "
                      "and no daemon of the machine's runs (then its clients), said in the "
                      "log, and a daemon that fails to start is a warning; true: needed (a "
                      "one-line error without); false: off. Nothing on the CPU path or with "
                      "runtime.workers: 1 (one process)."),
    )
    max_restarts: int = field(
        default=3,
        metadata=_doc("Times a source worker, engine or Ray unit that died is restarted "
                      "(after a backoff); a worker's sources move to the others at once.",
                      min=0),
    )
    staging_slots: int = field(
        default=0,
        metadata=_doc("Host frame slots (frames in flight between decode and the last stage "
                      "reading them; pinned on the GPU path); 0 sizes them from the number "
                      "of sources, queue_size and batch_size.", min=0),
    )

    def __post_init__(self) -> None:
        """The metrics bind takes the HTTP API's token rule (``HttpConfig.check``)."""
        token = self.metrics_token
        if token is not None and not token.strip():
            raise ConfigError("runtime.metrics_token: expected a non-empty token (an unset "
                              "variable?), got ''")
        if token is None and not is_loopback(self.metrics_host):
            raise ConfigError(f"runtime.metrics_token: required when runtime.metrics_host is "
                              f"not a loopback address (got {self.metrics_host!r}); use "
                              "metrics_token: ${VAR}")


@dataclass
class PipelineConfig:
    """The whole configuration file."""

    sources: list[SourceConfig] = field(metadata=_doc("The cameras and files to analyse."))
    model: ModelConfig = field(default_factory=ModelConfig, metadata=_doc("The model."))
    inference: InferenceConfig = field(default_factory=InferenceConfig, metadata=_doc("Inference."))
    nms: NmsConfig = field(default_factory=NmsConfig, metadata=_doc("Non-maximum suppression."))
    output: OutputConfig = field(default_factory=OutputConfig, metadata=_doc("Outputs."))
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig, metadata=_doc("Runtime."))

    def output_path(self, template: str, source: str) -> Path:
        """The path of one output file of ``source`` from its template."""
        return Path(self.output.dir) / template.format(source=source)

    def output_paths(self, source: SourceConfig) -> list[Path]:
        """The final paths of every output ``output`` names for ``source`` (events only for
        a source with analytics), whether they exist or not."""
        return [self.output_path(template, source.name) for key in OUTPUT_KEYS
                if (template := getattr(self.output, key)) and (key != "events"
                                                                or source.analytics)]

    def sources_writing(self, key: str) -> list[SourceConfig]:
        """The sources that write output ``key`` (one of ``OUTPUT_KEYS``) when it is set:
        every source, except for ``events``: the sources with analytics."""
        if key == "events":
            return [source for source in self.sources if source.analytics]
        return list(self.sources)


# The per-source output files of ``OutputConfig``.
OUTPUT_KEYS = ("video", "jsonl", "events")


_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+$")
# warned for a file read live without pace_fps (``pipeline.app.run.warn_unpaced_files``, and
# as such a source is added while the run goes on)
UNPACED_FILES = ("a live file without pace_fps is read as fast as it decodes and drops the "
                 "frames the pipeline is too slow to take: set pace_fps to the file's frame "
                 "rate to play it as a camera, or drop live: true (and loop: true) to keep "
                 "every frame")
MAX_NAME_LENGTH = 100  # a source's name goes into file names (with a suffix: under 255 bytes)


def is_stream_url(uri: str) -> bool:
    """True for network stream URLs (rtsp, rtsps, rtmp, http, udp...)."""
    return re.match(r"^[a-z][a-z0-9+.-]*://", uri.lower()) is not None


_SECRET_QUERY = re.compile(r"(?i)\b(password|passwd|pwd|pass|token|auth|key|secret)=[^&#\s]*")


def redact_url(uri: str) -> str:
    """The URI with credentials hidden: ``user:password@`` and password-like query values
    become ``***`` (greedy up to the last ``@``, so a password holding ``@`` or ``/`` is
    hidden too)."""
    return _SECRET_QUERY.sub(r"\1=***", re.sub(r"(?<=://)\S*@", "***@", uri))


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if bool in options:  # "true or false or 'auto'": a Literal beside a bool, its values
            return " or ".join(
                "true or false" if a is bool else " or ".join(map(repr, typing.get_args(a)))
                if typing.get_origin(a) is Literal else _describe(a) for a in options)
        return " or ".join(_describe(a) for a in options)
    if origin is list:
        return "a list"
    if origin is dict or dataclasses.is_dataclass(tp):
        return "a mapping"
    if tp is type(None):
        return "null"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[tp]


def _same_shape(value: Any, tp: Any) -> bool:
    """Whether ``value`` is a list and ``tp`` a list type, or a mapping and ``tp`` a section."""
    if isinstance(value, list):
        return typing.get_origin(tp) is list
    return isinstance(value, dict) and (dataclasses.is_dataclass(tp)
                                        or typing.get_origin(tp) is dict)


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the type ``tp`` and return it converted; raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        closest = None
        for option in typing.get_args(tp):
            try:
                return _convert(value, option, key)
            except ConfigError as error:
                # A list or mapping that fails inside (a zone's bad key) keeps that message.
                if closest is None and _same_shape(value, option):
                    closest = error
        if closest is not None:
            raise closest
    elif origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif origin is list:
        if isinstance(value, list):
            (item_type,) = typing.get_args(tp)
            return [_convert(v, item_type, f"{key}[{i}]") for i, v in enumerate(value)]
    elif origin is dict:
        if isinstance(value, dict):
            key_type, value_type = typing.get_args(tp)
            return {_convert(k, key_type, key): _convert(v, value_type, f"{key}.{k}")
                    for k, v in value.items()}
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            return _build(tp, value, key)
    elif tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{key}: expected {_describe(tp)}, got {value!r}")


# Keys of earlier versions, with what replaced them (the message a config using one gets).
RENAMED_KEYS = {
    "runtime.pipelines": "replaced by runtime.workers: one engine per GPU holds the model "
                         "and source worker processes feed it; leave runtime.workers out for "
                         "the automatic count, or set it (1: the whole pipeline in one "
                         "process)",
}


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            where = f"{prefix}.{key}" if prefix else str(key)
            if where in RENAMED_KEYS:
                raise ConfigError(f"{where}: {RENAMED_KEYS[where]}")
            allowed = ", ".join(fields)
            near = difflib.get_close_matches(str(key), fields, n=1, cutoff=0.75)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"{where}: unknown key; allowed keys here: {allowed}{hint}")
    kwargs = {}
    for name, f in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{key}: required key is missing ({f.metadata.get('doc', '')})")
            continue
        value = _convert(data[name], hints[name], key)
        low, high = f.metadata.get("min"), f.metadata.get("max")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if (low is not None and value < low) or (high is not None and value > high):
                bounds = f">= {low}" if high is None else f"between {low} and {high}"
                raise ConfigError(f"{key}: expected a value {bounds}, got {value!r}")
        kwargs[name] = value
    return cls(**kwargs)


def _source_key(config: PipelineConfig, index: int, added_key: str | None) -> str:
    """Source ``index``'s key in messages: ``sources[index]``, or ``added_key`` for the last
    source when it is one added to a running run (``check_config``)."""
    last = index == len(config.sources) - 1
    return added_key if added_key is not None and last else f"sources[{index}]"


def _check_semantics(config: PipelineConfig, base_dir: Path, added_key: str | None) -> None:
    if not config.sources:
        raise ConfigError("sources: expected at least one source, got an empty list")
    seen: set[str] = set()
    for i, source in enumerate(config.sources):
        key = _source_key(config, i, added_key)
        if not _NAME_PATTERN.match(source.name):
            raise ConfigError(
                f"{key}.name: expected letters, digits, '_', '-' or '.', got {source.name!r}"
            )
        if source.name.startswith("."):
            raise ConfigError(f"{key}.name: expected a name not starting with '.' (it goes "
                              f"into file names: '.' and '..' are folders, '.x' a hidden "
                              f"file), got {source.name!r}")
        if len(source.name) > MAX_NAME_LENGTH:
            raise ConfigError(f"{key}.name: expected at most {MAX_NAME_LENGTH} characters, got "
                              f"{len(source.name)} ({source.name[:20]}...)")
        if source.name in seen:
            raise ConfigError(f"{key}.name: duplicate source name {source.name!r}")
        seen.add(source.name)
        source.check(key, base_dir)
    for key, path, kind in (("model.path", config.model.path, "a model file"),
                            ("model.class_names", config.model.class_names, "a names file")):
        if path is not None:
            _check_file(key, path, base_dir, kind)
    for key in OUTPUT_KEYS:
        template = getattr(config.output, key)
        if template is None:
            continue
        if "{source}" not in template and len(config.sources_writing(key)) > 1:
            raise ConfigError(
                f"output.{key}: with several sources the path must contain {{source}}, got {template!r}"
            )
        try:
            template.format(source="x")
        except (KeyError, IndexError, ValueError):
            raise ConfigError(
                f"output.{key}: only {{source}} may be used in the path, got {template!r}"
            ) from None
    _check_output_paths(config, base_dir, added_key)
    config.output.check()
    if config.runtime.http is not None:
        config.runtime.http.check("runtime.http")
    buckets = config.inference.batch_buckets
    if buckets is not None and (not buckets or min(buckets) < 1
                                or max(buckets) > config.inference.batch_size):
        raise ConfigError(f"inference.batch_buckets: expected batch sizes from 1 to "
                          f"inference.batch_size ({config.inference.batch_size}), got {buckets!r}")
    runtime = config.runtime
    if isinstance(runtime.gpus, list):
        if not runtime.gpus or len(set(runtime.gpus)) != len(runtime.gpus) or min(runtime.gpus) < 0:
            raise ConfigError(f"runtime.gpus: expected distinct GPU numbers >= 0 (or all, or "
                              f"null), got {runtime.gpus!r}")


def _check_file(where: str, path: str, base_dir: Path, kind: str) -> None:
    """Raise a ``ConfigError`` at ``where`` unless ``path`` (relative: to ``base_dir``) is a
    file; a relative path that is not found says where it was looked for."""
    found = base_dir / path
    if found.is_dir():
        raise ConfigError(f"{where}: {path!r} is a folder, not {kind}")
    if not found.is_file():
        looked = "" if Path(path).is_absolute() else f" (looked for in {base_dir.resolve()})"
        raise ConfigError(f"{where}: file not found: {path!r}{looked}")


def partial_path(path: Path) -> Path:
    """Where an output is written until it is complete (``cam.jsonl`` -> ``cam.partial.jsonl``)."""
    return path.with_name(f"{path.stem}.partial{path.suffix}")


# The names a source's sink gives files beside its output ``NAME.EXT`` besides
# ``NAME.partial.EXT`` (``stages.sinks``): a resumed file's video parts
# (``resumed_video_path``: ``NAME.from-1200.mp4``) and an earlier run's video set aside
# (``older_video_path``: ``NAME.older.mp4``), each also ``.partial``; a live source's segments
# (``segment_path``: ``NAME.20261130T231500Z.EXT``). The sink renames and deletes files of
# those names as its own.
SEGMENT_STAMP = "%Y%m%dT%H%M%SZ"  # a segment's first frame, UTC: sorts as text in time order
SEGMENT_STAMP_PATTERN = r"\d{8}T\d{6}Z"  # what SEGMENT_STAMP writes
_DERIVED_NAME = re.compile(rf"(?P<stem>.+)\.(?:(?P<part>from-\d+)|(?P<older>older)|"
                           rf"(?P<segment>{SEGMENT_STAMP_PATTERN}))(?:\.partial)?")
_DERIVED_WHAT = {"part": ("video", "a resumed run's part of its video, NAME.from-FRAME.EXT"),
                 "older": ("video", "its earlier run's video set aside, NAME.older.EXT"),
                 "segment": (None, "its segment, NAME.YYYYMMDDTHHMMSSZ.EXT")}


def derived_output(path: Path) -> tuple[Path, str] | None:
    """``(output, kind)`` when ``path``'s name is one the sink of the output file ``output``
    would make beside it (``_DERIVED_NAME``: ``cam.from-0.mp4`` -> ``(cam.mp4, "part")``),
    else None."""
    match = _DERIVED_NAME.fullmatch(path.stem)
    if match is None:
        return None
    kind = next(k for k in _DERIVED_WHAT if match.group(k) is not None)
    return path.with_name(match.group("stem") + path.suffix), kind


def _check_output_paths(config: PipelineConfig, base_dir: Path, added_key: str | None) -> None:
    """The output folder is not a file, and no two of the files a run reads or writes are one
    file: each output, its temporary ``.partial`` name, every file source and the model (and
    its class names); nor is an output a name another source's sink makes beside its own
    (``derived_output``: a source ``bikes.older`` beside ``bikes`` once had its finished
    video deleted as ``bikes``'s earlier one). Paths are compared as the file system finds
    them (``same_file_key``): absolute, symlinks resolved, case folded where the file system
    folds it, so a file reached by another spelling is caught too. Two writers of one file
    would lose one of them; an output over an input would destroy the input."""
    folder = base_dir / config.output.dir
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"output.dir: {config.output.dir!r} exists and is not a folder")
    owners: dict[str, str] = {}  # same_file_key -> what reads or writes it
    folds: dict[Path, bool] = {}  # a folder -> whether its file system folds case

    def claim(key: str, path: Path, what: str) -> None:
        other = owners.setdefault(same_file_key(path, folds), what)
        if other != what:
            raise ConfigError(f"{key}: {what} would be {str(path)!r}, which is also {other}")

    # Inputs first (several sources may read one file); then each output may be none of them.
    for i, source in enumerate(config.sources):
        if not is_stream_url(source.uri):
            owners.setdefault(same_file_key(base_dir / source.uri, folds),
                              f"{_source_key(config, i, added_key)}.uri (the input of source "
                              f"{source.name!r})")
    for key in ("model.path", "model.class_names"):
        if (value := getattr(config.model, key.split(".")[1])) is not None:
            owners.setdefault(same_file_key(base_dir / value, folds), key)
    inside = os.path.realpath(folder)  # (a name through a symlink into it is inside it)
    written = list(output_files(config, base_dir))
    for key, name, final in written:
        if os.path.commonpath([inside, os.path.realpath(final)]) != inside:
            raise ConfigError(f"output.{key}: {getattr(config.output, key)!r} leaves output.dir "
                              f"({config.output.dir!r}): source {name!r} would write "
                              f"{str(final)!r}; name a file inside it (a subfolder is fine)")
        claim(f"output.{key}", final, f"output.{key} of source {name!r}")
        claim(f"output.{key}", partial_path(final),
              f"the temporary file of output.{key} of source {name!r}")
    outputs = {same_file_key(final, folds): (key, name) for key, name, final in written}
    for key, name, final in written:
        if (derived := derived_output(final)) is None:
            continue
        base, kind = derived
        other_key, other = outputs.get(same_file_key(base, folds), (None, name))
        only_key, what = _DERIVED_WHAT[kind]
        if other != name and only_key in (None, other_key) and (
                kind != "segment" or config.output.segment_s is not None):
            raise ConfigError(f"output.{key}: output.{key} of source {name!r} would be "
                              f"{str(final)!r}, a name output.{other_key} of source {other!r} "
                              f"uses for {what}: rename source {name!r}")


def output_files(config: PipelineConfig, base_dir: Path) -> Iterator[tuple[str, str, Path]]:
    """(output key, source name, final path) of every output file the run writes, in source
    order: each also has a temporary name while it is written (``partial_path``)."""
    folder = base_dir / config.output.dir
    for source in config.sources:
        for key in OUTPUT_KEYS:
            template = getattr(config.output, key)
            if template is not None and source in config.sources_writing(key):
                yield key, source.name, Path(os.path.normpath(
                    folder / template.format(source=source.name)))


def same_file_key(path: Path, folds: dict[Path, bool] | None = None) -> str:
    """A text that is equal for two paths exactly when they name the same file (existing or
    not): the absolute path with every symlink resolved (``os.path.realpath``), case folded
    when its folder's file system folds case (``folds_case``; ``folds`` caches the answer per
    folder)."""
    real = Path(os.path.realpath(path))
    cache = {} if folds is None else folds
    if real.parent not in cache:
        cache[real.parent] = folds_case(real.parent)
    return str(real).casefold() if cache[real.parent] else str(real)


def folds_case(folder: Path) -> bool:
    """Whether the file system holding ``folder`` (or its nearest existing parent) treats
    names that differ in case as one: its own name (or a parent's, the first with a letter
    in it) spelled in the other case names the same folder. Nothing is written to find out.
    False when no existing folder on the way has a letter in its name."""
    for existing in (folder, *folder.parents):
        if not existing.is_dir() or existing.name.swapcase() == existing.name:
            continue
        other = existing.with_name(existing.name.swapcase())
        try:
            return other.exists() and os.path.samefile(existing, other)
        except OSError:
            return False
    return False


def build_section(cls: type, data: dict[str, Any], key: str) -> Any:
    """One section of the file (``SourceConfig`` at ``sources[3]``, say) from its mapping,
    checked key by key as ``parse_config`` checks it.

    Raises:
        ConfigError: a one-line message naming the key.
    """
    return _build(cls, data, key)


def check_config(config: PipelineConfig, base_dir: Path = Path("."),
                 added_key: str | None = None) -> None:
    """The checks across keys ``parse_config`` makes (names, files, output paths).

    Args:
        config: the configuration; for a source added to a running run, the run's
            unfinished sources and then the added one.
        base_dir: folder relative file paths are checked against.
        added_key: the added source's key in messages (``sources[N]``, N its place among
            every source the run has had), as its own keys' messages name it.

    Raises:
        ConfigError: a one-line message naming the key.
    """
    _check_semantics(config, base_dir, added_key)


def parse_config(data: Any, base_dir: Path = Path(".")) -> PipelineConfig:
    """Validate a parsed YAML document and return the configuration.

    Args:
        data: the YAML document as Python objects.
        base_dir: folder relative file paths are checked against (the working directory).

    Raises:
        ConfigError: with a one-line message naming the key, the value and what is allowed.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping at the top level, got {data!r}")
    config = _build(PipelineConfig, data, "")
    _check_semantics(config, base_dir, None)
    return config


_ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def substitute_env(data: Any, environ: typing.Mapping[str, str], key: str = "") -> Any:
    """``data`` with every ``${VAR}`` in its strings replaced by the environment variable
    (camera passwords stay out of YAML files); ``$${`` stays a literal ``${``.

    Raises:
        ConfigError: a variable is not set (naming it and the key that uses it).
    """
    if isinstance(data, dict):
        return {k: substitute_env(v, environ, f"{key}.{k}" if key else str(k))
                for k, v in data.items()}
    if isinstance(data, list):
        return [substitute_env(v, environ, f"{key}[{i}]") for i, v in enumerate(data)]
    if not isinstance(data, str) or "${" not in data:
        return data

    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in environ:
            raise ConfigError(f"{key}: environment variable {name} is not set")
        return environ[name]

    parts = data.split("$${")
    return "${".join(_ENV_REFERENCE.sub(value, part) for part in parts)


_SET_PATH = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)((?:\[\d+\])*)")


def apply_overrides(data: Any, overrides: typing.Sequence[str]) -> Any:
    """``data`` (the parsed YAML) with ``key.path=value`` overrides applied (``--set``), each
    value read as YAML (``4``, ``true``, ``null``, ``[a, b]``, text); list items are
    ``sources[0].uri``. The result is validated like the file.

    Raises:
        ConfigError: an override is not ``key=value`` or names a list item that is not there.
    """
    data = {} if data is None else data
    for override in overrides:
        path, sep, text = override.partition("=")
        if not sep or not path.strip():
            raise ConfigError(f"--set {override}: expected key.path=value")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        steps: list[str | int] = []
        for part in path.strip().split("."):
            match = _SET_PATH.fullmatch(part)
            if match is None:
                raise ConfigError(f"--set {override}: {part!r} is not a key name")
            steps.append(match.group(1))
            steps.extend(int(i) for i in re.findall(r"\[(\d+)\]", match.group(2)))
        node = data
        for step, following in zip(steps, steps[1:]):
            if isinstance(step, int):
                if not isinstance(node, list) or step >= len(node):
                    raise ConfigError(f"--set {override}: there is no item {step} there")
                node = node[step]
            else:
                if not isinstance(node, dict):
                    raise ConfigError(f"--set {override}: {step!r} is not inside a mapping")
                node = node.setdefault(step, [] if isinstance(following, int) else {})
        last = steps[-1]
        if isinstance(last, int):
            if not isinstance(node, list) or last > len(node):
                raise ConfigError(f"--set {override}: there is no item {last} there")
            node[last:last + 1] = [value]
        elif isinstance(node, dict):
            node[last] = value
        else:
            raise ConfigError(f"--set {override}: {last!r} is not inside a mapping")
    return data


def load_config(path: str | Path, overrides: typing.Sequence[str] = (),
                environ: typing.Mapping[str, str] | None = None) -> PipelineConfig:
    """Read and validate a YAML configuration file, with ``--set`` ``overrides`` applied and
    ``${VAR}`` references replaced from ``environ`` (default: the process environment).

    Raises:
        ConfigError: the file is missing, is not YAML, holds a bad value, or uses an unset
            environment variable.
    """
    data = read_config_data(path, overrides)
    config = parse_config(substitute_env(data, os.environ if environ is None else environ))
    itself = same_file_key(Path(path))  # an output over the config would destroy it
    for key, name, final in output_files(config, Path(".")):
        for written in (final, partial_path(final)):
            if same_file_key(written) == itself:
                raise ConfigError(f"output.{key}: source {name!r} would write "
                                  f"{str(written)!r}, which is the config file being run")
    return config


def read_config_data(path: str | Path, overrides: typing.Sequence[str] = ()) -> Any:
    """A YAML configuration file as written (``${VAR}`` kept), ``overrides`` applied; not
    validated (``load_config`` does that).

    Raises:
        ConfigError: the file is missing or is not YAML, or an override is malformed.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"config: cannot read {str(path)!r}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"config: {str(path)!r} is not a text (YAML) file: not UTF-8 at "
                          f"byte {error.start}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as error:
        raise ConfigError(f"config: {str(path)!r}: {error}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config: {str(path)!r} is not valid YAML{where}") from None
    return apply_overrides(data, overrides)


class _DuplicateKey(Exception):
    """A mapping of the YAML file repeats a key."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a repeated key is an error: plain YAML keeps the last
    one silently (two ``sources:`` lists would lose the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise _DuplicateKey(f"duplicate key {key!r} at line {key_node.start_mark.line + 1}")
            seen.add(key)
        return super().construct_mapping(node, deep)


def _as_yaml(value: Any) -> str:
    """A default as the YAML file would spell it (``null``, ``true``, ``'auto'``, ``5.0``)."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value)


def describe_schema(cls: type = PipelineConfig, prefix: str = "") -> list[str]:
    """One line per configuration key: name, default and documentation."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        shown = options[0] if typing.get_origin(tp) in (typing.Union, types.UnionType) and \
            len(options) == 1 else tp  # X | None is described as X
        inner = typing.get_args(shown)[0] if typing.get_origin(shown) is list else shown
        if dataclasses.is_dataclass(inner):
            suffix = "[]" if inner is not shown else ""
            lines.append(f"{key}{suffix}: {f.metadata.get('doc', '')}")
            lines.extend(describe_schema(inner, f"  {key}{suffix}."))
            continue
        default = ("required" if f.default is dataclasses.MISSING
                   else f"default {_as_yaml(f.default)}")
        lines.append(f"{key} ({_describe(tp)}; {default}): {f.metadata.get('doc', '')}")
    return lines
