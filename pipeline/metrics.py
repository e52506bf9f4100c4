"""Counters the graph keeps per stage and per source, and the end-of-run summary.

Both are fed once per item a stage handles (a batch counts once), never once per frame.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class StageMetrics:
    """What one stage (or sink) did.

    Attributes:
        name: the stage's name.
        frames: frames that went through the stage.
        calls: items handled (a batch counts once).
        work_s: seconds spent doing the stage's work (its hooks), excluding ``blocked_s``.
        blocked_s: seconds spent waiting on something else while handling items: for room in a
            full downstream queue, for a free buffer or slot, or for the GPU.
        started, ended: monotonic times the first item's handling began and the last ended.
    """

    name: str
    frames: int = 0
    calls: int = 0
    work_s: float = 0.0
    blocked_s: float = 0.0
    started: float | None = None
    ended: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, frames: int, work_s: float, blocked_s: float) -> None:
        """Count one handled item of ``frames`` frames.

        Args:
            frames: frames in the item (the batch size for a batch).
            work_s: seconds of work on it.
            blocked_s: seconds it waited for room downstream, a free buffer or the GPU.
        """
        now = time.monotonic()
        with self._lock:
            if self.started is None:
                self.started = now - work_s - blocked_s
            self.ended = now
            self.frames += frames
            self.calls += 1
            self.work_s += work_s
            self.blocked_s += blocked_s

    def summary(self) -> dict[str, float | int | str]:
        """Frames, throughput over the stage's active time, work per frame, work and blocked time."""
        with self._lock:
            frames, work_s, blocked_s = self.frames, self.work_s, self.blocked_s
            wall = (self.ended - self.started) if self.started is not None and self.ended else 0.0
        return {
            "stage": self.name,
            "frames": frames,
            "fps": round(frames / wall, 1) if wall > 0 else 0.0,
            "work_ms_per_frame": round(1000 * work_s / frames, 2) if frames else 0.0,
            "work_s": round(work_s, 3),
            "blocked_s": round(blocked_s, 3),
        }


# Latency percentiles are over the most recent frames, so a long run reports its present.
LATENCY_WINDOW = 10_000
STALE_AFTER_S = 10.0  # a live source with no frame this long is ``stalled``
# What a source can be, in the order ``source_state`` decides (module docstring of
# pipeline/app/http.py); ``removing`` and ``removed`` follow a DELETE.
SOURCE_STATES = ("starting", "running", "reconnecting", "stalled", "failed", "ended",
                 "removing", "removed")


@dataclass(frozen=True)
class LinkStatus:
    """Where a live source's connection stands, as its decoder last reported it (at once,
    also from a decode worker process, and before any first connection).

    Attributes:
        state: ``connecting`` (opening, no attempt failed yet), ``connected`` (the session
            delivers pictures) or ``reconnecting`` (the last attempt failed; waiting for the
            next, or making it).
        attempt: failed attempts in a row, from 1 at the first failure; 0 when connected.
        retry_at: ``time.monotonic()`` of the next attempt while reconnecting, else None.
        error: the last failure's one-line reason (credentials redacted); kept once the
            source is connected again, None before any failure.
    """

    state: str = "connecting"
    attempt: int = 0
    retry_at: float | None = None
    error: str | None = None

    def retry_in_s(self, now: float | None = None) -> float | None:
        """Seconds until the next attempt (0 while it is being made), or None."""
        if self.retry_at is None:
            return None
        return max(0.0, self.retry_at - (time.monotonic() if now is None else now))


