"""A pipeline graph's Prometheus metrics, and the HTTP serving of ``runtime.metrics_port``.

How a run serves them (every run, one pipeline or many, goes through the supervisor)::

    pipeline host (pipeline.app.host)                    supervisor (pipeline.app.supervisor)
    GraphCollector(graph, LatencyHistogram)
      snapshot(..., {"pipeline": "pipeline0"})  ──HostReport.metrics──>  ClusterExporter
      (pipeline.app.cluster_metrics, every 1 s)                          http://ADDR:PORT/metrics

Each host reads its graph with :class:`GraphCollector` and sends the families as plain
records; the supervisor's ``ClusterExporter`` (``pipeline.app.cluster_metrics``) serves the
latest of every host on one port, each sample labelled with its ``pipeline``. Counters and
gauges are read from the graph when a snapshot is taken, so the hot path pays nothing for
them; only the latency histogram is fed, once per batch slice of one source, by the host's
``on_batch_done`` (:meth:`LatencyHistogram.observe`: numpy bucketing, one lock operation per
call).

``ADDR`` is ``runtime.metrics_host``, 127.0.0.1 unless configured; a bind that is not
loopback needs ``runtime.metrics_token`` (the HTTP API's rule, :func:`check_bind`), and then
every request must carry ``Authorization: Bearer TOKEN`` (Prometheus: ``authorization:
{credentials: TOKEN}`` in the scrape config), else it is answered 401 (:func:`serve`).

=========================================  =======  =========================================
metric                                     type     labels, meaning
=========================================  =======  =========================================
pipeline_stage_frames_total                counter  stage: frames that went through it
pipeline_stage_calls_total                 counter  stage: items handled (a batch counts once)
pipeline_stage_work_seconds_total          counter  stage: time doing its work
pipeline_stage_blocked_seconds_total       counter  stage: time waiting on a full downstream
                                                    queue, a free buffer or the GPU
pipeline_source_frames_total               counter  source: frames that reached its sink
pipeline_source_fps                        gauge    source: frames/s over the last ~5 s
pipeline_source_dropped_frames_total       counter  source: frames dropped (live, behind)
pipeline_source_reconnects_total           counter  source: reconnection attempts (from the
                                                    first failed one, before any first
                                                    connection too)
pipeline_source_state                      gauge    source, state: 1 for the state it is in
                                                    (``pipeline.metrics.SOURCE_STATES``), 0
                                                    for the others
pipeline_source_reconnect_attempt          gauge    source: failed attempts in a row while
                                                    reconnecting, 0 otherwise
pipeline_source_last_error_info            gauge    source, error: 1, its latest error (a
                                                    failed attempt's or why it failed), for
                                                    sources that had one
pipeline_queue_depth                       gauge    queue (the stage or sink it feeds): items
pipeline_frame_latency_seconds             histo    source: capture to sink (``_bucket`` with
                                                    ``le``, ``_sum``, ``_count``)
pipeline_line_crossings_total              counter  source, line, class, direction (in, out):
                                                    crossings of a counting line
pipeline_zone_events_total                 counter  source, zone, class, kind (enter, exit):
                                                    entries into and exits from a zone
pipeline_zone_objects                      gauge    source, zone, class: objects inside now
pipeline_event_media_total                 counter  result: snapshot, clip (written), dropped
                                                    (queue full), failed (output.event_media)
pipeline_webhook_delivered_total           counter  url: events an ``output.webhooks``
                                                    endpoint answered with a 2xx
pipeline_webhook_failed_total              counter  url: attempts that got no 2xx and were
                                                    sent again (no answer, 5xx, 408, 429)
pipeline_webhook_rejected_total            counter  url: events the endpoint refused (3xx,
                                                    other 4xx), not sent again
pipeline_webhook_dropped_total             counter  url: events dropped unsent (its queue
                                                    was full: the oldest)
pipeline_webhook_waiting                   gauge    url: events not delivered yet
pipeline_webhook_failing                   gauge    url: 1 while its last attempt got no 2xx
=========================================  =======  =========================================

The analytics metrics are the counts of the graph's ``AnalyticsStage`` (a running sum of the
events it emitted, the same numbers as the events file and MQTT); a zone's or line's
configured classes appear from the start, with zeros, other classes from their first event.
The webhook metrics are the counters of ``pipeline.app.webhooks`` (URLs with credentials
hidden), one series per endpoint from the start.
"""

