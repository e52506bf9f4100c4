"""Sinks: per source, an annotated H.264 MP4, a JSON Lines file of detections and, for a
source with analytics, a JSON Lines file of its events.

A sink gets its own source's frames only, in frame order, as ``BatchDetections`` parts (the
graph splits every batch by source once, with ``BatchDetections.by_source``), and writes
each part in one go: one ``write`` and one flush of the JSONL file per part.

Each output is written under a temporary ``.partial`` name and renamed to its final name only
when its source's stream ended: a file with the final name is always complete and playable.
The rename is what replaces an older run's file of that name; until then it stays as it was,
so a run that fails or is killed loses nothing that was there before. A ``.partial`` file is
being written or was cut short: a source that failed, a killed run, or a file source stopped
before its end (Ctrl-C, SIGTERM, removed), which a rerun resumes (``pipeline.resume``). A live
source's outputs are complete whenever it stops (a camera has no end). A ``.partial`` file
that holds nothing is removed, and a source that delivered no frame leaves no file.

A resumed source's video comes in parts (``NAME.from-FRAME.mp4``): when it completes, its
parts get final names, it warns of the frames of its records that no part holds (a killed
run's part lacks its last fragment) and moves an earlier run's ``NAME.mp4``, which belongs to
the records just replaced, to ``NAME.older.mp4`` (a resumed file source that writes no video
does that too); a later run that writes the whole video replaces (deletes) the parts and that
file. Every file so deleted is logged.

Crash safety: every MP4 is fragmented (a fragment per keyframe, every ``FRAGMENT_S`` of
video) and every JSONL part is flushed, so a killed process leaves ``.partial`` files that
hold its work up to then: the MP4 plays up to its last complete fragment, and the JSONL has a
record for each of its frames (a part's lines are written before its video).

Segments (``segment_s``, live sources only): the outputs of a live source are cut together,
at the first frame whose capture time reaches the next multiple of ``segment_s`` since the
Unix epoch, into files named by ``segment_path`` (``cam.mp4`` ->
``cam.20261130T231500Z.mp4``, the UTC time of the segment's first frame: names sort in time
order). A segment is renamed from its ``.partial`` name when the next one starts (or the
source ends), so a finished segment is complete; ``keep_hours`` deletes the segments of this
source's outputs (and only those names) last written longer ago than that.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Protocol

import av
import numpy as np
import structlog

from pipeline.config import SEGMENT_STAMP, SEGMENT_STAMP_PATTERN, partial_path
from pipeline.records import AnalyticsEvent, BatchDetections, EndOfStream
from pipeline.resume import (
    RecordsSettings,
    cut_torn_line,
    stamp_origin,
    stamp_settings,
    video_parts,
)
from pipeline.stage import Stage


class PreviewSink(Protocol):
    """Where a sink offers its pictures for the live view (``pipeline.app.preview.PreviewHub``:
    the app layer implements it; stages never import it)."""

    def offer_part(self, part: BatchDetections, annotated: bool) -> None:
        """One source's batch part reached its sink; ``annotated``: boxes drawn already."""

    def end(self, source: str, error: str | None) -> None:
        """``source``'s stream ended (``error``: why, when it failed)."""


log = structlog.get_logger("sinks")

DEFAULT_RATE = Fraction(25)
FRAGMENT_S = 2.0  # every MP4: a keyframe, and so a fragment, this often (of video time)
EMPTY_VIDEO = object()  # ``_settle_video_part``: the part held no frame and is gone
RECORDINGS_KEPT = 4  # video writers a sink remembers for ``recording_of`` (event clips)


def detection_records(xyxy: np.ndarray, confidence: np.ndarray, class_id: np.ndarray,
                      class_names: list[str] | None = None,
                      tracker_id: np.ndarray | None = None) -> list[dict[str, Any]]:
    """Plain dicts for JSON output, one per detection, in row order.

    Each is ``{"class_id", "confidence" (rounded to 4 digits), "xyxy" (each rounded to 2
    digits), "class_name", "tracker_id"}``, ``class_name`` only when ``class_names`` is
    given and the id indexes it, ``tracker_id`` only when ``tracker_id`` is given. The arrays
    are converted to Python lists once (``tolist``), not per value.

    Args:
        xyxy: (m, 4) float32 host array, boxes x1, y1, x2, y2 in frame pixels.
        confidence: (m,) float32 host array.
        class_id: (m,) int32 host array.
        class_names: names indexed by class id, or None.
        tracker_id: (m,) int64 host array (-1: not part of a confirmed track), or None.
    """
    names = class_names or []
    out = []
    for box, score, cls in zip(xyxy.tolist(), confidence.tolist(), class_id.tolist()):
        record: dict[str, Any] = {
            "class_id": cls,
            "confidence": round(score, 4),
            "xyxy": [round(box[0], 2), round(box[1], 2), round(box[2], 2), round(box[3], 2)],
        }
        if 0 <= cls < len(names):
            record["class_name"] = names[cls]
        out.append(record)
    if tracker_id is not None:
        for record, track in zip(out, tracker_id.tolist()):
            record["tracker_id"] = track
    return out