@dataclass
class SourceMetrics:
    """Per-source counters.

    Attributes:
        frames_out: frames that reached the sinks.
        dropped: frames a live source discarded because the pipeline was behind.
        reconnects: reconnection attempts of a stream (successful or not), counted from the
            first failed attempt (before any first connection too).
        error: why the source ended early, or None.
        link: its connection as its decoder last reported it (live sources), or None.
        last_frame_at: ``time.monotonic()`` when its latest frame reached the sink, or None.
        latency_s: (read-only) capture-to-sink latencies of the last ``LATENCY_WINDOW`` frames,
            seconds, oldest first: a copy, ``(min(frames_out, LATENCY_WINDOW),) float64``.
    """

    name: str
    frames_out: int = 0
    dropped: int = 0
    reconnects: int = 0
    error: str | None = None
    link: LinkStatus | None = None
    last_frame_at: float | None = None
    # The latency window: a ring of LATENCY_WINDOW float64, written at _head, _filled valid.
    _ring: np.ndarray = field(default_factory=lambda: np.zeros(LATENCY_WINDOW, np.float64),
                              repr=False)
    _head: int = field(default=0, repr=False)
    _filled: int = field(default=0, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def frames_done(self, latencies_s: np.ndarray) -> None:
        """Count frames of this source that reached their sink: one call per batch slice.

        Args:
            latencies_s: ``(n,)`` float (any float dtype; stored as float64), each frame's
                capture-to-sink latency in seconds. ``n`` may be 0.
        """
        latencies = np.asarray(latencies_s, dtype=np.float64).reshape(-1)
        count = len(latencies)
        if count > LATENCY_WINDOW:
            latencies = latencies[-LATENCY_WINDOW:]
        kept = len(latencies)
        with self._lock:
            self.frames_out += count
            if count:
                self.last_frame_at = time.monotonic()
            if kept:
                first = min(kept, LATENCY_WINDOW - self._head)
                self._ring[self._head:self._head + first] = latencies[:first]
                self._ring[:kept - first] = latencies[first:]
                self._head = (self._head + kept) % LATENCY_WINDOW
                self._filled = min(LATENCY_WINDOW, self._filled + kept)

    @property
    def latency_s(self) -> np.ndarray:
        """The latency window, oldest first (see the class docstring)."""
        with self._lock:
            if self._filled < LATENCY_WINDOW:
                return self._ring[:self._filled].copy()
            return np.concatenate((self._ring[self._head:], self._ring[:self._head]))

    def latency_percentile(self, q: float) -> float | None:
        """The q-th percentile (0..100) of the recorded latencies, in milliseconds."""
        with self._lock:
            window = self._ring[:self._filled].copy()
        if not len(window):
            return None
        index = min(len(window) - 1, int(q / 100 * len(window)))
        return round(1000 * float(np.partition(window, index)[index]), 1)

    def summary(self, elapsed_s: float) -> dict[str, float | int | str | None]:
        """Frames, rate over ``elapsed_s``, drops, reconnections, latency p50/p99 (ms), error;
        and ``last_error`` for a live source that was not connected when it ended (its last
        attempt's reason: a camera that never connected once ended with ``error=None``
        alone)."""
        summary: dict[str, float | int | str | None] = {
            "source": self.name,
            "frames": self.frames_out,
            "fps": round(self.frames_out / elapsed_s, 1) if elapsed_s > 0 else 0.0,
            "dropped": self.dropped,
            "reconnects": self.reconnects,
            "latency_p50_ms": self.latency_percentile(50),
            "latency_p99_ms": self.latency_percentile(99),
            "error": self.error,
        }
        link = self.link
        if self.error is None and link is not None and link.state != "connected" and link.error:
            summary["last_error"] = link.error
        return summary


def source_state(metrics: SourceMetrics, live: bool, done: bool, removing: bool,
                 shown_since: float, stale_after_s: float = STALE_AFTER_S,
                 now: float | None = None) -> str:
    """One of ``SOURCE_STATES`` (but ``removed``) for a source of the graph.

    Args:
        metrics: its counters (``error``, ``link``, ``last_frame_at``).
        live: it is a live camera (only a camera stalls).
        done: its outputs are final (its sink ended).
        removing: it was asked to stop (``DELETE``).
        shown_since: ``time.monotonic()`` from which a camera without any frame counts as
            stalled (when it was added, or the view started).
        stale_after_s: a camera with no frame this long is ``stalled``.
    """
    now = time.monotonic() if now is None else now
    if metrics.error:
        return "failed"
    if removing:
        return "removing"
    if done:
        return "ended"
    link = metrics.link
    if link is not None and link.state == "reconnecting":
        return "reconnecting"
    last = metrics.last_frame_at
    if live and now - (shown_since if last is None else last) > stale_after_s:
        return "stalled"
    return "starting" if last is None else "running"