from __future__ import annotations

import hmac
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import make_server

import numpy as np
from prometheus_client import make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pipeline.app.webhooks import WebhookPublisher, WebhookStats
from pipeline.config import is_loopback
from pipeline.metrics import SOURCE_STATES
from stages.analytics import AnalyticsStage
from stages.event_media import EventMediaStats

# Capture-to-sink latency: a few ms (GPU, batch 1) up to seconds (a backlog of file frames).
LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
FPS_WINDOW_S = 5.0
_BOUNDS = np.asarray(LATENCY_BUCKETS_S, dtype=np.float64)
_LE = [floatToGoString(b) for b in LATENCY_BUCKETS_S] + ["+Inf"]


class LatencyHistogram:
    """Capture-to-sink latency per source, fed in bulk (prometheus_client's ``Histogram`` is not).

    Keeps, per source, a count per bucket of ``LATENCY_BUCKETS_S`` plus one for ``+Inf`` (not
    cumulative) and the sum of the latencies. A latency equal to a bound counts in that bound's
    bucket (Prometheus's ``le``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, np.ndarray] = {}  # source -> (len(LATENCY_BUCKETS_S)+1,) int64
        self._sums: dict[str, float] = {}

    def observe(self, source: str, latencies_s: np.ndarray) -> None:
        """Add the latencies of frames of one source.

        Args:
            source: the source's name.
            latencies_s: ``(n,)`` float (any float dtype, compared as float64), seconds; ``n``
                may be 0.
        """
        latencies = np.asarray(latencies_s, dtype=np.float64).reshape(-1)
        if not len(latencies):
            return
        # side="left": the first bound >= the latency, i.e. the smallest `le` it falls under.
        counts = np.bincount(np.searchsorted(_BOUNDS, latencies, side="left"),
                             minlength=len(_BOUNDS) + 1)
        total = float(latencies.sum())
        with self._lock:
            if source in self._counts:
                self._counts[source] += counts
                self._sums[source] += total
            else:
                self._counts[source] = counts.astype(np.int64)
                self._sums[source] = total

    def family(self, sources: Iterable[str] = ()) -> HistogramMetricFamily:
        """The histogram as a metric family: every observed source, and ``sources`` (zeros)."""
        with self._lock:
            snapshot = {name: (counts.copy(), self._sums[name]) for name, counts in self._counts.items()}
        for name in sources:
            snapshot.setdefault(name, (np.zeros(len(_BOUNDS) + 1, np.int64), 0.0))
        family = HistogramMetricFamily("pipeline_frame_latency_seconds",
                                       "Capture-to-sink latency of each frame.", labels=["source"])
        for name, (counts, total) in snapshot.items():
            cumulative = np.cumsum(counts)
            family.add_metric([name], list(zip(_LE, (int(c) for c in cumulative))), total)
        return family


class GraphCollector(Collector):
    """Reads a graph's counters at scrape time (see the module docstring for the metrics).

    Args:
        graph: a ``pipeline.graph.Graph``; read through ``stage_metrics`` (name ->
            ``StageMetrics``), ``source_metrics`` (name -> ``SourceMetrics``),
            ``refresh_source_metrics()``, ``queue_depths()`` (queue name -> items) and, when
            it has them, the ``AnalyticsStage`` of its ``chain`` (``counts()``).
        latency: the latency histogram to expose with the graph's counters, or None; every
            source of the graph appears in it, with zeros until its first frame.
    """

    def __init__(self, graph: Any, latency: LatencyHistogram | None = None) -> None:
        self.graph = graph
        self.latency = latency
        self._history: dict[str, deque[tuple[float, int]]] = {}
        self._started = time.monotonic()
        self._seen: dict[str, float] = {}  # source -> first scrape it was in (stalled from)
        self._lock = threading.Lock()  # two scrapes at once must not interleave the history

    def collect(self) -> Iterator[Metric]:
        graph = self.graph
        frames = CounterMetricFamily("pipeline_stage_frames", "Frames through the stage.",
                                     labels=["stage"])
        calls = CounterMetricFamily("pipeline_stage_calls", "Items handled (a batch counts once).",
                                    labels=["stage"])
        work = CounterMetricFamily("pipeline_stage_work_seconds", "Seconds doing the stage's work.",
                                   labels=["stage"])
        blocked = CounterMetricFamily("pipeline_stage_blocked_seconds",
                                      "Seconds the stage waited on a full downstream queue, "
                                      "a free buffer or the GPU.", labels=["stage"])
        for stage in graph.stage_metrics.values():
            frames.add_metric([stage.name], stage.frames)
            calls.add_metric([stage.name], stage.calls)
            work.add_metric([stage.name], stage.work_s)
            blocked.add_metric([stage.name], stage.blocked_s)
        yield from (frames, calls, work, blocked)

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
        states = GaugeMetricFamily("pipeline_source_state",
                                   "1 for the state the source is in, 0 for the others.",
                                   labels=["source", "state"])
        attempt = GaugeMetricFamily("pipeline_source_reconnect_attempt",
                                    "Failed connection attempts in a row while reconnecting.",
                                    labels=["source"])
        errors = GaugeMetricFamily("pipeline_source_last_error_info",
                                   "The source's latest error (a failed attempt's, or why it "
                                   "failed).", labels=["source", "error"])
        now = time.monotonic()
        for source in graph.source_metrics.values():
            name = source.name
            done.add_metric([name], source.frames_out)
            fps.add_metric([name], self._rate(name, source.frames_out, now))
            dropped.add_metric([name], source.dropped)
            reconnects.add_metric([name], source.reconnects)
            if hasattr(graph, "source_state"):
                state = graph.source_state(name, self._seen.setdefault(name, now))
                for known in SOURCE_STATES:
                    states.add_metric([name, known], 1.0 if known == state else 0.0)
            link = source.link
            reconnecting = link is not None and link.state == "reconnecting"
            attempt.add_metric([name], link.attempt if reconnecting else 0)
            error = source.error or (link.error if link is not None else None)
            if error:
                errors.add_metric([name, error[:200]], 1.0)
        yield from (done, fps, dropped, reconnects, states, attempt, errors)

        depth = GaugeMetricFamily("pipeline_queue_depth", "Items waiting in front of a stage.",
                                  labels=["queue"])
        for name, items in graph.queue_depths().items():
            depth.add_metric([name], items)
        yield depth

        if self.latency is not None:
            yield self.latency.family(list(graph.source_metrics))

        webhooks: list[WebhookStats] = []
        for stage in getattr(graph, "chain", ()):
            if isinstance(stage, AnalyticsStage):
                yield from analytics_families(stage.counts())
                webhooks += [stats for publisher in stage.publishers
                             if isinstance(publisher, WebhookPublisher)
                             for stats in publisher.stats()]
                if stage.media is not None:
                    yield event_media_family(stage.media.stats())
        if webhooks:
            yield from webhook_families(webhooks)


    def _rate(self, name: str, frames: int, now: float) -> float:
        """Frames/s since the oldest sample still at least ``FPS_WINDOW_S`` old."""
        with self._lock:
            history = self._history.setdefault(name, deque([(self._started, 0)]))
            history.append((now, frames))
            while len(history) > 2 and now - history[1][0] >= FPS_WINDOW_S:
                history.popleft()
            then, before = history[0]
        return (frames - before) / (now - then) if now > then else 0.0


def analytics_families(counts: dict[str, dict[str, Any]]) -> list[Metric]:
    """The analytics metrics (module docstring) of ``counts``: source name -> its counts as
    ``stages.analytics.AnalyticsCounts.to_json`` gives them."""
    crossings = CounterMetricFamily("pipeline_line_crossings",
                                    "Objects that crossed a counting line, by direction.",
                                    labels=["source", "line", "class", "direction"])
    zone_events = CounterMetricFamily("pipeline_zone_events",
                                      "Objects that entered (enter) or left (exit) a zone.",
                                      labels=["source", "zone", "class", "kind"])
    inside = GaugeMetricFamily("pipeline_zone_objects", "Objects inside a zone now.",
                               labels=["source", "zone", "class"])
    for source, source_counts in counts.items():
        for line, directions in source_counts["lines"].items():
            for direction in ("in", "out"):
                for cls, value in directions[direction].items():
                    crossings.add_metric([source, line, cls, direction], value)
        for zone, kinds in source_counts["zones"].items():
            for kind, key in (("enter", "entered"), ("exit", "exited")):
                for cls, value in kinds[key].items():
                    zone_events.add_metric([source, zone, cls, kind], value)
            for cls, value in kinds["inside"].items():
                inside.add_metric([source, zone, cls], value)
    return [crossings, zone_events, inside]


def event_media_family(stats: EventMediaStats) -> Metric:
    """``pipeline_event_media_total{result}``: snapshots and clips written, events whose media
    was dropped (queue full), media that failed (``stages.event_media``)."""
    family = CounterMetricFamily("pipeline_event_media", "Event media by result: snapshot "
                                 "and clip written, dropped (queue full), failed.",
                                 labels=["result"])
    for result, count in (("snapshot", stats.snapshots), ("clip", stats.clips),
                          ("dropped", stats.dropped), ("failed", stats.failed)):
        family.add_metric([result], count)
    return family


def webhook_families(stats: list[WebhookStats]) -> list[Metric]:
    """The webhook metrics (module docstring) of every endpoint's ``stats``."""
    counters = {name: CounterMetricFamily(f"pipeline_webhook_{name}", doc, labels=["url"])
                for name, doc in (
                    ("delivered", "Events the webhook endpoint answered with a 2xx."),
                    ("failed", "Attempts that got no 2xx and were sent again."),
                    ("rejected", "Events the endpoint refused (3xx, other 4xx): not sent again."),
                    ("dropped", "Events dropped unsent: the endpoint's queue was full."))}
    waiting = GaugeMetricFamily("pipeline_webhook_waiting", "Events not delivered yet.",
                                labels=["url"])
    failing = GaugeMetricFamily("pipeline_webhook_failing",
                                "1 while the endpoint's last attempt got no 2xx.", labels=["url"])
    for endpoint in stats:
        for name, family in counters.items():
            family.add_metric([endpoint.url], getattr(endpoint, name))
        waiting.add_metric([endpoint.url], endpoint.waiting)
        failing.add_metric([endpoint.url], 0.0 if endpoint.failing_for_s is None else 1.0)
    return [*counters.values(), waiting, failing]