def frame_records(item: BatchDetections, class_names: list[str] | None = None,
                  tracked: bool = False) -> list[dict[str, Any]]:
    """One JSON-ready dict per frame of ``item``, in batch order: ``{"source", "frame",
    "pts" (None when unknown), "capture_time" (both rounded to 6 digits), "detections"}`` with
    the detections as ``detection_records`` makes them (``[]`` for a frame without any; with
    their ``tracker_id`` when ``tracked`` and the batch has track ids), and ``"detected":
    false`` on a frame the detector skipped (``detect_every``/``detect_fps``: with tracking,
    its detections are the tracks' predicted boxes)."""
    frames = item.frames
    detections = detection_records(item.xyxy, item.confidence, item.class_id, class_names,
                                   item.tracker_id if tracked else None)
    offsets = item.offsets.tolist()
    names = frames.source_names
    records = []
    for row, (source, index, pts, capture_time) in enumerate(zip(
            frames.source.tolist(), frames.index.tolist(), frames.pts.tolist(),
            frames.capture_time.tolist())):
        records.append({
            "source": names[source],
            "frame": index,
            "pts": None if pts != pts else round(pts, 6),  # NaN: the stream has no pts
            "capture_time": round(capture_time, 6),
            "detections": detections[offsets[row]:offsets[row + 1]],
        })
    if frames.detect is not None:
        for row in np.flatnonzero(~frames.detect).tolist():
            records[row]["detected"] = False
    return records


class VideoWriter:
    """Encodes I420 frames to an H.264 MP4 (yuv420p: plays in browsers).

    Each frame written is one video frame, timed by its frame number at the first frame's
    source's nominal rate (from the file's first frame): frames a live source dropped leave
    their time in the video, so it plays in real time instead of running fast. A frame of
    another size than the first is scaled to it.

    The MP4 is fragmented: an empty index first, then one fragment per keyframe, a keyframe
    every ``FRAGMENT_S`` x the rate frames written (``FRAGMENT_S`` seconds of video when
    nothing was dropped). Its bytes reach the file as it goes, so a killed process leaves a
    file that plays up to its last complete fragment; it loses at most the open fragment and
    the frames inside x264 (its lookahead: about 10 frames at ``veryfast``). The muxer keeps
    no per-frame index in memory (a plain MP4 holds one entry per frame until it is closed:
    the slow memory growth of a camera recorded for hours). A complete file ends with a
    fragment index (``mfra``): browsers show its duration and seek in it when the server
    answers range requests, as static file servers do.
    """

    def __init__(self, path: Path, crf: int) -> None:
        self.path = path
        self.crf = crf
        self._container: av.container.OutputContainer | None = None
        self._stream: av.video.stream.VideoStream | None = None
        self.frames = 0
        self.skipped = 0  # frames without a host image (nothing to encode)
        self._first_index = 0  # the frame number of the file's first frame
        self._last_pts = -1
        self.rate: Fraction = DEFAULT_RATE  # the video's frame rate, set with its first frame
        self.closed = False  # finalised: its file (final or .partial) grows no more

    @property
    def first_index(self) -> int:
        """The frame number of the file's first frame (its video time 0; each frame's video
        time is (frame - first_index) / ``rate``); meaningful once ``frames`` > 0."""
        return self._first_index

    @property
    def last_index(self) -> int:
        """The frame number of the file's last frame (its video time is (last_index -
        first_index) / ``rate``); meaningful once ``frames`` > 0."""
        return self._first_index + self._last_pts

    def write(self, item: BatchDetections) -> None:
        """Encode every frame of ``item`` that has an image (``item.frames.images[row]``), in
        batch order; frames whose image is None are counted in ``skipped``."""
        frames = item.frames
        for image, width, height, rate, index in zip(
                frames.images, frames.width.tolist(), frames.height.tolist(), frames.rates,
                frames.index.tolist()):
            if image is None:
                if not self.skipped:
                    log.warning("frame without a host image: not in the video",
                                path=str(self.path))
                self.skipped += 1
                continue
            self.encode(image, width, height, rate, index)

    def encode(self, image: np.ndarray, width: int, height: int, rate: Fraction | None,
               index: int | None = None) -> None:
        """Encode one frame.

        Args:
            image: (height * 3 // 2, width) uint8 I420 host array.
            width, height: the frame's size in pixels.
            rate: its source's nominal frame rate (used when this is the first frame), or
                None for ``DEFAULT_RATE``.
            index: its frame number in its source (its time in the video), or None: the
                frame after the last one written.
        """
        if self._container is None:
            self._open(width, height, rate)
            self._first_index = self.frames if index is None else index
        assert self._stream is not None and self._container is not None
        picture = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="yuv420p")
        if (width, height) != (self._stream.width, self._stream.height):
            picture = picture.reformat(width=self._stream.width, height=self._stream.height)
        pts = self._last_pts + 1 if index is None else index - self._first_index
        picture.pts = self._last_pts = max(pts, self._last_pts + 1)  # always increasing
        self._container.mux(self._stream.encode(picture))
        self.frames += 1

    def _open(self, width: int, height: int, rate: Fraction | None) -> None:
        partial_path(self.path).parent.mkdir(parents=True, exist_ok=True)
        # A fragment goes to the file when it is complete, not when 32 KB have gathered.
        options = {"movflags": "frag_keyframe+empty_moov+default_base_moof",
                   "flush_packets": "1"}
        self._container = av.open(str(partial_path(self.path)), "w", format="mp4",
                                  options=options)
        rate = self.rate = rate or DEFAULT_RATE
        stream = self._container.add_stream("libx264", rate=rate)
        stream.codec_context.gop_size = max(1, round(FRAGMENT_S * rate))
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        stream.time_base = 1 / rate
        stream.options = {"crf": str(self.crf), "preset": "veryfast"}
        self._stream = stream

    def close(self, complete: bool) -> None:
        """Flush the encoder and finalise the file; rename it when ``complete``. A write
        that fails here (a full disk) still closes the file, under its .partial name, and
        raises."""
        container, self._container = self._container, None
        if container is None:
            self.closed = True
            return  # no frame: no file
        assert self._stream is not None
        try:
            try:
                container.mux(self._stream.encode(None))  # the encoder's last frames
            finally:
                container.close()
            if complete:
                os.replace(partial_path(self.path), self.path)
        finally:  # only now: event media cut a closed recording as it is (a clip cut while
            self.closed = True  # the encoder's last frames were still coming fell short)


