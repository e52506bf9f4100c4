"""Counters the graph keeps per stage and per source, and the end-of-run summary."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field


@dataclass
class StageMetrics:
    """What one stage (or source) did.

    Attributes:
        name: the stage's name.
        frames: frames that went through the stage.
        calls: items handled (a batch counts once).
        busy_s: seconds spent inside the stage's hooks (excludes waiting on queues).
        started, ended: monotonic times of the first and last item.
    """

    name: str
    frames: int = 0
    calls: int = 0
    busy_s: float = 0.0
    started: float | None = None
    ended: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, frames: int, busy_s: float) -> None:
        """Count one handled item of ``frames`` frames that took ``busy_s`` seconds."""
        now = time.monotonic()
        with self._lock:
            if self.started is None:
                self.started = now - busy_s
            self.ended = now
            self.frames += frames
            self.calls += 1
            self.busy_s += busy_s

    def summary(self) -> dict[str, float | int | str]:
        """Frames, throughput over the stage's active time, and busy milliseconds per frame."""
        wall = (self.ended - self.started) if self.started is not None and self.ended else 0.0
        return {
            "stage": self.name,
            "frames": self.frames,
            "fps": round(self.frames / wall, 1) if wall > 0 else 0.0,
            "busy_ms_per_frame": round(1000 * self.busy_s / self.frames, 2) if self.frames else 0.0,
            "busy_s": round(self.busy_s, 3),
        }


# Latency percentiles are over the most recent frames, so a long run reports its present.
LATENCY_WINDOW = 10_000


@dataclass
class SourceMetrics:
    """Per-source counters.

    Attributes:
        frames_out: frames that reached the sinks.
        dropped: frames a live source discarded because the pipeline was behind.
        reconnects: reconnection attempts of a stream (successful or not).
        latency_s: capture-to-sink latencies of the last ``LATENCY_WINDOW`` frames, seconds.
        error: why the source ended early, or None.
    """

    name: str
    frames_out: int = 0
    dropped: int = 0
    reconnects: int = 0
    latency_s: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    error: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def frame_done(self, latency_s: float) -> None:
        """Count a frame that reached its sink ``latency_s`` seconds after its capture."""
        with self._lock:
            self.frames_out += 1
            self.latency_s.append(latency_s)

    def latency_percentile(self, q: float) -> float | None:
        """The q-th percentile (0..100) of the recorded latencies, in milliseconds."""
        with self._lock:
            ordered = sorted(self.latency_s)
        if not ordered:
            return None
        return round(1000 * ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))], 1)

    def summary(self, elapsed_s: float) -> dict[str, float | int | str | None]:
        """Frames, rate over ``elapsed_s``, drops, reconnections, latency p50/p99 (ms), error."""
        return {
            "source": self.name,
            "frames": self.frames_out,
            "fps": round(self.frames_out / elapsed_s, 1) if elapsed_s > 0 else 0.0,
            "dropped": self.dropped,
            "reconnects": self.reconnects,
            "latency_p50_ms": self.latency_percentile(50),
            "latency_p99_ms": self.latency_percentile(99),
            "error": self.error,
        }
