"""Analytics: counting zones and directed lines on tracked objects, per source.

Runs after the tracker stage, once per batch, frame by frame in batch order (a source's
frames come in frame order). Each source's zones and lines (``sources[i].analytics``) see
that source's tracked detections and emit ``AnalyticsEvent`` records, which travel on with
the batch (``BatchDetections.events``) to the annotate stage (counts on the video) and the
sinks (``output.events``), and go to MQTT and webhooks when they are configured.

Rules, the same for zones and lines:

- An object's place is its anchor, the bottom centre of its box (where it stands, as for the
  source's ``roi``).
- Only confirmed tracks count: a detection with ``tracker_id`` -1 never counts, and a track
  counts once it has been in ``min_track_frames`` frames of the source (a false track that
  lives two frames never counts, and never double counts as supervision issue 2578 did).
- Hysteresis: an anchor closer than ``margin_px`` to the line or to the zone's edge tells
  nothing (the object keeps its side), and a change counts once the object has been seen on
  its new side ``min_frames`` frames in a row: a box jittering on the line counts once.
- The frame's border is no edge: nothing crosses it (a box cut off by the frame has its
  anchor on the border). A zone's edges that lie on the border have no margin, so an anchor
  on or near them, inside the polygon otherwise, is inside; a line's end on the border
  reaches to the border (its crossings count there too, also beside a slanted line's end).

A line (supervision's ``LineZone``) counts a crossing "in" when an object goes from the left
of start -> end to its right, as the picture is shown (y pointing down: for a line drawn from
left to right, moving down is in), "out" the other way. It counts only crossings between its
ends (within the band perpendicular to the segment); a track's first side is where it is
first seen as a confirmed track (no crossing), and a track missing for ``min_frames`` + 1
frames in a row starts afresh.

A zone (a polygon) emits "enter" when a track is confirmed inside (also a track first seen
inside) and "exit" when it is confirmed outside or is lost (not seen on ``min_frames`` frames
in a row: the number inside drops as soon as the object is gone, and it enters again if
found inside), and for every track still inside when the source ends (``close``: on its last
frame, carried by the end marker to the events file), with ``dwell_s``: the stream time (pts,
else frame index / rate; kept rising when a camera's pts restart after a reconnection) from
its first to its last frame inside. A track's class is fixed
when it enters, so a zone's entries minus its exits, by class, are the objects inside now.
Counts are running sums of the events (``AnalyticsCounts``), so the events file, the counts
published and the Prometheus metrics agree by construction.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import cv2
import numpy as np
import structlog

from pipeline.config import AnalyticsRegionConfig, SourceConfig
from pipeline.records import AnalyticsEvent, BatchDetections, EndOfStream
from pipeline.stage import Stage
from stages.filters import SourceFilter

log = structlog.get_logger("analytics")

DEFAULT_RATE = 25.0  # frames/s assumed to time a frame without pts from an unknown rate


@dataclass(frozen=True)
class Region:
    """A zone or line of one source, resolved against the model's classes.

    Attributes:
        key: where it sits in the configuration (``sources[0].analytics[1]``), for messages.
        type: "zone" or "line".
        name: unique within the source.
        points: (k, 2) float64 host array: a zone's corners (k >= 3) or a line's start and
            end (k = 2), frame pixels.
        class_ids: the class ids counted, or None for all.
        min_track_frames, min_frames, margin_px: see ``AnalyticsRegionConfig``.
    """

    key: str
    type: str
    name: str
    points: np.ndarray
    class_ids: frozenset[int] | None
    min_track_frames: int
    min_frames: int
    margin_px: float

    @classmethod
    def from_config(cls, key: str, region: AnalyticsRegionConfig, source: SourceConfig,
                    class_names: list[str] | None, num_classes: int) -> Region:
        """The region ``region`` of ``source`` (already checked by the config).

        Raises:
            ConfigError: a class the model does not have (``key.classes: ...``).
        """
        class_ids = None
        if region.classes is not None:
            as_filter = dataclasses.replace(source, classes=region.classes, roi=None)
            resolved = SourceFilter.from_config(key, as_filter, class_names, num_classes)
            class_ids = resolved.class_ids if resolved is not None else None
        return cls(key, region.type, region.name, np.asarray(region.points, np.float64),
                   class_ids, region.min_track_frames, region.min_frames, region.margin_px)

    def frame_error(self, width: int, height: int) -> str | None:
        """A one-line reason when a point lies outside a ``width`` x ``height`` frame (x in
        0..width, y in 0..height), else None."""
        inside = ((self.points >= 0) & (self.points <= [width, height])).all(axis=1)
        if inside.all():
            return None
        x, y = self.points[int(np.flatnonzero(~inside)[0])].tolist()
        what = "polygon" if self.type == "zone" else "end" if inside[0] else "start"
        return (f"{self.key}.{what}: {self.type} {self.name!r} has the point [{x:g}, {y:g}] "
                f"outside the {width}x{height} frame")

    def counted(self, class_ids: np.ndarray) -> np.ndarray:
        """(k,) bool: which of ``class_ids`` ((k,) int32 host array) this region counts."""
        if self.class_ids is None:
            return np.ones(len(class_ids), bool)
        return np.isin(class_ids, list(self.class_ids))


def on_border(point: np.ndarray, width: int, height: int) -> bool:
    """Whether ``point`` ((2,) float64 host array, frame pixels) is on the border of a
    ``width`` x ``height`` frame (x 0 or width, or y 0 or height)."""
    x, y = point.tolist()
    return x in (0, width) or y in (0, height)


def anchors_of(xyxy: np.ndarray) -> np.ndarray:
    """(k, 2) float64: the bottom centres of ``xyxy`` ((k, 4) float32 host array)."""
    boxes = np.asarray(xyxy, np.float64).reshape(-1, 4)
    return np.stack([(boxes[:, 0] + boxes[:, 2]) / 2, boxes[:, 3]], axis=1)


class LineCounter:
    """One directed line: supervision's ``LineZone`` with our direction and a margin.

    ``LineZone`` tells a detection's side from the anchor points it reads off its box, and
    ignores a detection whose points are on both sides. It is given, per object, a stand-in
    box whose top-left and bottom-right corners are the object's anchor moved ``margin_px``
    either way along the line's normal: both lie on one side only when the anchor is more
    than ``margin_px`` from the line, so an anchor nearer than that changes nothing.
    ``LineZone`` counts "in" from the right of its start -> end to its left (as shown); ours
    is the other way, so it gets the line reversed. It counts only within the band
    perpendicular to the segment; an end on the frame's border is moved on along the line
    by the frame's diagonal (outside the frame: nothing crosses it there), so that the band
    takes in the frame up to the border beside that end (a slanted line's band would leave
    out a wedge there).

    Args:
        region: a line.
        width, height: the source's frame size (pixels).
    """

    def __init__(self, region: Region, width: int, height: int) -> None:
        import supervision as sv  # imported only when a source has lines

        self.region = region
        start, end = region.points
        direction = (end - start) / float(np.hypot(*(end - start)))
        self._offset = region.margin_px * np.array([-direction[1], direction[0]])
        reach = float(np.hypot(width, height)) * direction
        start = start - reach if on_border(start, width, height) else start
        end = end + reach if on_border(end, width, height) else end
        self._sv = sv
        self._zone = sv.LineZone(
            start=sv.Point(float(end[0]), float(end[1])),
            end=sv.Point(float(start[0]), float(start[1])),
            triggering_anchors=(sv.Position.TOP_LEFT, sv.Position.BOTTOM_RIGHT),
            minimum_crossing_threshold=region.min_frames)

    def update(self, anchors: np.ndarray, tracker_id: np.ndarray, class_id: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
        """One frame's counted tracks (called for every frame, also with none: a track's
        absence counts).

        Args:
            anchors: (k, 2) float64 host array, the objects' anchors.
            tracker_id: (k,) int64 host array, their confirmed track ids.
            class_id: (k,) int32 host array.

        Returns:
            crossed_in, crossed_out: (k,) bool host arrays.
        """
        stand_in = np.concatenate([anchors - self._offset, anchors + self._offset], axis=1)
        detections = self._sv.Detections(xyxy=stand_in.reshape(-1, 4), tracker_id=tracker_id,
                                         class_id=class_id)
        crossed_in, crossed_out = self._zone.trigger(detections)
        return np.asarray(crossed_in, bool), np.asarray(crossed_out, bool)


@dataclass
class _ZoneTrack:
    """What a zone knows of one track (times in stream seconds)."""

    last_seen_t: float
    box: tuple[float, float, float, float]
    confidence: float
    inside: bool = False
    streak: int = 0  # observations in a row on the other side than ``inside``
    streak_start_t: float = 0.0
    missed: int = 0  # frames in a row it was not seen on
    entered_t: float = 0.0
    last_inside_t: float = 0.0
    class_id: int = -1  # its class when it entered


@dataclass(frozen=True)
class ZoneChange:
    """A track entered (``entered``) or left a zone; see ``AnalyticsEvent`` for the rest."""

    entered: bool
    tracker_id: int
    class_id: int
    confidence: float
    box: tuple[float, float, float, float]
    dwell_s: float | None


class ZoneCounter:
    """One polygon zone: which tracks are inside, with entries and exits (module docstring).

    The margin is measured to the zone's edges that are not on the frame's border (an edge
    is on it when its two corners are on one side of the frame: both x 0 or width, or both
    y 0 or height). An anchor is taken within the frame (boxes are clipped to it), and one on
    the polygon's edge is inside (off the border, that is within the margin anyway).

    Args:
        region: a zone.
        forget_s: stream seconds after which what is known of an unseen track is dropped
            (it exited when it was lost already, ``min_frames`` frames after its last).
        width, height: the source's frame size (pixels).
    """

    def __init__(self, region: Region, forget_s: float, width: int, height: int) -> None:
        self.region = region
        self.forget_s = forget_s
        self._size = np.array([width, height], np.float64)
        self._contour = region.points.astype(np.float32).reshape(-1, 1, 2)
        starts, ends = region.points, np.roll(region.points, -1, axis=0)
        on_one_side = ((starts == ends) & ((starts == 0) | (starts == self._size))).any(axis=1)
        # (m, 2) float64 each: the edges the margin applies to, from start to end.
        self._edge_starts, self._edge_ends = starts[~on_one_side], ends[~on_one_side]
        self._tracks: dict[int, _ZoneTrack] = {}

    def places(self, anchors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where ``anchors`` ((k, 2) float64 host array) are: (k,) bool, inside the polygon
        or on its edge, and (k,) float64, the distance to the nearest edge not on the frame's
        border (inf for a zone that is the whole frame)."""
        points = np.clip(anchors, 0, self._size)
        inside = np.array([cv2.pointPolygonTest(self._contour, (x, y), False) >= 0
                           for x, y in points.tolist()], bool)
        along = self._edge_ends - self._edge_starts  # (m, 2)
        length2 = np.maximum((along * along).sum(axis=1), 1e-12)  # (m,)
        offsets = points[:, None, :] - self._edge_starts[None]  # (k, m, 2)
        share = np.clip((offsets * along).sum(axis=2) / length2, 0, 1)  # (k, m)
        gaps = offsets - share[:, :, None] * along  # (k, m, 2): nearest point to the anchor
        return inside, np.hypot(gaps[..., 0], gaps[..., 1]).min(axis=1, initial=np.inf)

    def update(self, t: float, anchors: np.ndarray, tracker_id: np.ndarray,
               class_id: np.ndarray, confidence: np.ndarray, xyxy: np.ndarray
               ) -> list[ZoneChange]:
        """One frame's counted tracks (called for every frame, also with none).

        Args:
            t: the frame's stream time in seconds.
            anchors: (k, 2) float64 host array.
            tracker_id: (k,) int64 host array, confirmed track ids.
            class_id: (k,) int32; confidence: (k,) float32; xyxy: (k, 4) float32 host arrays.

        Returns:
            The entries and exits this frame confirmed, in detection order, then the exits
            of the tracks lost (not seen on ``min_frames`` frames in a row).
        """
        changes = []
        margin, needed = self.region.margin_px, self.region.min_frames
        for state in self._tracks.values():
            state.missed += 1  # until it is seen below
        inside, distance = self.places(anchors)
        for is_inside, edge_distance, track_id, cls, score, box in zip(
                inside.tolist(), distance.tolist(), tracker_id.tolist(), class_id.tolist(),
                confidence.tolist(), xyxy.tolist()):
            state = self._tracks.get(track_id)
            if state is None:
                state = self._tracks[track_id] = _ZoneTrack(t, tuple(box), score)
            state.last_seen_t, state.box, state.confidence = t, tuple(box), score
            if state.missed > 1:  # unseen on the frame before: a streak is of frames in a row
                state.streak = 0
            state.missed = 0
            if edge_distance <= margin or is_inside == state.inside:
                # On the edge (tells nothing) or on its side (ends a streak to the other).
                if edge_distance > margin:
                    state.streak = 0
                if state.inside:
                    state.last_inside_t = t
                continue
            if state.streak == 0:
                state.streak_start_t = t
            state.streak += 1
            if state.streak < needed:
                continue
            state.streak = 0
            state.inside = not state.inside
            if state.inside:
                state.entered_t, state.last_inside_t, state.class_id = state.streak_start_t, t, cls
                changes.append(ZoneChange(True, track_id, cls, score, tuple(box), None))
            else:
                changes.append(self._exit(track_id, state))
        for track_id, state in self._tracks.items():
            if state.inside and state.missed >= needed:  # lost: the object is not on screen
                state.inside, state.streak = False, 0
                changes.append(self._exit(track_id, state))
        for track_id in [k for k, s in self._tracks.items() if t - s.last_seen_t > self.forget_s]:
            del self._tracks[track_id]
        return changes

    def close(self) -> list[ZoneChange]:
        """The exits of the tracks inside now (the stream ended), in the order they were
        first seen; the zone then knows no track."""
        changes = [self._exit(track_id, state) for track_id, state in self._tracks.items()
                   if state.inside]
        self._tracks.clear()
        return changes

    @staticmethod
    def _exit(track_id: int, state: _ZoneTrack) -> ZoneChange:
        return ZoneChange(False, track_id, state.class_id, state.confidence, state.box,
                          max(0.0, state.last_inside_t - state.entered_t))