def check_bind(addr: str, token: str | None) -> None:
    """Raise ValueError (one line naming the key) unless metrics may be served on ``addr``:
    a token whenever it is not loopback, as ``runtime.http`` (``HttpConfig.check``)."""
    if token is not None and not token.strip():
        raise ValueError("runtime.metrics_token: expected a non-empty token (an unset "
                         "variable?), got ''")
    if token is None and not is_loopback(addr):
        raise ValueError(f"runtime.metrics_token: required when runtime.metrics_host is not "
                         f"a loopback address (got {addr!r}); use metrics_token: ${{VAR}}")


def bearer_gate(app: Callable[..., Any], token: str) -> Callable[..., Any]:
    """The WSGI ``app`` behind a check of ``Authorization: Bearer TOKEN`` (401 without)."""
    expected = token.encode()

    def gated(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        scheme, _, value = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), expected):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                            ("WWW-Authenticate", 'Bearer realm="streamdet"')])
        return [b"missing or wrong token\n"]

    return gated


def serve(registry: Any, port: int, addr: str, token: str | None = None) -> Any:
    """Serve ``registry`` at http://ADDR:PORT/metrics from a daemon thread, behind
    ``bearer_gate`` when ``token`` is set; returns the server (``server_port``: the port
    bound).

    Raises:
        OSError: the port is taken or cannot be bound (the message names it).
    """
    app = make_wsgi_app(registry)
    if token is not None:
        app = bearer_gate(app, token)

    class Server(ThreadingWSGIServer):
        """prometheus-client's threading server, for this address's family."""

    Server.address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        server = make_server(addr, port, app, Server, handler_class=_SilentHandler)
    except OSError as error:
        raise OSError(error.errno, f"runtime.metrics_port: cannot serve metrics on "
                                   f"{addr}:{port}: {error.strerror}") from None
    threading.Thread(target=server.serve_forever, name="metrics:server", daemon=True).start()
    return server


def stop_serving(server: Any) -> None:
    """Stop a server ``serve`` returned (None: nothing to do)."""
    if server is not None:
        server.shutdown()
        server.server_close()
