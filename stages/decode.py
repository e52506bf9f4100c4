"""Decode: demux and decode one source (file or stream URL) with PyAV into I420 frames.

A stream (rtsp://...) is opened with its transport (TCP by default) and two timeouts: one
for opening, one for each read, so a stalled camera counts as lost after ``read_timeout_s``.
A live stream that fails in any way (refused, timeout, end of stream, a run of undecodable
packets) is reopened after an exponential backoff with jitter, until the run stops; its frame
index keeps counting across reconnections. Every attempt that fails is reported at once
(``DecodeStage.link``, and ``on_link`` for a decode worker to pass on), before any first
connection too. A file is read once: its undecodable packets are
skipped, and a file that ends early (truncated) yields every decodable frame and a warning.
A looped file (``loop``, live) is read again from its start at each end, until the run stops:
a seek to its start in the open container (no reopening: a GPU decoder keeps its context), its
frame numbers counting on and its pacing schedule (``Pacer``) running on across the wrap; a
pass that reads no frame ends it with an error, rather than spin.

Every frame has a pts, in seconds (float): a file's own presentation times (a frame without
one: the previous one's plus a frame period); a camera's from 0.0 at its first frame, on its
stream's clock, and increasing across reconnections: a new session goes on from the last pts
plus the wall-clock time the camera was away (at least a frame period); a looped file's from
0.0, each pass going on a frame period of the file after the previous pass's last pts (later
by the file's duration each pass).

A live source that falls more than ``max_lag_ms`` behind real time catches up: it stops
decoding, reads packets without decoding them up to the next keyframe at which it is back
within that lag, and decodes on from there (``CatchUp``). Behind means, for a paced source,
how long ago its next frame was due (``Pacer``; the skipped frames move its schedule on); for
a stream, how much more wall-clock time than stream time (packet dts) went by since it was
last on time (``StreamClock``). The frames skipped count as dropped and keep their frame numbers (a gap in
the indices, as for frames dropped for want of a slot); one info line per source at most every
``SKIP_LOG_INTERVAL_S`` says so. A live file resumed where it left off (moved to another
worker) reads the packets before that frame without decoding them, and skips on to the next
keyframe as a camera would (those frames count as dropped), where a file decodes every frame
before it (its frame numbers exact).

```
packets ──lag <= max──> decode ──> frames
   └─────lag > max───> skip (count) ... next keyframe with lag <= max ──> decode
```
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from fractions import Fraction

import av
import numpy as np
import structlog

from pipeline.config import SourceConfig, is_stream_url, redact_url
from pipeline.metrics import LinkStatus
from pipeline.records import EndOfStream, Frame
from pipeline.slots import SlotRing, copy_i420_planes
from pipeline.stage import SourceStage

__all__ = ["DecodeStage", "FrameTooLarge", "SourceError", "backoff_delay", "open_options", "redact_url"]

log = structlog.get_logger("decode")

# A live stream with this many undecodable packets in a row is reconnected.
MAX_BAD_PACKETS_IN_A_ROW = 50
DEFAULT_PERIOD_S = 0.04  # a frame period when the stream announces no rate (25 fps)
SKIP_LOG_INTERVAL_S = 5.0  # at most one "skipped to a keyframe" line per source this often
# A live source whose keyframes are further apart than this drops as much at each catch-up: a
# warning says so, once per source (a clip made with one keyframe drops a whole loop a skip).
LONG_KEYFRAME_INTERVAL_S = 4.0


class Dropped:
    """``make_frame``'s answer for a live frame dropped for want of a free slot."""


DROPPED = Dropped()


class Skipped:
    """``DecodeStage._pictures``' answer for a packet (a frame) of a live source read and not
    decoded, to catch up with real time: the frame is dropped, and keeps its frame number."""


SKIPPED = Skipped()


class Passed:
    """``DecodeStage._pictures``' answer for a packet (a frame) of a live file resumed at
    ``first_index`` (moved to another worker), read and not decoded: delivered before the
    move, it keeps its number and is neither sent nor counted."""


PASSED = Passed()


class SourceError(Exception):
    """A source failed; the message is one line, credentials redacted."""