class AnalyticsCounts:
    """One source's counts, a running sum of its events, by class name (or id as text when
    the model has no names); a region's classes start at 0.

    Args:
        regions: the source's zones and lines.
        class_names: names indexed by class id, or None.
    """

    def __init__(self, regions: list[Region], class_names: list[str] | None) -> None:
        self.zones: dict[str, dict[str, Counter[str]]] = {}
        self.lines: dict[str, dict[str, Counter[str]]] = {}
        for region in regions:
            kinds = ("entered", "exited") if region.type == "zone" else ("in", "out")
            table = self.zones if region.type == "zone" else self.lines
            known = sorted(region.class_ids or ())
            table[region.name] = {kind: Counter(dict.fromkeys(
                (class_key(c, class_names) for c in known), 0)) for kind in kinds}

    def apply(self, event: AnalyticsEvent) -> None:
        """Count one event of this source."""
        kind = {"enter": "entered", "exit": "exited", "cross_in": "in", "cross_out": "out"}
        table = self.zones if event.region_type == "zone" else self.lines
        key = event.class_name if event.class_name is not None else str(event.class_id)
        table[event.region][kind[event.kind]][key] += 1

    def to_json(self) -> dict[str, Any]:
        """``{"zones": {zone: {"inside": {class: n}, "entered": {...}, "exited": {...}}},
        "lines": {line: {"in": {class: n}, "out": {...}}}}``: plain dicts, classes sorted."""
        zones = {}
        for name, kinds in self.zones.items():
            classes = sorted(set(kinds["entered"]) | set(kinds["exited"]))
            zones[name] = {"inside": {c: kinds["entered"][c] - kinds["exited"][c] for c in classes},
                           "entered": {c: kinds["entered"][c] for c in classes},
                           "exited": {c: kinds["exited"][c] for c in classes}}
        lines = {name: {kind: {c: kinds[kind][c] for c in sorted(set(kinds["in"]) | set(kinds["out"]))}
                        for kind in ("in", "out")} for name, kinds in self.lines.items()}
        return {"zones": zones, "lines": lines}


