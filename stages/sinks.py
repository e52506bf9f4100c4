"""Sinks: per source, an annotated H.264 MP4 and a JSON Lines file of detections.

Each output is written under a temporary ``.partial`` name and renamed to its final name only
when its source's stream ended (also after a graceful stop): a file with the final name is
always complete, playable and from the latest run (older ones are removed when the sink
opens); a ``.partial`` file says the run was cut short, and is removed when it holds nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import structlog

from pipeline.records import EndOfStream, Frame
from pipeline.stage import Stage

log = structlog.get_logger("sinks")

DEFAULT_RATE = Fraction(25)


def partial_path(path: Path) -> Path:
    """Where ``path`` is written until it is complete (keeps the extension)."""
    return path.with_name(f"{path.stem}.partial{path.suffix}")


class VideoWriter:
    """Encodes I420 frames to an H.264 MP4 (yuv420p, faststart: plays in browsers).

    Frames are numbered in order, at the source's nominal rate, so the output has exactly
    as many frames as were written. A frame of another size than the first is scaled to it.
    """

    def __init__(self, path: Path, crf: int) -> None:
        self.path = path
        self.crf = crf
        self._container: av.container.OutputContainer | None = None
        self._stream: av.video.stream.VideoStream | None = None
        self.frames = 0

    def write(self, frame: Frame) -> None:
        """Args: frame with ``image`` an (h*3/2, w) uint8 I420 host array."""
        if self._container is None:
            self._open(frame)
        assert self._stream is not None and self._container is not None
        picture = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame.image), format="yuv420p")
        if (picture.width, picture.height) != (self._stream.width, self._stream.height):
            picture = picture.reformat(width=self._stream.width, height=self._stream.height)
        picture.pts = self.frames
        self._container.mux(self._stream.encode(picture))
        self.frames += 1

    def _open(self, frame: Frame) -> None:
        partial_path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._container = av.open(str(partial_path(self.path)), "w", format="mp4",
                                  options={"movflags": "+faststart"})
        rate = frame.rate or DEFAULT_RATE
        stream = self._container.add_stream("libx264", rate=rate)
        stream.width, stream.height = frame.width, frame.height
        stream.pix_fmt = "yuv420p"
        stream.time_base = 1 / rate
        stream.options = {"crf": str(self.crf), "preset": "veryfast"}
        self._stream = stream

    def close(self, complete: bool) -> None:
        """Flush the encoder and finalise the file; rename it when ``complete``."""
        if self._container is None:
            return  # no frame: no file
        assert self._stream is not None
        self._container.mux(self._stream.encode(None))
        self._container.close()
        self._container = None
        if complete:
            os.replace(partial_path(self.path), self.path)


class JsonlWriter:
    """One JSON object per frame: source, frame index, pts, capture time and detections."""

    def __init__(self, path: Path, class_names: list[str] | None) -> None:
        self.path = path
        self.class_names = class_names
        partial_path(path).parent.mkdir(parents=True, exist_ok=True)
        self._file = open(partial_path(path), "w", buffering=1)  # line-buffered: no loss on crash
        self.frames = 0

    def write(self, frame: Frame) -> None:
        detections = frame.detections.to_records(self.class_names) if frame.detections else []
        record = {"source": frame.source, "frame": frame.index, "pts": frame.pts,
                  "capture_time": round(frame.capture_time, 6), "detections": detections}
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self.frames += 1

    def close(self, complete: bool) -> None:
        self._file.close()
        if complete:
            os.replace(partial_path(self.path), self.path)
        elif not self.frames:
            partial_path(self.path).unlink(missing_ok=True)


class SinkStage(Stage):
    """Writes one source's frames to its outputs.

    Args:
        name: stage name.
        video_path: annotated MP4 path, or None.
        jsonl_path: detections JSONL path, or None.
        class_names: names indexed by class id, or None.
        crf: x264 quality.
    """

    def __init__(self, name: str, video_path: Path | None, jsonl_path: Path | None,
                 class_names: list[str] | None, crf: int = 23) -> None:
        super().__init__(name)
        self.video_path, self.jsonl_path = video_path, jsonl_path
        self.class_names, self.crf = class_names, crf
        self.writers: list[VideoWriter | JsonlWriter] = []
        self.complete = False

    def open(self) -> None:
        for path in (self.video_path, self.jsonl_path):
            if path is not None:  # an older run's outputs must not pass for this run's
                path.unlink(missing_ok=True)
                partial_path(path).unlink(missing_ok=True)
        if self.video_path is not None:
            self.writers.append(VideoWriter(self.video_path, self.crf))
        if self.jsonl_path is not None:
            self.writers.append(JsonlWriter(self.jsonl_path, self.class_names))

    def process(self, item: Frame) -> Iterable[Frame]:
        for writer in self.writers:
            writer.write(item)
        return ()

    def end_of_stream(self, eos: EndOfStream) -> Iterable[EndOfStream]:
        # A source that failed leaves its outputs under their .partial names.
        self.complete = eos.error is None
        return ()

    def close(self) -> None:
        for writer in self.writers:
            writer.close(self.complete)
            if self.complete:
                log.info("output written", sink=self.name, path=str(writer.path),
                         frames=writer.frames)
            elif writer.frames:
                log.warning("output incomplete", sink=self.name,
                            path=str(partial_path(writer.path)), frames=writer.frames)