class FrameTooLarge(SourceError):
    """A picture is larger than a frame slot: the source ends (no reconnection can help)."""


def open_options(source: SourceConfig) -> dict[str, str]:
    """FFmpeg options for opening the source: the RTSP transport.

    The timeouts are PyAV's (``av.open(timeout=(open, read))``, an interrupt callback that
    every blocking FFmpeg network call polls), not FFmpeg's socket ``timeout`` option: that
    one would fire first during the RTSP handshake and report it as invalid data.
    """
    if not source.uri.lower().startswith("rtsp"):
        return {}
    return {"rtsp_transport": source.rtsp_transport}


def backoff_delay(attempt: int, initial_s: float, max_s: float,
                  rng: Callable[[], float] = random.random) -> float:
    """Seconds to wait before reconnection attempt ``attempt`` (0-based).

    The nominal wait doubles per attempt from ``initial_s`` up to ``max_s``; the jitter
    ("equal jitter") makes it 50-100% of that, so many cameras behind one failed switch do
    not all reconnect at the same instant.
    """
    nominal = min(max_s, initial_s * 2 ** min(attempt, 30))
    return nominal / 2 + nominal / 2 * rng()


class Pacer:
    """Holds a source to ``fps`` frames per second of wall-clock time (``pace_fps``): frame
    k is due at start + k / fps, so a slow consumer does not shift the schedule (a late frame
    is released at once, as a camera would have sent it; a frame skipped to catch up keeps its
    place: ``skip``). No-op when ``fps`` is None."""

    def __init__(self, fps: float | None, stop: threading.Event) -> None:
        self.period = 1.0 / fps if fps else 0.0
        self.stop = stop
        self.next: float | None = None

    def wait(self) -> float | None:
        """Wait until the next frame is due; returns when it was due as a wall-clock
        ``time.time()`` (its capture time: a decoder running late shows as latency), or
        None when not pacing."""
        if not self.period:
            return None
        now = time.monotonic()
        self.next = now if self.next is None else self.next + self.period
        if self.next > now:
            self.stop.wait(self.next - now)
        return time.time() - (time.monotonic() - self.next)

    def lag_s(self) -> float:
        """Seconds the next frame is late: now less when it is due (negative: early; 0.0
        before the first frame)."""
        if self.next is None:
            return 0.0
        return time.monotonic() - (self.next + self.period)

    def skip(self) -> None:
        """The next frame was skipped: the one after it is due a period later (the source
        stays on its real-time schedule)."""
        if self.next is not None:
            self.next += self.period


class CatchUp:
    """Decides, packet by packet, which packets a live source skips to catch up with real
    time (module docstring): from a packet read more than ``max_lag_s`` late, every packet up
    to a keyframe read within it. A stream whose keyframes are not marked never skips: a
    session skips only once it has seen two keyframes, and a skip that meets no keyframe
    within twice the longest keyframe interval seen ends anyway (decoding on; no new skip
    starts before the next keyframe).

    Attributes:
        max_lag_s: the lag allowed, seconds.
        lag_at_start: the lag when the skip under way began, or None while decoding.
        skipped: packets skipped so far in the skip under way (or the last one).
        ended: (lag at its start, packets skipped, whether it gave up: ended at a packet
            that is not a keyframe) of a skip that ended at the latest packet, else None.
    """

    def __init__(self, max_lag_s: float) -> None:
        self.max_lag_s = max_lag_s
        self.lag_at_start: float | None = None
        self.skipped = 0
        self.ended: tuple[float, int, bool] | None = None
        self._since_key: int | None = None  # packets since the latest keyframe
        self._longest_gop = 0  # most packets from one keyframe to the next, 0: unknown yet

    @property
    def longest_gop(self) -> int:
        """The most packets seen from one keyframe to the next (the most a skip can take
        once it is under way), 0 before two keyframes were seen."""
        return self._longest_gop

    def skips(self, keyframe: bool, lag_s: float | None) -> bool:
        """Whether the next packet is skipped (read, not decoded).

        Args:
            keyframe: the packet holds a keyframe.
            lag_s: how far behind real time it is read, seconds, or None (unknown).
        """
        self.ended = None
        if keyframe:
            if self._since_key is not None:
                self._longest_gop = max(self._longest_gop, self._since_key + 1)
            self._since_key = 0
        elif self._since_key is not None:
            self._since_key += 1
        behind = lag_s is not None and lag_s > self.max_lag_s
        # Keyframes are marked and one is due: two seen, the last within twice their interval.
        coming = bool(self._longest_gop) and self._since_key <= 2 * self._longest_gop
        if self.lag_at_start is None:
            if not (behind and coming):
                return False
            self.lag_at_start, self.skipped = lag_s, 0
        elif (keyframe and not behind) or not coming:
            self.ended = (self.lag_at_start, self.skipped, not keyframe)
            self.lag_at_start = None
            return False
        self.skipped += 1
        return True