def class_key(class_id: int, class_names: list[str] | None) -> str:
    """How a class is named in counts and metrics: its name, or its id as text."""
    if class_names and 0 <= class_id < len(class_names):
        return class_names[class_id]
    return str(class_id)


class EventPublisher(Protocol):
    """Where events and counts go besides the batch (``pipeline.app.mqtt.MqttPublisher``,
    ``pipeline.app.webhooks.WebhookPublisher``)."""

    def publish_event(self, source: str, event: dict) -> None: ...

    def publish_counts(self, source: str, counts: dict) -> None: ...


class EventMediaHook(Protocol):
    """What makes each event's snapshot and clip (``stages.event_media.EventMedia``): it sees
    every batch, and returns the batch's events with their media paths set."""

    def observe(self, item: BatchDetections, events: list[AnalyticsEvent]
                ) -> list[AnalyticsEvent]: ...

    def end(self, source: str) -> None: ...


class SourceAnalytics:
    """One source's zones and lines and what they know of its tracks.

    Args:
        source: the source's name.
        regions: its zones and lines, in configuration order.
        class_names: names indexed by class id, or None.
        forget_s: stream seconds after which what is known of an unseen track is dropped
            (the source's ``tracker_lost_s`` and a little more: the tracker has ended it).
    """

    def __init__(self, source: str, regions: list[Region], class_names: list[str] | None,
                 forget_s: float) -> None:
        self.source, self.regions = source, regions
        self.class_names, self.forget_s = class_names, forget_s
        self.counters: list[LineCounter | ZoneCounter] = []  # made on the first frame
        self.started = False
        self._track_frames: dict[int, int] = {}  # frames each live track was in
        self._last_seen_t: dict[int, float] = {}
        self._last_t: float | None = None
        self._t_offset = 0.0  # keeps the stream time rising when a camera's pts restart
        self._last_frame: tuple[int, float | None, float] | None = None  # index, pts, capture

    def stream_time(self, pts: float | None, index: int, rate: float) -> float:
        """The frame's stream time in seconds: its pts (else index / rate), kept rising by
        one frame over a jump back (a camera that reconnected restarts its pts)."""
        t = (pts if pts is not None else index / rate) + self._t_offset
        if self._last_t is not None and t < self._last_t:
            self._t_offset += self._last_t + 1 / rate - t
            t = self._last_t + 1 / rate
        self._last_t = t
        return t

    def start(self, width: int, height: int) -> None:
        """Make the counters on the source's first frame; a region outside the frame is
        logged as an error and left out (the other regions and sources go on)."""
        self.started = True
        for region in self.regions:
            reason = region.frame_error(width, height)
            if reason is not None:
                log.error("analytics region disabled", source=self.source, reason=reason)
                continue
            self.counters.append(LineCounter(region, width, height) if region.type == "line"
                                 else ZoneCounter(region, self.forget_s, width, height))

    def update(self, index: int, pts: float | None, capture_time: float, t: float,
               xyxy: np.ndarray, confidence: np.ndarray, class_id: np.ndarray,
               tracker_id: np.ndarray) -> list[AnalyticsEvent]:
        """One frame of the source, in frame order.

        Args:
            index, pts, capture_time: the frame's (for the events).
            t: its stream time in seconds (``stream_time``).
            xyxy: (k, 4) float32; confidence: (k,) float32; class_id: (k,) int32;
                tracker_id: (k,) int64 host arrays, the frame's tracked detections.

        Returns:
            The frame's events, region by region in configuration order.
        """
        for track_id in tracker_id[tracker_id >= 0].tolist():
            self._track_frames[track_id] = self._track_frames.get(track_id, 0) + 1
            self._last_seen_t[track_id] = t
        for track_id in [k for k, seen in self._last_seen_t.items() if t - seen > self.forget_s]:
            del self._last_seen_t[track_id], self._track_frames[track_id]
        age = np.array([self._track_frames.get(i, 0) for i in tracker_id.tolist()], np.int64)
        anchors = anchors_of(xyxy)
        events: list[AnalyticsEvent] = []
        self._last_frame = (index, pts, capture_time)
        event = self._event_maker(index, pts, capture_time)
        for counter in self.counters:
            region = counter.region
            rows = np.flatnonzero((tracker_id >= 0) & (age >= region.min_track_frames)
                                  & region.counted(class_id))
            if isinstance(counter, LineCounter):
                crossed_in, crossed_out = counter.update(anchors[rows], tracker_id[rows],
                                                         class_id[rows])
                for k, row in enumerate(rows.tolist()):
                    if crossed_in[k] or crossed_out[k]:
                        events.append(event("cross_in" if crossed_in[k] else "cross_out", region,
                                            tracker_id[row], class_id[row], confidence[row],
                                            xyxy[row]))
            else:
                for change in counter.update(t, anchors[rows], tracker_id[rows], class_id[rows],
                                             confidence[rows], xyxy[rows]):
                    events.append(event("enter" if change.entered else "exit", region,
                                        change.tracker_id, change.class_id, change.confidence,
                                        change.box, change.dwell_s))
        return events

    def close(self) -> list[AnalyticsEvent]:
        """The source ended: the exits of the tracks still inside a zone, on its last frame
        (with their last box and score), so that its final counts have nobody inside; zone
        by zone in configuration order. The zones then know no track."""
        if self._last_frame is None:
            return []
        event = self._event_maker(*self._last_frame)
        return [event("exit", counter.region, change.tracker_id, change.class_id,
                      change.confidence, change.box, change.dwell_s)
                for counter in self.counters if isinstance(counter, ZoneCounter)
                for change in counter.close()]

    def _event_maker(self, index: int, pts: float | None, capture_time: float
                     ) -> Callable[..., AnalyticsEvent]:
        """A function that makes this source's events on frame ``index``."""
        names = self.class_names or []

        def event(kind: str, region: Region, track_id: int, cls: int, score: float,
                  box: Iterable[float], dwell_s: float | None = None) -> AnalyticsEvent:
            cls = int(cls)
            return AnalyticsEvent(
                self.source, kind, region.name, index, pts, capture_time, int(track_id), cls,
                names[cls] if 0 <= cls < len(names) else None, float(score),
                tuple(float(v) for v in box), dwell_s)

        return event