def stopped_text(frames: int, total: int | None) -> str:
    """``stopped at frame 68 of 250`` (``of ?`` when the total is not known): where a file
    source stopped before its end, ``frames`` being the frames read."""
    return f"stopped at frame {frames} of {'?' if total is None else total}"


def segment_path(path: Path, start: float) -> Path:
    """The file of output ``path``'s segment whose first frame was captured at ``start``
    (Unix time, to the second, UTC): ``cam.mp4`` -> ``cam.20261130T231500Z.mp4``,
    ``cam.events.jsonl`` -> ``cam.events.20261130T231500Z.jsonl``."""
    stamp = time.strftime(SEGMENT_STAMP, time.gmtime(math.floor(start)))
    return path.with_name(f"{path.stem}.{stamp}{path.suffix}")


def segment_files(path: Path) -> list[Path]:
    """The segments of output ``path`` in its folder, finished and ``.partial``, in name
    order (oldest first): only names ``segment_path`` (and ``partial_path`` of one) makes."""
    pattern = re.compile(rf"{re.escape(path.stem)}\.{SEGMENT_STAMP_PATTERN}(\.partial)?"
                         rf"{re.escape(path.suffix)}")
    if not path.parent.is_dir():
        return []
    return sorted(p for p in path.parent.iterdir() if pattern.fullmatch(p.name) and p.is_file())


def cut_torn_fragment(path: Path) -> bool:
    """Truncate a fragmented MP4 (``VideoWriter``'s) after its last whole top-level box, a
    fragment counting as whole with its ``mdat``: a write that failed halfway (a full disk)
    leaves a torn last fragment, which a player or decoder stops at with an error, and a
    frame count read from it would count frames it cannot show. Reads only the boxes'
    headers. Returns whether it cut anything."""
    size = path.stat().st_size
    whole = position = 0
    with open(path, "r+b") as file:
        while position + 8 <= size:
            file.seek(position)
            header = file.read(16)
            length, kind = int.from_bytes(header[:4], "big"), header[4:8]
            if length == 1 and len(header) == 16:  # a 64-bit size follows the type
                length = int.from_bytes(header[8:16], "big")
            elif length == 0:  # the box runs to the end of the file
                length = size - position
            if length < 8 or position + length > size:
                break
            position += length
            if kind != b"moof":  # a fragment's header is whole only with its data after it
                whole = position
        if whole < size:
            file.truncate(whole)
            return True
    return False


def video_span(path: Path) -> tuple[int, int] | None:
    """What the MP4 at ``path`` (one ``VideoWriter`` wrote) holds: ``(frames, last)``, its
    number of video frames and the last one's frame number counted from its first (its
    time in frames: ``frames - 1`` unless a live source dropped frames in between); ``(0,
    -1)`` when it holds no frame (a part whose process was killed before its first fragment
    holds only its header, or nothing at all); None when PyAV cannot read it. Reads the
    packets' times without decoding them."""
    if path.stat().st_size == 0:
        return 0, -1
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                return 0, -1
            times = [(packet.pts, packet.duration) for packet in container.demux(video=0)
                     if packet.size and packet.pts is not None]
    except av.FFmpegError:
        return None
    if not times:
        return 0, -1
    # A frame's time is its frame number since the first, in frames (``VideoWriter``); a
    # packet lasts one frame.
    step = min((duration for _, duration in times if duration), default=0)
    pts = [t for t, _ in times]
    last = round((max(pts) - min(pts)) / step) if step else len(times) - 1
    return len(times), last


def resumed_video_path(path: Path, first_frame: int) -> Path:
    """Where the video of a source resumed at ``first_frame`` goes: ``cam.mp4`` ->
    ``cam.from-1200.mp4`` (a new file: an MP4 cut by a killed process cannot be appended to)."""
    return path.with_name(f"{path.stem}.from-{first_frame}{path.suffix}")


def older_video_path(path: Path) -> Path:
    """Where an earlier run's whole video goes when a resumed run of its source completes
    in parts (its records no longer match it): ``cam.mp4`` -> ``cam.older.mp4``."""
    return path.with_name(f"{path.stem}.older{path.suffix}")