class StreamClock:
    """How far reading a live stream is behind the stream's own clock, in seconds: the
    wall-clock time elapsed since the stream was last on time less the stream time elapsed
    (packet timestamps) since then. "On time" is the packet that arrived earliest relative to
    its timestamp (the first one, or a later one when the first came late); a timestamp that
    goes back (a new clock) starts the count anew. One per session."""

    def __init__(self) -> None:
        self.offset: float | None = None  # least (arrival - stream time) so far, seconds
        self.last: float | None = None  # the latest stream time, seconds

    def lag_s(self, stream_time: float | None, now: float | None = None) -> float | None:
        """The lag at a packet of stream time ``stream_time`` (seconds; None: no timestamp,
        no answer) read at ``now`` (``time.monotonic()``; default: now)."""
        if stream_time is None:
            return None
        if self.last is not None and stream_time < self.last:
            self.offset = None  # the stream's clock went back: a new reference
        self.last = stream_time
        offset = (time.monotonic() if now is None else now) - stream_time
        if self.offset is None or offset < self.offset:
            self.offset = offset
        return offset - self.offset


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or ``taskset``'s
    limit, or the share a supervisor gave this pipeline), not every core of the machine."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def decoder_threads(sources: int, cores: int | None = None) -> int:
    """FFmpeg threads per CPU-decoded source: the cores less two (the pipeline's own threads),
    shared among the sources, at least one each (``cores``: default ``usable_cores()``)."""
    cores = cores or usable_cores()
    return max(1, round((cores - 2) / max(sources, 1)))


def probe_frame_count(source: SourceConfig) -> int | None:
    """Frames a file's container announces, or None (a stream, unknown, or unreadable: the
    reason is reported when the source is read)."""
    if is_stream_url(source.uri):
        return None
    try:
        with av.open(source.uri) as container:
            frames = container.streams.video[0].frames if container.streams.video else 0
        return frames or None
    except (av.FFmpegError, OSError):
        return None


def to_i420(frame: av.VideoFrame) -> av.VideoFrame:
    """The frame as yuv420p, same size (converted only when it is another format). An odd
    width or height stays: the caller crops the last column or row (``even_size``)."""
    return frame if frame.format.name == "yuv420p" else frame.reformat(format="yuv420p")


def even_size(width: int, height: int) -> tuple[int, int]:
    """The size a frame is used at: I420 needs even sizes, so an odd width or height loses its
    last column or row (a crop, not a resize: every pixel keeps its coordinates, so boxes are
    in the original picture's pixels; NVDEC frames are cropped the same way)."""
    return width & ~1, height & ~1