class AnalyticsStage(Stage[BatchDetections, BatchDetections]):
    """``BatchDetections`` (with ``tracker_id``) in, the same batch with its ``events`` out.

    Args:
        name: stage name.
        regions: source name -> its zones and lines, for the sources with analytics.
        class_names: names indexed by class id, or None.
        forget_s: source name -> stream seconds after which an unseen track is gone.
        publishers: each gets every event and, after a batch that changed a source's
            counts, that source's counts (MQTT, webhooks); none by default.
        media: sees every batch before the events go anywhere, and gives them their
            snapshot and clip paths (``output.event_media``); None: no media.
    """

    def __init__(self, name: str, regions: dict[str, list[Region]],
                 class_names: list[str] | None, forget_s: dict[str, float],
                 publishers: Sequence[EventPublisher] = (),
                 media: EventMediaHook | None = None) -> None:
        super().__init__(name)
        self.publishers = tuple(publishers)
        self.media = media
        self._sources = {source: SourceAnalytics(source, list(found), class_names,
                                                 forget_s[source])
                         for source, found in regions.items()}
        self._counts = {source: AnalyticsCounts(found, class_names)
                        for source, found in regions.items()}
        self._counted_from: dict[str, int] = {}  # a source counted from a frame past its first
        self._lock = threading.Lock()  # the counts are read by the Prometheus thread

    def open(self) -> None:
        import supervision  # noqa: F401 - a second to import: before the first frame

    def add_source(self, source: str, regions: list[Region], class_names: list[str] | None,
                   forget_s: float, first_frame: int = 0) -> None:
        """Count the zones and lines of one more source (added while the pipeline runs,
        before its first frame; any thread). ``first_frame``: where it starts (a resumed
        source's resume point): its counts are of its frames from there, which its final
        ``analytics counts`` line says (``counted_from_frame``); its events file, appended
        to, holds the events of every run."""
        analytics = SourceAnalytics(source, list(regions), class_names, forget_s)
        if first_frame > 0:
            self._counted_from[source] = first_frame
        with self._lock:
            self._sources = {**self._sources, source: analytics}
            self._counts = {**self._counts, source: AnalyticsCounts(regions, class_names)}

    def counts(self) -> dict[str, dict[str, Any]]:
        """Every source's counts now (``AnalyticsCounts.to_json``); any thread."""
        with self._lock:
            return {source: counts.to_json() for source, counts in self._counts.items()}

    def process(self, item: BatchDetections) -> Iterable[BatchDetections]:
        frames = item.frames
        tracker_id = item.tracker_id if item.tracker_id is not None else np.full(
            len(item.xyxy), -1, np.int64)
        offsets = item.offsets.tolist()
        events: list[AnalyticsEvent] = []
        changed: set[str] = set()
        for row, (index, pts, capture_time, width, height) in enumerate(zip(
                frames.index.tolist(), frames.pts.tolist(), frames.capture_time.tolist(),
                frames.width.tolist(), frames.height.tolist())):
            source = frames.source_name(row)
            analytics = self._sources.get(source)
            if analytics is None:
                continue
            if not analytics.started:
                analytics.start(width, height)
                changed.add(source)  # the first counts (zeros) replace an older run's
            known_pts = None if pts != pts else pts
            t = analytics.stream_time(known_pts, index, float(frames.rates[row] or DEFAULT_RATE))
            start, end = offsets[row], offsets[row + 1]
            found = analytics.update(index, known_pts, capture_time, t, item.xyxy[start:end],
                                     item.confidence[start:end], item.class_id[start:end],
                                     tracker_id[start:end])
            if found:
                changed.add(source)
                events.extend(found)
        if self.media is not None:
            events = self.media.observe(item, events)
        if events:
            with self._lock:
                for event in events:
                    self._counts[event.source].apply(event)
        if self.publishers:
            for event in events:
                record = event.to_json()  # one dict for all: publishers only read it
                for publisher in self.publishers:
                    publisher.publish_event(event.source, record)
            for source in sorted(changed):
                with self._lock:
                    counts = self._counts[source].to_json()
                for publisher in self.publishers:
                    publisher.publish_counts(source, counts)
        if not events:
            return (item,)
        return (dataclasses.replace(item, events=(*item.events, *events)),)

    def end_of_stream(self, eos: EndOfStream) -> Iterable[EndOfStream]:
        """The source ended: its open tracks are closed (``SourceAnalytics.close``: the
        exits of the objects still inside a zone), counted and published; the marker carries
        those exits on to the sinks (``EndOfStream.events``: its events file). Its final
        counts are logged. The closing exits get no event media (the source's frames are
        gone); its pending media is finished (``EventMedia.end``)."""
        if self.media is not None:
            self.media.end(eos.source)
        if eos.source not in self._counts:
            return (eos,)
        closing = self._sources[eos.source].close()
        with self._lock:
            for event in closing:
                self._counts[eos.source].apply(event)
            counts = self._counts[eos.source].to_json()
        for publisher in self.publishers:
            for event in closing:
                publisher.publish_event(eos.source, event.to_json())
            if closing:
                publisher.publish_counts(eos.source, counts)
        counted_from = self._counted_from.get(eos.source)
        log.info("analytics counts", source=eos.source, counts=counts,
                 **({"counted_from_frame": counted_from} if counted_from else {}))
        return (dataclasses.replace(eos, events=(*eos.events, *closing)) if closing else eos,)
