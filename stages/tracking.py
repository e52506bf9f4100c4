"""Tracking: one ByteTrack per source (roboflow's ``trackers`` package), on the host.

Runs after the postprocess (and the filters), once per batch, frame by frame in batch order:
a source's frames come in frame order, within a batch and across batches. Each source with
``tracker: bytetrack`` has a tracker of its own (with ``tracker_class_aware``, one per class:
a track never changes class); the stage gives every detection of the batch a
``tracker_id`` (-1 when it is not part of a confirmed track, and for the sources without a
tracker). The tracker is told the frame index as its clock (``index / rate``
seconds): frame indices never go back, also over a camera's reconnection, and a gap left by
the detector (``detect_every``) or by dropped frames is a longer Kalman step.

On a frame the detector skipped (``FrameBatch.detect`` false), there is nothing to update the
tracks with, and an update with no detections would count as a miss for every track and end
them. Instead, each track that was seen on the source's last detected frame is shown at its
Kalman prediction for this frame (the filter is stepped forward and put back, so the tracker
itself is untouched), with the class and score of its last detection.

A source resumed after its records (``pipeline.resume``: a stopped run's file, or a source
moved from a pipeline that died) starts with fresh tracks, numbered from the id it is added
with (``TrackerStage.add_source(first_id=...)``: one past the largest id of its records), so
that an id is never given to two objects in one output file.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from pipeline.config import SourceConfig
from pipeline.records import BatchDetections, EndOfStream
from pipeline.stage import Stage

DEFAULT_RATE = 25.0  # frames/s assumed for a source whose rate is unknown
TRACKERS_BUFFER_RATE = 30.0  # the trackers package counts its lost-track buffer in 30 fps frames


@dataclass(frozen=True)
class TrackerSettings:
    """One source's ByteTrack settings (see ``SourceConfig.tracker_*``).

    Attributes:
        new_track_confidence: a detection scoring at least this may start a track, and is
            matched in ByteTrack's first stage; weaker ones only continue tracks.
        lost_s: seconds a track without a detection is kept before it ends.
        class_aware: one tracker per class (a track never changes class), else one for all.
    """

    new_track_confidence: float
    lost_s: float
    class_aware: bool = False

    @classmethod
    def from_config(cls, source: SourceConfig) -> TrackerSettings | None:
        """The settings of a source with ``tracker: bytetrack``, else None."""
        if source.tracker == "none":
            return None
        return cls(source.tracker_new_confidence, source.tracker_lost_s,
                   source.tracker_class_aware)


ALL_CLASSES = -1  # the key of the one tracker of a source that is not class aware


class SourceTracker:
    """The ByteTrack tracking of one source, fed one frame at a time in frame order.

    A class-aware source has one ``ByteTrackTracker`` per class seen (the trackers package
    tracks boxes only, whatever their class; ByteTrack's authors suggest one tracker per
    class for multi-class tracking), each updated on every detected frame (with its class's
    detections, maybe none: its tracks age); the others one tracker for all classes. Each
    tracker numbers its tracks from 0, so the source's ids are given here, in the order the
    tracks are confirmed: (tracker, its id) -> the source's id, counted from ``first_id``.
    With one tracker and ``first_id`` 0 the two are the same.

    Args:
        settings: the source's settings.
        frame_rate: the source's nominal frame rate (frames/s): the tracker's clock is
            ``index / frame_rate`` and its lost-track time is counted at this rate.
        first_id: the id of the first track (a resumed source's tracks are numbered on
            after the ids of its records).
    """

    def __init__(self, settings: TrackerSettings, frame_rate: float, first_id: int = 0
                 ) -> None:
        self.settings = settings
        self.frame_rate = frame_rate
        self._trackers: dict[int, Any] = {}  # class id (or ALL_CLASSES) -> ByteTrackTracker
        self._ids: dict[tuple[int, int], int] = {}  # (tracker key, its track id) -> ours
        self._next_id = first_id
        self._last_index: int | None = None
        # tracker id -> (class id, score) of the track's latest detection
        self._last_detection: dict[int, tuple[int, float]] = {}

    def _new_tracker(self) -> Any:
        from trackers import ByteTrackTracker  # imported only when a source is tracked

        settings = self.settings
        return ByteTrackTracker(
            lost_track_buffer=round(settings.lost_s * TRACKERS_BUFFER_RATE),
            frame_rate=self.frame_rate,
            track_activation_threshold=settings.new_track_confidence,
            high_conf_det_threshold=settings.new_track_confidence)

    def _our_id(self, key: int, track_id: int) -> int:
        """The source's id of track ``track_id`` of tracker ``key`` (given when first seen)."""
        ours = self._ids.get((key, track_id))
        if ours is None:
            ours = self._ids[key, track_id] = self._next_id
            self._next_id += 1
        return ours

    def update(self, index: int, xyxy: np.ndarray, confidence: np.ndarray,
               class_id: np.ndarray) -> np.ndarray:
        """Match a detected frame's detections to the tracks.

        Args:
            index: the frame's index in its source (larger than the previous call's).
            xyxy: (k, 4) float32 host array, boxes in frame pixels.
            confidence: (k,) float32 host array.
            class_id: (k,) int32 host array.

        Returns:
            (k,) int64 host array: each detection's track id, in the order given; -1 for a
            detection that is not (yet) part of a confirmed track.
        """
        import supervision as sv

        ids = np.full(len(xyxy), -1, np.int64)
        if self.settings.class_aware:
            keys = sorted(set(self._trackers) | set(class_id.tolist()))
        else:
            keys = [ALL_CLASSES]
        for key in keys:
            tracker = self._trackers.get(key)
            if tracker is None:
                tracker = self._trackers[key] = self._new_tracker()
            rows = (np.arange(len(xyxy)) if key == ALL_CLASSES
                    else np.flatnonzero(class_id == key))
            detections = sv.Detections(xyxy=xyxy[rows], confidence=confidence[rows],
                                       class_id=class_id[rows], data={"row": rows})
            tracked = tracker.update(detections, timestamp=index / self.frame_rate)
            # The tracker returns every detection, reordered; new ids in the order given.
            for row, track_id in zip(tracked.data.get("row", ()), tracked.tracker_id.tolist()):
                if track_id >= 0:
                    ids[row] = self._our_id(key, track_id)
        self._last_index = index
        for track_id, cls, score in zip(ids.tolist(), class_id.tolist(), confidence.tolist()):
            if track_id >= 0:
                self._last_detection[track_id] = (cls, score)
        self._forget_ended()
        return ids

    def _forget_ended(self) -> None:
        """Drop what is kept of the tracks the trackers ended (and the trackers of a class
        without tracks: a class seen again gets a new one)."""
        alive = {(key, track.tracker_id) for key, tracker in self._trackers.items()
                 for track in tracker.tracks}
        for key in [k for k in self._ids if k not in alive]:
            self._last_detection.pop(self._ids.pop(key), None)
        if self.settings.class_aware:
            for key in [k for k, tracker in self._trackers.items() if not tracker.tracks]:
                del self._trackers[key]

    def predict(self, index: int, width: int, height: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The boxes, on frame ``index`` (not detected), of the confirmed tracks seen on the
        last detected frame: their Kalman predictions, clipped to the ``width`` x ``height``
        frame (a box wholly outside it is left out). The tracker's state is not changed.

        Returns:
            xyxy (t, 4) float32, confidence (t,) float32, class_id (t,) int32 and tracker_id
            (t,) int64 host arrays, best score first; the score and class are those of each
            track's last detection.
        """
        rows: list[tuple[float, int, int, np.ndarray]] = []
        if self._last_index is not None:
            step = float(index - self._last_index)
            for key, track in ((k, t) for k, tracker in self._trackers.items()
                               for t in tracker.tracks):
                if track.tracker_id < 0 or track.time_since_update > 0:
                    continue  # not confirmed, or already missed on the last detected frame
                estimator = track.state_estimator
                saved = estimator.get_state()
                estimator.predict(step, self.frame_rate)
                box = np.asarray(estimator.state_to_bbox(), np.float64)
                estimator.set_state(saved)
                box = np.clip(box, 0, [width, height, width, height])
                if box[2] <= box[0] or box[3] <= box[1]:
                    continue
                ours = self._our_id(key, track.tracker_id)
                cls, score = self._last_detection.get(ours, (-1, 0.0))
                rows.append((score, cls, ours, box))
        rows.sort(key=lambda r: -r[0])
        return (np.array([r[3] for r in rows], np.float32).reshape(-1, 4),
                np.array([r[0] for r in rows], np.float32),
                np.array([r[1] for r in rows], np.int32),
                np.array([r[2] for r in rows], np.int64))


class TrackerStage(Stage[BatchDetections, BatchDetections]):
    """``BatchDetections`` in, the same frames with every detection's ``tracker_id`` out
    (and, on the frames the detector skipped, the tracks' predicted boxes as detections).

    Args:
        name: stage name.
        settings: source name -> its settings, for the sources with a tracker (their tracks
            numbered from 0; ``add_source`` gives another first id).
    """

    def __init__(self, name: str, settings: dict[str, TrackerSettings]) -> None:
        super().__init__(name)
        self.settings = settings
        self.first_ids: dict[str, int] = {}  # source -> the id its first track gets
        self._trackers: dict[str, SourceTracker] = {}

    def open(self) -> None:
        # The trackers package (and supervision) take over a second to import: here, before
        # the first frame, rather than in its latency.
        import trackers  # noqa: F401

    def add_source(self, source: str, settings: TrackerSettings, first_id: int = 0) -> None:
        """Track one more source (added while the pipeline runs; any thread), its tracks
        numbered from ``first_id`` (a source resumed after its records: one past their
        largest id, ``pipeline.resume.next_tracker_id``)."""
        self.first_ids = {**self.first_ids, source: first_id}
        self.settings = {**self.settings, source: settings}

    def _tracker(self, source: str, rate: Fraction | None) -> SourceTracker:
        tracker = self._trackers.get(source)
        if tracker is None:
            tracker = SourceTracker(self.settings[source], float(rate) if rate else DEFAULT_RATE,
                                    self.first_ids.get(source, 0))
            self._trackers[source] = tracker
        return tracker

    def process(self, item: BatchDetections) -> Iterable[BatchDetections]:
        frames = item.frames
        detect = frames.detect
        offsets = item.offsets.tolist()
        tracker_id = np.full(len(item.xyxy), -1, np.int64)
        predicted: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        for row, (index, width, height) in enumerate(zip(
                frames.index.tolist(), frames.width.tolist(), frames.height.tolist())):
            source = frames.source_name(row)
            if source not in self.settings:
                continue
            tracker = self._tracker(source, frames.rates[row])
            start, end = offsets[row], offsets[row + 1]
            if detect is not None and not detect[row]:
                predicted[row] = tracker.predict(index, width, height)
            else:
                tracker_id[start:end] = tracker.update(
                    index, item.xyxy[start:end], item.confidence[start:end],
                    item.class_id[start:end])
        if not predicted:
            return (BatchDetections(frames, item.xyxy, item.confidence, item.class_id,
                                    item.offsets, tracker_id, item.events),)
        per_frame, ids = [], []
        for row in range(len(frames)):
            start, end = offsets[row], offsets[row + 1]
            if row in predicted:
                xyxy, confidence, class_id, track_ids = predicted[row]
            else:
                xyxy, confidence, class_id = (item.xyxy[start:end], item.confidence[start:end],
                                              item.class_id[start:end])
                track_ids = tracker_id[start:end]
            per_frame.append((xyxy, confidence, class_id))
            ids.append(track_ids)
        tracked = BatchDetections.from_lists(frames, per_frame, ids)
        return (BatchDetections(frames, tracked.xyxy, tracked.confidence, tracked.class_id,
                                tracked.offsets, tracked.tracker_id, item.events),)

    def end_of_stream(self, eos: EndOfStream) -> Iterable[EndOfStream]:
        self._trackers.pop(eos.source, None)  # a source that ended sends no more frames
        return (eos,)