class DecodeStage(SourceStage):
    """Reads one source and yields its frames as I420 host arrays.

    With a ``SlotRing`` (how the pipeline runs it) each picture's planes are copied once,
    straight from the decoder's buffers, into a free slot of the ring, and the frame's image
    is a view of that slot; without one (tests), each frame gets an array of its own. A
    picture larger than a slot ends this source with an error naming both sizes; the other
    sources go on.

    Uses the first video stream of the container (audio and further video streams are
    ignored); a change of picture size mid-stream passes through (each frame carries its
    size). A source that cannot be read ends its stream with an error instead of raising,
    unless it reconnects (see the module docstring).

    Args:
        source: the source's configuration.
        ring: the slot ring frames are decoded into, or None (frames own their images).
        abort: the graph's abort event (stops a wait for a free slot).
        first_index: resume here (a decode worker restarted after a crash; at least
            ``source.start_frame``, where a moved source resumes): a file skips
            the frames before it (decoded, not sent); a live stream, and a looped file
            (played from its start), numbers its frames on from it.
        decoder_threads: FFmpeg decoding threads for this source, or 0 for FFmpeg's default
            (one per core): with many sources, the default would start cores x sources
            threads and starve the pipeline's own threads of CPU.

    Attributes:
        reconnects: reconnection attempts so far (successful or not).
        link: a live stream's connection (``LinkStatus``): changes as attempts fail and
            succeed; None for a file.
        on_link: called (on the source's thread) with each new ``link``, or None.
    """

    def __init__(self, source: SourceConfig, ring: SlotRing | None = None,
                 abort: threading.Event | None = None, first_index: int = 0,
                 decoder_threads: int = 0) -> None:
        super().__init__(source.name)
        self.source = source
        self.first_index = max(first_index, source.start_frame)  # a moved source resumes
        self.decoder_threads = decoder_threads
        self.ring = ring
        self.abort = abort or threading.Event()  # the graph's abort: stop waiting for a slot
        self.live = source.is_live
        self.display_uri = redact_url(source.uri)
        self.is_file = not is_stream_url(source.uri)
        self.loop = source.loop and self.is_file  # plays again from its start at its end
        self.reconnects = 0
        self.link: LinkStatus | None = LinkStatus() if self.live else None
        self.on_link: Callable[[LinkStatus], None] | None = None
        # the pts of the latest frame (``timestamp``): a moved live source's last record's
        self._last_pts: float | None = source.start_pts if self.live else None
        self._last_pts_at = time.monotonic() if self._last_pts is not None else 0.0  # its time
        self._shift: float | None = None  # this session: pts = picture time + shift
        self._session_pts: float | None = None  # this session's first pts, None before it
        self._pass_pts: float | None = None  # a looped file's next pass: its first pts
        self._cropped = False  # the odd-size warning was given
        # Catching up (module docstring): the lag allowed, None for never skipping.
        self.max_lag_s = (source.max_lag_ms / 1000.0
                          if self.live and source.max_lag_ms is not None else None)
        self._skip_logged_at = float("-inf")  # time.monotonic() of the last skip line
        self._skips_unlogged = self._skipped_unlogged = 0  # skips and frames since that line
        self._long_gop_told = False  # the warning of keyframes far apart was given
        self.thread_type = "SLICE" if self.live else "AUTO"
        self._container: av.container.InputContainer | None = None
        self._opened_at: float | None = None  # this session's open done (time.monotonic())
        self._first_decode_at: float | None = None  # its first packet handed to the decoder
        # A live file resumed (moved) jumps ahead as a camera would, in its first session:
        # the frames before ``first_index`` are read, not decoded (``_pictures``)
        self._jump_to = self.first_index if self.live and self.is_file and not self.loop else 0
        if self.is_file:
            self.expected_frames = probe_frame_count(source)

    def frames(self, stop_reading: threading.Event) -> Iterator[Frame | EndOfStream]:
        # a live source has its share of the ring kept from the files beside it (SlotRing)
        shares = self.live and self.ring is not None
        if shares:
            self.ring.add_live_source()
        try:
            yield from self._frames(stop_reading)
        finally:
            if shares:
                self.ring.add_live_source(-1)

    def _frames(self, stop_reading: threading.Event) -> Iterator[Frame | EndOfStream]:
        index = 0 if self.is_file and not self.loop else self.first_index
        attempt, lost_at = 0, None
        connected = False  # a session delivered a frame
        pace = Pacer(self.source.pace_fps, stop_reading)
        while True:
            first = index
            error, fatal = None, False
            self._shift = self._session_pts = None  # a new session: its clock starts anew
            session_started, delivered = time.monotonic(), False
            try:
                for picture, rate in self._pictures(stop_reading, pace):
                    if self.link is not None and self.link.state != "connected":
                        self._report(LinkStatus("connected", error=self.link.error))
                    if lost_at is not None:
                        log.info("source reconnected", source=self.name,
                                 down_s=round(time.monotonic() - lost_at, 2),
                                 reconnects=self.reconnects)
                        lost_at = None
                    if picture is PASSED:  # resumed: delivered before the move
                        index += 1
                        continue
                    if picture is SKIPPED:  # behind real time: dropped, its number kept
                        self.dropped += 1
                        self.skipped += 1
                        index += 1
                        continue
                    if index < self.first_index:  # resuming a file: already delivered
                        index += 1
                        continue
                    due = pace.wait()
                    frame = self.make_frame(picture, index, rate, stop_reading, due)
                    index += 1
                    if frame is DROPPED:
                        continue
                    if frame is None:  # stopped while waiting for a free slot
                        index -= 1
                        break
                    if not delivered:  # how long an open, a reconnect or a move takes
                        delivered = connected = True
                        log.info("source first frame", source=self.name, index=frame.index,
                                 since_open_s=round(time.monotonic() - session_started, 3),
                                 phases_s=self._first_frame_phases(session_started))
                    yield frame
            except Exception as failure:  # noqa: BLE001 - one source's failure ends or reconnects it
                error = describe(failure, self.source)
                fatal = isinstance(failure, FrameTooLarge)
            if stop_reading.is_set() or self.abort.is_set():
                error = None  # stopped on request: whatever was read is complete
                break
            if fatal or not self.source.should_reconnect:
                if error is not None and self.is_file and index > 0 and not fatal:
                    log.warning("file is corrupt: kept every decodable frame", source=self.name,
                                frames=index, reason=error)
                    error = None
                break
            attempt = 0 if index > first else attempt  # a session that worked resets it
            delay = backoff_delay(attempt, self.source.reconnect_initial_s,
                                  self.source.reconnect_max_s)
            attempt += 1
            lost_at = lost_at or time.monotonic()
            self.reconnects += 1
            self._report(LinkStatus("reconnecting", attempt, time.monotonic() + delay,
                                    error or "the stream ended"))
            # a source that never delivered a frame was not lost: it cannot connect (yet)
            log.warning("source lost, reconnecting" if connected else
                        "source not reached, retrying", source=self.name,
                        reason=error or "the stream ended", frames=index,
                        retry_in_s=round(delay, 2), reconnects=self.reconnects)
            if stop_reading.wait(delay):
                error = None
                break
        # A failure is logged once, as "source failed", by the supervisor (which its
        # EndOfStream reaches through the sink), not here too (a new user read it twice).
        log.info("source ended", source=self.name, frames=index, reconnects=self.reconnects,
                 **({"error": error} if error is not None else {}))
        yield EndOfStream(self.name, index, error=error)

    def _report(self, link: LinkStatus) -> None:
        """The connection changed: keep it, and tell ``on_link``."""
        self.link = link
        if self.on_link is not None:
            self.on_link(link)

    def timestamp(self, picture_time: float | None, rate: Fraction | None) -> float:
        """The pts of the next frame, in seconds (module docstring), from its decoder's
        presentation time (None when it has none) and the stream's nominal rate."""
        period = 1.0 / float(rate) if rate else DEFAULT_PERIOD_S
        now = time.monotonic()
        last = self._last_pts
        if not self.live and not self.loop:
            pts = picture_time if picture_time is not None else (
                0.0 if last is None else last + period)
        else:
            if self._session_pts is None:  # a session's (or a looped file's pass's) first frame
                if self._pass_pts is not None:
                    self._session_pts, self._pass_pts = self._pass_pts, None
                else:
                    self._session_pts = 0.0 if last is None else last + max(
                        period, now - self._last_pts_at)
                pts = self._session_pts
            elif picture_time is None or self._shift is None:
                pts = last + period if last is not None else 0.0
            else:
                pts = picture_time + self._shift
            if picture_time is not None and self._shift is None:
                self._shift = pts - picture_time
            if last is not None and pts <= last:  # a clock going back never shows
                pts = last + 1e-6
        self._last_pts, self._last_pts_at = pts, now
        return pts

    def open_container(self) -> av.container.InputContainer:
        """Open the source (a subclass adds options, e.g. a hardware decoder)."""
        source = self.source
        return av.open(source.uri, options=open_options(source),
                       timeout=(source.open_timeout_s, source.read_timeout_s))

    def make_frame(self, picture: av.VideoFrame, index: int, rate: Fraction | None,
                   stop_reading: threading.Event | None = None,
                   capture_time: float | None = None) -> Frame | None | Dropped:
        """The record of one decoded picture: an I420 host image, in a ring slot when there
        is a ring. None when stopped while waiting for a free slot (files); ``DROPPED`` when
        a live source found no free slot (the frame is dropped and counted).
        ``capture_time`` overrides "now" (a paced source: when the frame was due).

        Raises:
            SourceError: the picture is larger than a ring slot.
        """
        picture = to_i420(picture)
        width, height = even_size(picture.width, picture.height)
        if (width, height) != (picture.width, picture.height) and not self._cropped:
            self._cropped = True
            log.warning("odd frame size: the last column or row is left out (boxes keep the "
                        "original pixel coordinates)", source=self.name,
                        size=f"{picture.width}x{picture.height}", used=f"{width}x{height}")
        pts = self.timestamp(float(picture.time) if picture.time is not None else None, rate)
        captured = time.time() if capture_time is None else capture_time
        if self.ring is None:
            image = np.empty((height * 3 // 2, width), np.uint8)
            copy_i420_planes(picture.planes, width, height, image)
            return Frame(source=self.name, index=index, pts=pts, capture_time=captured,
                         width=width, height=height, rate=rate, image=image)
        if not self.ring.fits(width, height):
            raise FrameTooLarge(f"a {width}x{height} frame does not fit the frame slots of "
                              f"{self.ring.slot_bytes} bytes (sized for the largest file source, "
                              "at least 1920x1080)")
        if self.live:
            slot = self.ring.try_acquire()
            if slot is None:  # every slot in flight: drop this frame, keep up with the camera
                self.dropped += 1
                return DROPPED
        else:
            slot = self.ring.acquire(self.abort, *([stop_reading] if stop_reading else []))
            if slot is None:
                return None
        image = self.ring.image(slot, width, height)
        copy_i420_planes(picture.planes, width, height, image)
        return Frame(source=self.name, index=index, pts=pts, capture_time=captured,
                     width=width, height=height, rate=rate, image=image, slot=slot)

    def _first_frame_phases(self, session_started: float) -> dict[str, float]:
        """Where a session's first frame's time went (``source first frame``), in seconds:
        ``open`` (the container opened: a camera's connection), ``to_decode`` (from then to
        the first packet handed to the decoder: a live source's wait for a keyframe, a moved
        file's packets read past) and ``decode`` (from then to this frame: the decoder made,
        NVDEC's included, the pictures it holds back, a wait for a free frame slot)."""
        now = time.monotonic()
        opened = self._opened_at or now
        decoding = self._first_decode_at or now
        return {"open": round(opened - session_started, 3),
                "to_decode": round(decoding - opened, 3), "decode": round(now - decoding, 3)}

    def _pictures(self, stop_reading: threading.Event, pace: Pacer
                  ) -> Iterator[tuple[av.VideoFrame | Skipped | Passed, Fraction | None]]:
        """One session: open, yield (decoded picture, nominal rate) until the end, close.

        A live source more than ``max_lag_s`` behind (its ``pace`` schedule when paced, else
        the stream's clock) yields ``SKIPPED`` for each packet it reads without decoding, up
        to a keyframe at which it is back within the lag (module docstring). A live file
        resumed at ``first_index`` yields ``PASSED`` for the packets before it, then
        ``SKIPPED`` up to a keyframe (its first session only).
        """
        source = self.source
        started = time.monotonic()
        try:
            container = self.open_container()
        except Exception as error:  # noqa: BLE001 - reworded to one line below
            # The interrupt surfaces as ExitError, or as invalid data mid RTSP handshake.
            timed_out = time.monotonic() - started >= source.open_timeout_s
            reason = (f"no answer within {source.open_timeout_s} s (open_timeout_s)"
                      if timed_out or isinstance(error, av.ExitError) else error_text(error))
            raise SourceError(f"cannot open {self.display_uri}: {reason}") from None
        self._container = container
        waiting_since = self._opened_at = time.monotonic()  # (the demuxer last asked then)
        self._first_decode_at = None
        try:
            if not container.streams.video:
                raise SourceError(f"{self.display_uri} has no video stream")
            stream = container.streams.video[0]
            # Frame threading delays output by a frame per thread: files only.
            stream.thread_type = self.thread_type
            if self.decoder_threads:
                stream.codec_context.thread_count = self.decoder_threads
            rate = stream.average_rate or stream.guessed_rate
            rate = native = Fraction(rate) if rate else None
            log.info("source opened", source=self.name, uri=self.display_uri, live=self.live,
                     codec=stream.codec_context.name, size=f"{stream.width}x{stream.height}",
                     fps=float(rate) if rate else None, frames=self.expected_frames,
                     streams=len(container.streams), loop=self.loop)
            if self.source.pace_fps:  # delivered at this rate: its frames' times (the video)
                rate = Fraction(self.source.pace_fps).limit_denominator(1001)
            decoded = bad = bad_in_a_row = 0
            # A live file resumed: the frames before ``first_index`` are read, not decoded
            # (PASSED), then those up to the next keyframe (SKIPPED: lost in the move); a
            # file decodes them (its numbers exact). Once: not again at a reconnect.
            passing, self._jump_to = self._jump_to, 0
            catch_up = CatchUp(self.max_lag_s) if self.max_lag_s is not None else None
            clock = StreamClock() if catch_up is not None and not pace.period else None
            for passes in itertools.count():  # a file read once, or a looped file's passes
                read = 0  # frames of this pass read (decoded or skipped)
                for packet in container.demux(stream):
                    if stop_reading.is_set():
                        return
                    if passing and packet.size:
                        if read < passing or not packet.is_keyframe:
                            read += 1
                            yield (PASSED if read <= passing else SKIPPED), rate
                            continue
                        passing = 0
                    if catch_up is not None and packet.size:  # not the final (flush) packet
                        if catch_up.skips(packet.is_keyframe, self._lag_s(packet, pace, clock)):
                            pace.skip()
                            read += 1
                            yield SKIPPED, rate
                            continue
                        if catch_up.ended is not None:
                            self._log_skip(*catch_up.ended, gop_s=catch_up.longest_gop
                                           / float(rate) if rate else None)
                    try:
                        if self._first_decode_at is None:
                            self._first_decode_at = time.monotonic()
                        pictures = packet.decode()
                    except av.InvalidDataError as error:
                        bad, bad_in_a_row = bad + 1, bad_in_a_row + 1
                        if bad == 1:
                            log.warning("skipping undecodable packets", source=self.name,
                                        error=error_text(error))
                        if self.live and bad_in_a_row >= MAX_BAD_PACKETS_IN_A_ROW:
                            raise SourceError(f"{bad_in_a_row} undecodable packets in a "
                                              "row") from None
                        pictures = []
                    else:
                        bad_in_a_row = 0
                    for picture in pictures:
                        decoded += 1
                        read += 1
                        yield picture, rate
                    waiting_since = time.monotonic()
                if passes == 0:  # a looped file's later passes are the same: said once
                    if bad:
                        log.warning("skipped undecodable packets", source=self.name, packets=bad)
                    if self.expected_frames and decoded < self.expected_frames:
                        log.warning("file ended early (truncated or corrupt): kept every "
                                    "decodable frame", source=self.name, frames=decoded,
                                    expected=self.expected_frames)
                if not self.loop or stop_reading.is_set():
                    break
                if not read:  # nothing to loop: it would spin
                    raise SourceError(f"{self.display_uri}: no frame to loop (a pass of the "
                                      "file read none)")
                self._next_pass(container, native)
                log.debug("looped to the file's start", source=self.name, passes=passes + 1)
            if catch_up is not None and catch_up.lag_at_start is not None:  # ended skipping
                self._log_skip(catch_up.lag_at_start, catch_up.skipped,
                               gop_s=catch_up.longest_gop / float(rate) if rate else None)
        except av.FFmpegError as error:
            if isinstance(error, av.ExitError) or (
                    not self.is_file and time.monotonic() - waiting_since >= source.read_timeout_s):
                raise SourceError(f"no data from {self.display_uri} for "
                                  f"{source.read_timeout_s} s (read_timeout_s)") from None
            raise
        finally:
            self.close()

    def _next_pass(self, container: av.container.InputContainer, rate: Fraction | None) -> None:
        """A looped file reached its end: seek back to its start (which flushes the decoder)
        and go on with the next pass's pts one frame period of the file (``rate``, its own;
        None: ``DEFAULT_PERIOD_S``) after this pass's last pts: each pass's pts are the
        previous pass's later by the file's duration. The frame numbers and the pacing
        schedule simply go on."""
        container.seek(0)
        self._shift = self._session_pts = None
        if self._last_pts is not None:
            self._pass_pts = self._last_pts + (1.0 / float(rate) if rate else DEFAULT_PERIOD_S)

    @staticmethod
    def _lag_s(packet: av.Packet, pace: Pacer, clock: StreamClock | None) -> float | None:
        """How far behind real time ``packet`` is read, in seconds: the paced schedule's
        lag, else the stream clock's at its dts (its pts when it has none); None: unknown."""
        if pace.period:
            return pace.lag_s()
        if clock is None:
            return None
        stamp = packet.dts if packet.dts is not None else packet.pts
        if stamp is None or packet.time_base is None:
            return clock.lag_s(None)
        return clock.lag_s(float(stamp * packet.time_base))

    def _log_skip(self, lag_s: float, frames: int, gave_up: bool = False,
                  gop_s: float | None = None) -> None:
        """A skip of ``frames`` frames, begun ``lag_s`` behind, ended (``gave_up``: at a frame
        that is not a keyframe): say so, at most once per ``SKIP_LOG_INTERVAL_S`` (a line
        covers the skips since the last one). ``gop_s``: the longest keyframe interval seen,
        seconds (None: unknown); past ``LONG_KEYFRAME_INTERVAL_S`` a warning says, once, that
        each catch-up drops up to that much."""
        if gop_s is not None and gop_s > LONG_KEYFRAME_INTERVAL_S and not self._long_gop_told:
            self._long_gop_told = True
            log.warning("live source behind, and its keyframes are far apart: each catch-up "
                        "(max_lag_ms) drops up to keyframe_interval_s of video; a keyframe "
                        "interval (GOP) of 1-2 s loses less", source=self.name,
                        keyframe_interval_s=round(gop_s, 1), max_lag_ms=self.source.max_lag_ms)
        self._skips_unlogged += 1
        self._skipped_unlogged += frames
        now = time.monotonic()
        if now - self._skip_logged_at < SKIP_LOG_INTERVAL_S:
            return
        fields = {"source": self.name, "lag_ms": round(lag_s * 1000), "frames":
                  self._skipped_unlogged, "skips": self._skips_unlogged,
                  "max_lag_ms": self.source.max_lag_ms}
        if gave_up:
            log.warning("live source behind: skipped frames, but no keyframe came within twice "
                        "the longest keyframe interval seen: decoding on from a frame that is "
                        "not one", **fields)
        else:
            log.info("live source behind: skipped to a keyframe", **fields)
        self._skip_logged_at = now
        self._skips_unlogged = self._skipped_unlogged = 0

    def close(self) -> None:
        if self._container is not None:
            container, self._container = self._container, None
            container.close()


def describe(error: BaseException, source: SourceConfig) -> str:
    """A one-line reason for a source's failure, without credentials."""
    if isinstance(error, SourceError):
        return str(error)
    return f"reading {redact_url(source.uri)} failed: {error_text(error)}"


def error_text(error: BaseException) -> str:
    """A one-line description of a PyAV/OS error, without the URL (credentials) repeated."""
    message = getattr(error, "strerror", None) or str(error) or type(error).__name__
    return redact_url(" ".join(str(message).split()))
