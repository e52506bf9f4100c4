"""A Prometheus exporter for a running graph (``runtime.metrics_port``).

Serves ``http://ADDR:PORT/metrics`` from a daemon thread (prometheus-client's server). Counters
and gauges are read from the graph when Prometheus scrapes, so the hot path pays nothing for
them; only the latency histogram is fed per frame, by :meth:`PrometheusExporter.observe_frame`
used as (or chained into) the graph's ``on_frame_done`` hook, so it counts every frame.

=========================================  =======  =========================================
metric                                     type     labels, meaning
=========================================  =======  =========================================
pipeline_stage_frames_total                counter  stage: frames that went through it
pipeline_stage_calls_total                 counter  stage: items handled (a batch counts once)
pipeline_stage_busy_seconds_total          counter  stage: time inside its hooks
pipeline_source_frames_total               counter  source: frames that reached its sink
pipeline_source_fps                        gauge    source: frames/s over the last ~5 s
pipeline_source_dropped_frames_total       counter  source: frames dropped (live, behind)
pipeline_source_reconnects_total           counter  source: reconnection attempts
pipeline_queue_depth                       gauge    queue (the stage or sink it feeds): items
pipeline_frame_latency_seconds             histo    source: capture to sink
=========================================  =======  =========================================
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pipeline.records import Frame

# Capture-to-sink latency: a few ms (GPU, batch 1) up to seconds (a backlog of file frames).
LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
FPS_WINDOW_S = 5.0


class GraphCollector(Collector):
    """Reads a graph's counters at scrape time (see the module docstring for the metrics).

    Args:
        graph: a ``pipeline.graph.Graph``; read through ``stage_metrics``, ``source_metrics``,
            ``refresh_source_metrics()`` and ``queue_depths()``.
    """

    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self._history: dict[str, deque[tuple[float, int]]] = {}
        self._started = time.monotonic()
        self._lock = threading.Lock()  # two scrapes at once must not interleave the history

    def collect(self) -> Iterator[Metric]:
        graph = self.graph
        frames = CounterMetricFamily("pipeline_stage_frames", "Frames through the stage.",
                                     labels=["stage"])
        calls = CounterMetricFamily("pipeline_stage_calls", "Items handled (a batch counts once).",
                                    labels=["stage"])
        busy = CounterMetricFamily("pipeline_stage_busy_seconds", "Seconds inside the stage.",
                                   labels=["stage"])
        for stage in graph.stage_metrics.values():
            frames.add_metric([stage.name], stage.frames)
            calls.add_metric([stage.name], stage.calls)
            busy.add_metric([stage.name], stage.busy_s)
        yield from (frames, calls, busy)

        graph.refresh_source_metrics()
        done = CounterMetricFamily("pipeline_source_frames", "Frames that reached the sink.",
                                   labels=["source"])
        fps = GaugeMetricFamily("pipeline_source_fps",
                                f"Frames/s reaching the sink, over the last ~{FPS_WINDOW_S:g} s.",
                                labels=["source"])
        dropped = CounterMetricFamily("pipeline_source_dropped_frames",
                                      "Frames a live source dropped: the pipeline was behind.",
                                      labels=["source"])
        reconnects = CounterMetricFamily("pipeline_source_reconnects",
                                         "Reconnection attempts of a stream.", labels=["source"])
        now = time.monotonic()
        for source in graph.source_metrics.values():
            done.add_metric([source.name], source.frames_out)
            fps.add_metric([source.name], self._rate(source.name, source.frames_out, now))
            dropped.add_metric([source.name], source.dropped)
            reconnects.add_metric([source.name], source.reconnects)
        yield from (done, fps, dropped, reconnects)

        depth = GaugeMetricFamily("pipeline_queue_depth", "Items waiting in front of a stage.",
                                  labels=["queue"])
        for name, items in graph.queue_depths().items():
            depth.add_metric([name], items)
        yield depth

    def _rate(self, name: str, frames: int, now: float) -> float:
        """Frames/s since the oldest sample still at least ``FPS_WINDOW_S`` old."""
        with self._lock:
            history = self._history.setdefault(name, deque([(self._started, 0)]))
            history.append((now, frames))
            while len(history) > 2 and now - history[1][0] >= FPS_WINDOW_S:
                history.popleft()
            then, before = history[0]
        return (frames - before) / (now - then) if now > then else 0.0


class PrometheusExporter:
    """Serves a graph's metrics over HTTP for Prometheus.

    Usage::

        exporter = PrometheusExporter(config.runtime.metrics_port)
        graph = build_graph(config, on_frame_done=exporter.observe_frame)
        exporter.start(graph)
        try:
            graph.run()
        finally:
            exporter.stop()

    Args:
        port: TCP port; 0 picks a free one (``start`` returns it).
        addr: address to bind; all interfaces by default, as Prometheus scrapes remotely.
    """

    def __init__(self, port: int, addr: str = "0.0.0.0") -> None:
        self.port, self.addr = port, addr
        self.registry = CollectorRegistry()
        self.latency = Histogram("pipeline_frame_latency_seconds",
                                 "Capture-to-sink latency of each frame.", ["source"],
                                 buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self._server: Any = None

    def observe_frame(self, frame: Frame) -> None:
        """Record a frame that reached its sink (the graph's ``on_frame_done`` hook)."""
        self.latency.labels(frame.source).observe(time.time() - frame.capture_time)

    def start(self, graph: Any) -> int:
        """Start serving ``graph``'s metrics; returns the port bound.

        Raises:
            OSError: the port is taken or cannot be bound (the message names it).
        """
        self.registry.register(GraphCollector(graph))
        try:
            self._server, _ = start_http_server(self.port, self.addr, registry=self.registry)
        except OSError as error:
            raise OSError(error.errno, f"runtime.metrics_port: cannot serve metrics on "
                                       f"{self.addr}:{self.port}: {error.strerror}") from None
        return int(self._server.server_port)

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        if self._server is not None:
            server, self._server = self._server, None
            server.shutdown()
            server.server_close()
