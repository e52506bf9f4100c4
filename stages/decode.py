"""Decode: demux and decode one source (file or rtsp:// URL) with PyAV into I420 frames."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from fractions import Fraction

import av
import structlog

from pipeline.config import SourceConfig, is_stream_url
from pipeline.records import EndOfStream, Frame
from pipeline.stage import SourceStage

log = structlog.get_logger("decode")


def redact_url(uri: str) -> str:
    """The URI with any ``user:password@`` credentials replaced by ``***@``."""
    return re.sub(r"(?<=://)[^/@\s]+@", "***@", uri)


def open_options(source: SourceConfig) -> dict[str, str]:
    """FFmpeg options for opening the source (transport and socket timeouts for streams)."""
    if not is_stream_url(source.uri):
        return {}
    options = {"rtsp_transport": source.rtsp_transport}
    if source.uri.lower().startswith("rtsp"):
        options["timeout"] = str(int(source.read_timeout_s * 1_000_000))  # microseconds
    return options


def to_i420(frame: av.VideoFrame) -> av.VideoFrame:
    """The frame as yuv420p with even width and height (converted only when it is not)."""
    width, height = frame.width & ~1, frame.height & ~1
    if frame.format.name == "yuv420p" and (width, height) == (frame.width, frame.height):
        return frame
    return frame.reformat(width=width, height=height, format="yuv420p")


class DecodeStage(SourceStage):
    """Reads one source and yields its frames as I420 host arrays.

    Uses the first video stream of the container (audio and other streams are ignored),
    with FFmpeg's frame threading. A packet that fails to decode is skipped with a warning;
    a source that cannot be opened ends its stream with an error instead of raising.
    """

    def __init__(self, source: SourceConfig) -> None:
        super().__init__(source.name)
        self.source = source
        self.live = source.is_live
        self.display_uri = redact_url(source.uri)
        self._container: av.container.InputContainer | None = None
        if not self.live:
            self.expected_frames = self._probe_frame_count()

    def _probe_frame_count(self) -> int | None:
        try:
            with av.open(self.source.uri) as container:
                frames = container.streams.video[0].frames if container.streams.video else 0
            return frames or None
        except (av.FFmpegError, OSError):
            return None  # reported with its reason when the stream is read

    def _open(self) -> av.container.InputContainer:
        timeout = (self.source.open_timeout_s, self.source.read_timeout_s)
        return av.open(self.source.uri, options=open_options(self.source), timeout=timeout)

    def frames(self, stop_reading: threading.Event) -> Iterator[Frame | EndOfStream]:
        index = 0
        try:
            self._container = container = self._open()
        except (av.FFmpegError, OSError) as error:
            reason = f"cannot open {self.display_uri}: {error_text(error)}"
            log.error("source failed", source=self.name, reason=reason)
            yield EndOfStream(self.name, 0, error=reason)
            return
        if not container.streams.video:
            reason = f"{self.display_uri} has no video stream"
            log.error("source failed", source=self.name, reason=reason)
            yield EndOfStream(self.name, 0, error=reason)
            return
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        rate = stream.average_rate or stream.guessed_rate
        rate = Fraction(rate) if rate else None
        log.info("source opened", source=self.name, uri=self.display_uri, live=self.live,
                 codec=stream.codec_context.name, size=f"{stream.width}x{stream.height}",
                 fps=float(rate) if rate else None, frames=self.expected_frames)
        error: str | None = None
        try:
            for packet in container.demux(stream):
                if stop_reading.is_set():
                    break
                try:
                    decoded = packet.decode()
                except av.InvalidDataError as bad:
                    log.warning("skipped undecodable packet", source=self.name,
                                error=error_text(bad))
                    continue
                for picture in decoded:
                    picture = to_i420(picture)
                    yield Frame(
                        source=self.name,
                        index=index,
                        pts=float(picture.time) if picture.time is not None else None,
                        capture_time=time.time(),
                        width=picture.width,
                        height=picture.height,
                        rate=rate,
                        image=picture.to_ndarray(),
                    )
                    index += 1
        except (av.FFmpegError, OSError) as failure:
            error = f"reading {self.display_uri} failed after {index} frames: {error_text(failure)}"
            log.error("source failed", source=self.name, reason=error)
        log.info("source ended", source=self.name, frames=index)
        yield EndOfStream(self.name, index, error=error)

    def close(self) -> None:
        if self._container is not None:
            self._container.close()
            self._container = None


def error_text(error: BaseException) -> str:
    """A one-line description of a PyAV/OS error, without the file name repeated."""
    message = getattr(error, "strerror", None) or str(error)
    return " ".join(str(message).split())