def set_aside(video: Path) -> tuple[Path | None, bool]:
    """Move an earlier run's whole ``video`` to ``older_video_path``, replacing a file there:
    (where it went, whether it replaced one); (None, False) when there is no such file."""
    if not video.is_file():
        return None, False
    older = older_video_path(video)
    replaced = older.exists()
    os.replace(video, older)
    return older, replaced


@dataclass(frozen=True)
class VideoPart:
    """One file of a resumed source's video: it holds frames ``first`` to ``last`` of the
    source (each at most once; a live source's dropped frames are not in it).

    Attributes:
        path: the file (its final name).
        first: the frame number of its first frame.
        last: the frame number of its last frame, or None when its file could not be read
            (not judged: taken to hold every frame up to the next part's first).
        frames: how many frames it holds, or None when not known.
    """

    path: Path
    first: int
    last: int | None
    frames: int | None

    def __post_init__(self) -> None:
        if self.first < 0:
            raise ValueError(f"first must be >= 0, got {self.first}")
        if self.last is not None and self.last < self.first:
            raise ValueError(f"last must be >= first ({self.first}), got {self.last}")
        if self.frames is not None and self.frames < 1:
            raise ValueError(f"frames must be >= 1 (a part holds a frame), got {self.frames}")


def frames_without_video(first: int, last: int,
                         parts: Iterable[VideoPart]) -> list[tuple[int, int]]:
    """The runs of frames ``first`` to ``last`` (the source's records) that no part of its
    video spans, as ``(first, last)`` pairs in order. A part spans its first frame to its
    last (a live source's drops inside it are not counted); one whose last frame is not known
    spans up to the next part's first, or to ``last``."""
    ordered = sorted(parts, key=lambda part: part.first)
    missing = []
    next_frame = first  # the first frame not known to be in the video
    for k, part in enumerate(ordered):
        if part.first > next_frame:
            missing.append((next_frame, min(part.first - 1, last)))
        end = part.last if part.last is not None else (
            ordered[k + 1].first - 1 if k + 1 < len(ordered) else last)
        next_frame = max(next_frame, end + 1)
        if next_frame > last:
            break
    if next_frame <= last:
        missing.append((next_frame, last))
    return [(a, b) for a, b in missing if a <= b]


def frame_ranges_text(ranges: Iterable[tuple[int, int]]) -> str:
    """``[(0, 37), (90, 90)]`` -> ``"0-37, 90"``."""
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


class JsonlWriter:
    """One JSON object per frame: source, frame index, pts, capture time and detections.

    A batch part's lines go out in one ``write`` and one flush: a crash loses at most the
    last batch part (the one being written), never a line of an earlier one.

    Args:
        path: the final path.
        class_names: names indexed by class id, or None.
        tracked: the source is tracked: each detection carries its ``tracker_id``.
        append: keep the complete lines of an existing ``.partial`` file (a torn last line
            is cut) and append to it: a moved source resuming (``pipeline.resume``).
        origin: the file source's identity (``pipeline.resume.file_origin``), stamped on a
            new ``.partial`` file so that a later run resumes it only from the same file;
            None: nothing stamped.
        settings: what makes the records (``pipeline.resume.RecordsSettings``: the model's
            files and the detection settings), stamped on a new ``.partial`` file so that a
            later run resumes it only with the same; None: nothing stamped.
    """

    def __init__(self, path: Path, class_names: list[str] | None, tracked: bool = False,
                 append: bool = False, origin: dict[str, object] | None = None,
                 settings: RecordsSettings | None = None) -> None:
        self.path = path
        self.class_names = class_names
        self.tracked = tracked
        partial = partial_path(path)
        partial.parent.mkdir(parents=True, exist_ok=True)
        if append and partial.exists():
            cut_torn_line(partial)
        self._file = open(partial, "a" if append else "w")
        self.kept = self._file.tell() > 0  # lines of an earlier run, appended to
        if origin is not None and not self.kept:  # kept: stamped by the run that began it
            stamp_origin(partial, origin)
        if settings is not None and not self.kept:
            stamp_settings(partial, settings)
        self.frames = 0
        self.last_frame: int | None = None  # the frame number of this run's last record

    def write(self, item: BatchDetections) -> None:
        """Append one line per frame of ``item``, in batch order, and flush."""
        records = frame_records(item, self.class_names, self.tracked)
        if not records:
            return
        try:
            self._file.write("".join(json.dumps(record, separators=(",", ":")) + "\n"
                                     for record in records))
            self._file.flush()
        except OSError as error:  # a full disk, say: the message names the file
            raise OSError(error.errno, error.strerror, self._file.name) from None
        self.frames += len(records)
        self.last_frame = records[-1]["frame"]

    def close(self, complete: bool) -> None:
        """Close the file; rename it to its final name when ``complete`` and it saw a frame
        (this run's or a resumed one's); remove it when it saw none (no file at all)."""
        self._file.close()
        if not self.frames and not self.kept:
            partial_path(self.path).unlink(missing_ok=True)
        elif complete:
            os.replace(partial_path(self.path), self.path)


class EventsWriter(JsonlWriter):
    """One JSON object per analytics event (``AnalyticsEvent.to_json``), in frame order; a
    batch part's events go out in one ``write`` and one flush. ``frames`` counts the frames
    seen (with or without events), ``events`` the lines written."""

    def __init__(self, path: Path, append: bool = False) -> None:
        super().__init__(path, None, append=append)
        self.events = 0

    def write(self, item: BatchDetections) -> None:
        """Append one line per event of ``item`` (if any) and flush."""
        self.frames += len(item)
        self.write_events(item.events)

    def write_events(self, events: tuple[AnalyticsEvent, ...]) -> None:
        """Append one line per event (if any) and flush."""
        if not events:
            return
        self._file.write("".join(json.dumps(event.to_json(), separators=(",", ":")) + "\n"
                                 for event in events))
        self._file.flush()
        self.events += len(events)


class SinkStage(Stage[BatchDetections, None]):
    """Writes one source's frames to its outputs, one batch part at a time.

    Args:
        name: stage name.
        video_path: annotated MP4 path, or None.
        jsonl_path: detections JSONL path, or None.
        class_names: names indexed by class id, or None.
        crf: x264 quality.
        live: the source is a live camera (only a live source is segmented).
        tracked: the source is tracked: its JSONL detections carry ``tracker_id``.
        events_path: the analytics events JSONL path, or None.
        resume_from: the source resumes at this frame (``SourceConfig.start_frame``: it was
            moved from a pipeline that died): its JSONL and events files are appended to
            (complete lines kept), and its video goes to a new file, ``NAME.from-FRAME.mp4``;
            when it completes, the earlier parts cut short get final names too
            (``NAME.from-FIRST.mp4``), a warning names the frames no part holds, and an
            earlier run's ``NAME.mp4`` is moved to ``NAME.older.mp4`` (``close``). None: a
            fresh start (when complete, its ``NAME.mp4`` replaces those files).
        release_slots: called once per batch part, after all its frames were written, with
            ``item.frames.slot`` ((k,) int32 host array: the slot-ring slots of the part's k
            frames; -1 for a frame that holds none, which the callable must ignore), so the
            pipeline can reuse those host slots: the sink is the last reader of the images.
            Also called when writing failed (the frames are finished with either way).
            None: the sink releases nothing.
        segment_s: a live source's outputs go to a new segment (``segment_path``) whenever
            a frame's capture time reaches the next multiple of this many seconds; None (or
            a source that is not live): one file per output. A segmented sink ignores
            ``resume_from``: its new segments have new names.
        keep_hours: with ``segment_s``: delete this output's segments (finished, or
            ``.partial`` ones a killed run left) last modified more than this many hours ago,
            when the sink opens and at every new segment; None: keep every one.
        clock: the time retention measures ages against (Unix seconds).
        origin: a file source's identity, stamped on its new records file (``JsonlWriter``).
        settings: what makes a file source's records, stamped on its new records file
            (``JsonlWriter``).
        earlier_video: with no video of its own (``video_path`` None), the final name an
            earlier run's video of this file source had (``NAME.mp4``): a resumed run that
            completes moves it to ``NAME.older.mp4``, as one that writes video does (a new
            user's resumed records once sat beside an older run's video of that name).
    """

    def __init__(self, name: str, video_path: Path | None, jsonl_path: Path | None,
                 class_names: list[str] | None, crf: int = 23,
                 release_slots: Callable[[np.ndarray], None] | None = None,
                 live: bool = False, tracked: bool = False,
                 events_path: Path | None = None, preview: PreviewSink | None = None,
                 resume_from: int | None = None, segment_s: float | None = None,
                 keep_hours: float | None = None,
                 clock: Callable[[], float] = time.time,
                 origin: dict[str, object] | None = None,
                 settings: RecordsSettings | None = None,
                 earlier_video: Path | None = None) -> None:
        super().__init__(name)
        self.earlier_video = None if live else earlier_video
        self.origin, self.settings = origin, settings
        self.segment_s = segment_s if live else None
        self.keep_s = keep_hours * 3600 if keep_hours is not None and self.segment_s else None
        self.clock = clock
        self._segment_end = -math.inf  # capture time at which the open segment ends
        self.resume_from = resume_from
        self.live, self.tracked = live, tracked
        self.video_path, self.jsonl_path, self.events_path = video_path, jsonl_path, events_path
        self.class_names, self.crf = class_names, crf
        self.release_slots = release_slots
        self.preview = preview
        self.writers: list[VideoWriter | JsonlWriter | EventsWriter] = []
        self._recordings: deque[VideoWriter] = deque(maxlen=RECORDINGS_KEPT)
        self.complete = False
        # A file source stopped before its end: (frames read, frames it has or None).
        self.stopped_at: tuple[int, int | None] | None = None
        self._video_base: Path | None = video_path  # set again by open()

    def open(self) -> None:
        if self.segment_s is not None:
            self._delete_old_segments()  # a segment's writers open at its first frame
            return
        resumed = self.resume_from is not None
        self._video_base = self.video_path  # the final name of a whole run's video
        if self.video_path is not None and resumed:
            self.video_path = resumed_video_path(self.video_path, self.resume_from)
        # The final names stay as an older run left them until this run's files replace them
        # (close); only the temporary names are this run's to start again.
        for path in (self.video_path, self.jsonl_path, self.events_path):
            if path is not None and (not resumed or path == self.video_path):
                unfinished = partial_path(path)  # resumed: append to the records
                if not unfinished.exists():
                    continue
                if self.live and not resumed:
                    self._finish_earlier(unfinished, path)
                    continue
                unfinished.unlink()
                log.info("an earlier run's unfinished output deleted: this run writes it "
                         "anew", sink=self.name, path=str(unfinished))
        if self.video_path is not None and not resumed:
            self._delete_cut_parts()
        # The records of a part are written before its video: whatever a killed run's MP4
        # holds has its records.
        if self.jsonl_path is not None:
            self.writers.append(JsonlWriter(self.jsonl_path, self.class_names, self.tracked,
                                            append=resumed, origin=self.origin,
                                            settings=self.settings))
        if self.events_path is not None:
            self.writers.append(EventsWriter(self.events_path, append=resumed))
        if self.video_path is not None:
            self.writers.append(VideoWriter(self.video_path, self.crf))
            self._recordings.append(self.writers[-1])

    def _delete_cut_parts(self) -> None:
        """A source started from its first frame: the video parts that earlier resumed runs
        left cut short (``NAME.from-FRAME.partial.mp4``) belong to records this run replaces,
        and a later resume of this run would take them for its own (frames twice, another
        run's video under these records' name): deleted now, each logged. Final-named parts
        stay until this run completes (``_delete_replaced_video``)."""
        assert self.video_path is not None
        suffix = f".partial{self.video_path.suffix}"
        for part in video_parts(self.video_path):
            if part.name.endswith(suffix):
                part.unlink(missing_ok=True)
                log.info("an earlier run's unfinished output deleted: this run writes it "
                         "anew", sink=self.name, path=str(part))

    def _finish_earlier(self, unfinished: Path, final: Path) -> None:
        """A live source's output left ``.partial`` by an earlier run that was killed (or
        failed to rename it): a camera's output is complete whenever it stops, so it gets its
        final name now, as that run would have given it (its torn last line or fragment cut
        first), replacing the final file there as that run's end would have; this run's own
        replaces it in turn when it ends. One that holds nothing is deleted. Logged."""
        if final == self.video_path:
            if self._settle_video_part(unfinished) is EMPTY_VIDEO:
                return
        elif cut_torn_line(unfinished) is None:
            unfinished.unlink()
            log.info("an earlier run's empty unfinished output deleted", sink=self.name,
                     path=str(unfinished))
            return
        replaced = final.exists()
        os.replace(unfinished, final)
        log.info("an earlier run's unfinished output given its final name (that run ended "
                 "without it); this run's own replaces it when it ends", sink=self.name,
                 path=str(final),
                 renamed_from=str(unfinished), **({"replaced": True} if replaced else {}))

    def _settle_video_part(self, part: Path) -> tuple[int, int] | None | object:
        """An earlier run's unfinished video (``.partial``: a killed run's, or a full
        disk's) before it gets a final name: its torn last fragment cut, then what it holds
        (``video_span``; None where PyAV cannot read it: kept, nothing is lost). One that
        holds no frame (killed before its first fragment; the records have the frames) is
        deleted and ``EMPTY_VIDEO`` returned. Each step logged."""
        if cut_torn_fragment(part):
            log.warning("a torn last fragment cut from a video (written halfway: a killed "
                        "run, or a full disk)", sink=self.name, path=str(part))
        span = video_span(part)
        if span is not None and span[0] == 0:
            part.unlink(missing_ok=True)
            log.info("an earlier run's empty unfinished output deleted", sink=self.name,
                     path=str(part))
            return EMPTY_VIDEO
        return span

    def recording_of(self, frame: int) -> VideoWriter | None:
        """The video writer of this run whose file holds (or will hold) frame ``frame`` of
        the source: the newest of the last ``RECORDINGS_KEPT`` that started at or before it;
        None when none did yet (or no video is written). Any thread."""
        for writer in reversed(list(self._recordings)):
            if writer.frames and writer.first_index <= frame:
                return writer
        return None

    def _paths(self) -> list[Path]:
        """The configured outputs (final paths, not segments)."""
        return [p for p in (self.jsonl_path, self.events_path, self.video_path) if p is not None]

    def process(self, item: BatchDetections) -> Iterable[None]:
        """Write a batch part (this source's frames only, in frame order) to every output,
        then release its slots."""
        try:
            if self.preview is not None:  # before the slots go back: it may copy a picture
                self.preview.offer_part(item, annotated=self.video_path is not None)
            if self.segment_s is None:
                for writer in self.writers:
                    writer.write(item)
            else:
                self._write_segmented(item)
        finally:
            if self.release_slots is not None:
                self.release_slots(item.frames.slot)
        return ()

    def _write_segmented(self, item: BatchDetections) -> None:
        """Write ``item``, starting a new segment at each frame whose capture time reaches
        the open segment's end (the part is cut there: its rows go to the two segments)."""
        times = item.frames.capture_time
        start = 0
        while start < len(item):
            if times[start] >= self._segment_end:
                self._start_segment(float(times[start]))
            later = np.flatnonzero(times[start:] >= self._segment_end)
            end = start + int(later[0]) if len(later) else len(item)
            part = item if (start, end) == (0, len(item)) else item.select(np.arange(start, end))
            for writer in self.writers:
                writer.write(part)
            start = end

    def _start_segment(self, first: float) -> None:
        """Finish the open segment (its files get their final names) and open the next,
        named by ``first``, its first frame's capture time (a second later per name taken)."""
        assert self.segment_s is not None
        if self.writers:
            self._close_writers(complete=True)
            self.writers = []
        self._segment_end = (math.floor(first / self.segment_s) + 1) * self.segment_s
        paths = self._paths()
        stamp = first
        while any(segment_path(p, stamp).exists() or partial_path(segment_path(p, stamp)).exists()
                  for p in paths):  # an earlier run's segment of the same second
            stamp += 1
        if self.jsonl_path is not None:
            self.writers.append(JsonlWriter(segment_path(self.jsonl_path, stamp),
                                            self.class_names, self.tracked))
        if self.events_path is not None:
            self.writers.append(EventsWriter(segment_path(self.events_path, stamp)))
        if self.video_path is not None:
            self.writers.append(VideoWriter(segment_path(self.video_path, stamp), self.crf))
            self._recordings.append(self.writers[-1])
        self._delete_old_segments()

    def _delete_old_segments(self) -> None:
        """Delete the segments of this sink's outputs modified more than ``keep_hours`` ago
        (``segment_files``: nothing else in the folder), except the open one's."""
        if self.keep_s is None:
            return
        now = self.clock()
        open_files = {path for w in self.writers for path in (w.path, partial_path(w.path))}
        for output in self._paths():
            for old in segment_files(output):
                if old in open_files:
                    continue
                try:
                    age_s = now - old.stat().st_mtime
                except FileNotFoundError:
                    continue
                if age_s > self.keep_s:
                    old.unlink(missing_ok=True)
                    log.info("old segment deleted", sink=self.name, path=str(old),
                             age_h=round(age_s / 3600, 2))

    def end_of_stream(self, eos: EndOfStream) -> Iterable[EndOfStream]:
        for writer in self.writers:  # the exits of the objects inside a zone at its end
            if isinstance(writer, EventsWriter):
                writer.write_events(eos.events)
        # A source that failed, or a file stopped before its end, leaves its outputs under
        # their .partial names; a camera's are complete whenever it stops.
        if eos.cut_short and not self.live:
            self.stopped_at = (eos.frames, eos.total)
        self.complete = eos.error is None and self.stopped_at is None
        if self.preview is not None:
            self.preview.end(eos.source, eos.error)
        return ()

    def close(self) -> None:
        try:
            self._close_writers(self.complete)
        except BaseException:
            self.complete = False  # its outputs are not final: the source failed with them
            raise
        if not self.complete or self.segment_s is not None:
            return
        if self.video_path is None:
            if self.resume_from is not None and self.earlier_video is not None:
                self._set_aside_earlier_video()
            return
        if self.resume_from is None:
            self._delete_replaced_video()
        else:
            self._name_earlier_parts()

    def _video_writer(self) -> VideoWriter | None:
        """This run's video writer (the one file of an unsegmented sink), or None."""
        return next((w for w in self.writers if isinstance(w, VideoWriter)), None)

    def _delete_replaced_video(self) -> None:
        """A source that was not resumed just completed with its whole video in ``NAME.mp4``:
        what earlier runs left of that video is replaced by it and deleted, each logged: the
        parts of a resumed run (``NAME.from-FRAME.mp4``; those cut short went when this run
        started, ``_delete_cut_parts``) and an earlier
        run's video set aside (``NAME.older.mp4``). When this run wrote no video (no frame
        came), nothing replaces them: they stay."""
        writer = self._video_writer()
        if writer is None or not writer.frames:
            return
        assert self.video_path is not None
        older = older_video_path(self.video_path)
        for old in [*video_parts(self.video_path), *([older] if older.is_file() else [])]:
            old.unlink(missing_ok=True)
            log.info("older video deleted: replaced by this run's", sink=self.name,
                     path=str(old), replaced_by=[str(self.video_path)])

    def _name_earlier_parts(self) -> None:
        """A resumed source just completed: the video parts earlier runs cut short get
        their final names too, ``NAME.from-FIRST.mp4`` (FIRST: the first frame of the records,
        for the first part), so every part of the finished file has a final name and no
        ``.partial`` file is left (a part that holds no frame is deleted); parts an older
        finished run left are deleted (the records they belonged to were just replaced), so
        the parts hold every frame once. Each file named or deleted is logged.

        Then one warning says what the parts do not hold, when there is something to say:
        the frames of the records that no part spans (a killed run's part lacks its last
        fragment and the frames its encoder held; one killed before its first fragment is
        deleted), and an earlier run's whole video under the final name (``NAME.mp4``, whose
        records these replaced): it is moved to ``NAME.older.mp4`` (replacing one there), so
        that no file beside ``NAME.jsonl`` under the same name belongs to other records, and
        nothing is lost; a later run that plays the file through deletes it."""
        base = self._video_base
        assert base is not None and self.video_path is not None
        first_recorded = self._first_recorded_frame()
        parts: list[VideoPart] = []
        own = self._video_writer()
        if own is not None and own.frames:  # this run's own part, final already
            parts.append(VideoPart(self.video_path, own.first_index, own.last_index,
                                   own.frames))
        suffix = f".partial{base.suffix}"
        cut_parts = {part: (part.with_name(part.name[:-len(suffix)] + base.suffix), first)
                     for part, first in video_parts(base).items() if part.name.endswith(suffix)}
        first_part = partial_path(base)
        if first_part.exists():
            cut_parts[first_part] = (resumed_video_path(base, first_recorded), first_recorded)
        for part, (final, first) in cut_parts.items():
            span = self._settle_video_part(part)
            if span is EMPTY_VIDEO:
                continue
            replaced = final.exists()
            os.replace(part, final)
            frames, last = span if span is not None else (None, None)
            parts.append(VideoPart(final, first, None if last is None else first + last, frames))
            log.info("output written", sink=self.name, path=str(final), frames=frames,
                     renamed_from=str(part), **({"replaced": True} if replaced else {}))
        # Parts of an older finished run of this file (its records were just replaced by
        # these): left, they would hold some frames a second time.
        kept = {part.path for part in parts}
        for old in video_parts(base):
            if old not in kept and not old.name.endswith(suffix):
                old.unlink(missing_ok=True)
                log.info("older video deleted: replaced by this run's", sink=self.name,
                         path=str(old), replaced_by=sorted(str(p) for p in kept))
        self._warn_of_video_parts(base, sorted(parts, key=lambda part: part.first),
                                  first_recorded)

    def _warn_of_video_parts(self, base: Path, parts: list[VideoPart],
                             first_recorded: int) -> None:
        """The warning of ``_name_earlier_parts`` (and the move of an earlier run's
        ``NAME.mp4`` to ``NAME.older.mp4``); nothing is logged when every frame of the records
        is in a part and there is no such video."""
        missing: list[tuple[int, int]] = []
        if self.jsonl_path is not None:
            records = next((w for w in self.writers if type(w) is JsonlWriter), None)
            last_recorded = (records.last_frame if records is not None
                             and records.last_frame is not None else self.resume_from - 1)
            missing = frames_without_video(first_recorded, last_recorded, parts)
        older, replaced = set_aside(base)
        if not missing and older is None:
            return
        names = ", ".join(part.path.name for part in parts) or "none holds a frame"
        text = f"the video of this resumed source is in parts ({names})"
        if missing:
            text += (f"; frames {frame_ranges_text(missing)} have records but no video (a "
                     f"killed or failed run's video loses its last fragment, up to "
                     f"{FRAGMENT_S:g} s, and the frames its encoder held)")
        if older is not None:
            text += (f"; {base.name} is an earlier run's video, which does not match these "
                     f"records: moved to {older.name}"
                     + (f" (replacing the {older.name} there)" if replaced else ""))
        log.warning(text, sink=self.name, records=str(self.jsonl_path),
                    parts=[str(part.path) for part in parts],
                    frames_without_video=frame_ranges_text(missing) or None,
                    earlier_video=None if older is None else str(older))

    def _set_aside_earlier_video(self) -> None:
        """A resumed file source without video completed: an earlier run's ``NAME.mp4``
        (``earlier_video``), whose records these just replaced, is moved to
        ``NAME.older.mp4``, warned of."""
        assert self.earlier_video is not None
        older, replaced = set_aside(self.earlier_video)
        if older is not None:
            log.warning(f"{self.earlier_video.name} is an earlier run's video, which does not "
                        f"match this resumed source's records: moved to {older.name}"
                        + (f" (replacing the {older.name} there)" if replaced else ""),
                        sink=self.name, records=str(self.jsonl_path),
                        earlier_video=str(older))

    def _first_recorded_frame(self) -> int:
        """The ``frame`` of the first record of the (final) JSONL file, or 0 without one."""
        try:
            with open(self.jsonl_path) as records:  # type: ignore[arg-type]
                return int(json.loads(records.readline())["frame"])
        except (OSError, TypeError, ValueError, KeyError):
            return 0

    def _close_writers(self, complete: bool) -> None:
        """Close every writer and say what each left; a writer whose close fails (a full
        disk) keeps its .partial file, is told as ``output incomplete`` with the error, and
        does not stop the others closing.

        Raises:
            OSError: the first writer's close that failed, once all are closed.
        """
        failed: OSError | None = None
        for writer in self.writers:
            # what the writer renames when complete: it saw a frame (or kept an earlier run's)
            wrote = bool(writer.frames or getattr(writer, "kept", False))
            replaced = complete and wrote and writer.path.exists()  # an older run's file
            try:
                writer.close(complete)
            except OSError as error:
                failed = failed or error
                log.warning("output incomplete", sink=self.name,
                            path=str(partial_path(writer.path)), frames=writer.frames,
                            resumed_at=self.resume_from,
                            error=f"closing it failed: {type(error).__name__}: {error}")
                continue
            if complete and wrote:
                log.info("output written", sink=self.name, path=str(writer.path),
                         frames=writer.frames, resumed_at=self.resume_from,  # frames: this part's
                         **({"replaced": True} if replaced else {}))
            elif complete:
                log.warning("no output written: no frame came", sink=self.name,
                            path=str(writer.path))
            elif writer.frames and self.stopped_at is not None:
                log.warning("output cut short: " + stopped_text(*self.stopped_at)
                            + ": kept as .partial (run again to resume)", sink=self.name,
                            path=str(partial_path(writer.path)), frames=writer.frames,
                            resumed_at=self.resume_from)  # frames: this part's, as above
            elif writer.frames:
                log.warning("output incomplete", sink=self.name,
                            path=str(partial_path(writer.path)), frames=writer.frames,
                            resumed_at=self.resume_from)
        if failed is not None:
            raise failed
