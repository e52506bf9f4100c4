"""The live view's host side: what one host's graph shows, sampled beside it and sent to the
control process as a ``ViewReport`` (``pipeline.app.board`` merges every host's).

```
host process (one graph)                               control process
  graph counters, PreviewHub ──> HostView                SourceBoard <── ViewReport of each host
    sampling thread (SAMPLE_S): rates, full queues          (update)      │
    report(wanted), ~10 a second, by the host: ──ViewReport──>            ├─> HTTP API + page
      every shown source's JSON, the health reasons,                     └─> wanted(host): the
      a JPEG of each WANTED source, only when newer      <──wanted──          sources watched now
```

Pictures travel as small JPEGs at ``preview_fps``, never as frames: a wanted source's sink
keeps one picture at most ``preview_fps`` times a second (``PreviewHub``), and ``report``
encodes it (OpenCV, in the host's thread that calls it) only when it is newer than the one
last sent. An unwanted source costs no copy and no encode.

**States** (``pipeline.metrics.source_state``, documented for the API in
``pipeline.app.http``): ``starting`` (no frame yet, no attempt failed), ``running``,
``reconnecting`` (an attempt to connect failed, before any first connection too, and the next
is due, or its decode worker is being restarted), ``stalled`` (live and connected, but no
frame for ``stale_after_s``, or none since it was shown that long ago), ``failed`` (it ended
with an error), ``ended`` (its outputs are final), ``removing`` (``mark_removing``, outputs
being finalised: the source leaves the report once they are, ``forget``). Decode worker
processes report each attempt as it happens.

**Health reasons** (``SourceMonitor.reasons``): a source failed, or a camera is reconnecting
or stalled (each named, with why: the attempt, the next try and the last error), or a queue
was full in every sample for ``FULL_FOR_S`` while the graph has a live source (the pipeline
is not keeping up: a live source's frames are being dropped; a queue full for an instant is
a burst, and with files only a full queue is back-pressure, by design), or a webhook
endpoint's last attempt got no 2xx (``WebhookPublisher.reasons``: for how long, why, the
events waiting and dropped), or event media were dropped (their queue full) or failed in the
last ``MEDIA_LOSS_WINDOW_S`` (``MediaLosses``: how many of each). Until the graph has opened
its stages (``graph.ready``: the model warming up) a report says ``ready: False`` and gives
no reasons.

A pipeline host (``pipeline.app.host``) sends its view's reports to the supervisor, which
feeds the board (``pipeline.app.board``); tests join the two in one process with
``tests.support.live_view.local_board``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from pipeline.app.board import ViewReport
from pipeline.app.preview import PreviewHub
from pipeline.app.webhooks import WebhookPublisher
from pipeline.config import PipelineConfig, SourceConfig, redact_url
from pipeline.metrics import STALE_AFTER_S, source_state
from stages.analytics import AnalyticsStage

if TYPE_CHECKING:
    from stages.event_media import EventMedia

log = structlog.get_logger("view")

SAMPLE_S = 0.5  # the sampling thread's period
FPS_WINDOW_S = 5.0
FULL_FOR_S = 2.0  # a queue full in every sample this long is a health reason
MEDIA_LOSS_WINDOW_S = 60.0  # event media dropped or failed this recently is a health reason
CLOSE_TIMEOUT_S = 5.0


@dataclass
class _Sampled:
    """The monitor's view of one source: (monotonic time, frames out) samples."""

    history: deque[tuple[float, int]] = field(default_factory=deque)


class MediaLosses:
    """The event media dropped (their queue full) and failed in the last
    ``MEDIA_LOSS_WINDOW_S``: how much ``EventMedia.stats()``'s counters (which only rise)
    rose since the newest sample at least that old, or since the first (taken here).

    Args:
        media: the graph's event media (``stages.event_media.EventMedia``).
    """

    def __init__(self, media: EventMedia) -> None:
        self.media = media
        stats = media.stats()
        # (monotonic time, dropped, failed); the first is the newest at least a window old
        self._samples = deque([(time.monotonic(), stats.dropped, stats.failed)])
        self._lock = threading.Lock()

    def sample(self) -> None:
        """Take one sample of the counters (the monitor's sampling thread)."""
        stats = self.media.stats()
        now = time.monotonic()
        with self._lock:
            self._samples.append((now, stats.dropped, stats.failed))
            self._drop_old(now)

    def reason(self) -> str | None:
        """``event media: 12 dropped (queue full), 1 failed in the last 60 s``, or None when
        none were (the counters now, against the sample a window old)."""
        stats = self.media.stats()
        with self._lock:
            self._drop_old(time.monotonic())
            _, dropped, failed = self._samples[0]
        dropped, failed = stats.dropped - dropped, stats.failed - failed
        lost = [*([f"{dropped} dropped (queue full)"] if dropped else []),
                *([f"{failed} failed"] if failed else [])]
        return (f"event media: {', '.join(lost)} in the last {MEDIA_LOSS_WINDOW_S:g} s"
                if lost else None)

    def _drop_old(self, now: float) -> None:
        """Keep one sample at least a window old (the caller holds the lock)."""
        while len(self._samples) > 1 and now - self._samples[1][0] >= MEDIA_LOSS_WINDOW_S:
            self._samples.popleft()


class SourceMonitor:
    """Reads a running graph's per-source and per-queue counters (as ``pipeline.app.prometheus``
    does) and the preview hub's activity, and derives rates, states and health.

    Args:
        graph: a ``pipeline.graph.Graph`` (``sources``, ``source_metrics``, ``chain``,
            ``sinks``, ``refresh_source_metrics()``, ``queue_depths()``).
        hub: the hub the sinks report to.
        config: the run's configuration (URIs, live flags, queue size).
        stale_after_s: a live source with no frame this long is ``stalled``.
    """

    def __init__(self, graph: Any, hub: PreviewHub, config: PipelineConfig,
                 stale_after_s: float = STALE_AFTER_S) -> None:
        self.graph, self.hub, self.config = graph, hub, config
        self.stale_after_s = stale_after_s
        # Sources are added and removed while the view runs: these are replaced, never
        # changed in place, under _lock.
        self.names = [source.name for source in config.sources]
        self._uris = {s.name: redact_url(s.uri) for s in config.sources}
        self._live = {s.name: s.is_live for s in config.sources}
        self._sampled = {name: _Sampled() for name in self.names}
        self.removing: set[str] = set()
        size = config.runtime.queue_size
        chain = list(graph.chain)
        self._capacity = {chain[0].name: size * len(graph.sources),
                          **{stage.name: size for stage in chain[1:]},
                          **{sink.name: size for sink in graph.sinks.values()}}
        # queue -> when it was first seen full in the samples since, or None: not full now
        self._full_since: dict[str, float | None] = {}
        media = next((stage.media for stage in chain if isinstance(stage, AnalyticsStage)
                      and stage.media is not None), None)
        self._media_losses = MediaLosses(media) if media is not None else None
        started = time.monotonic()
        self._shown_since = {name: started for name in self.names}  # stalled counts from here
        self._lock = threading.Lock()

    def add(self, source: SourceConfig) -> None:
        """Show a source added while the pipeline runs (after the graph took it); one that
        takes the name of an ended source replaces its card."""
        with self._lock:
            self.names = [*(n for n in self.names if n != source.name), source.name]
            self.removing = self.removing - {source.name}
            self._uris = {**self._uris, source.name: redact_url(source.uri)}
            self._live = {**self._live, source.name: source.is_live}
            self._sampled = {**self._sampled, source.name: _Sampled()}
            self._shown_since = {**self._shown_since, source.name: time.monotonic()}
            size = self.config.runtime.queue_size
            first = self.graph.chain[0].name
            self._capacity = {**self._capacity, first: self._capacity[first] + size,
                              self.graph.sinks[source.name].name: size}

    @property
    def capacities(self) -> dict[str, int]:
        """Each queue's capacity, items, as the health check compares its depth to it (a
        queue this full for ``FULL_FOR_S`` is a reason the run is degraded)."""
        with self._lock:
            return dict(self._capacity)

    def mark_removing(self, name: str) -> None:
        """A source asked to stop (``DELETE``): ``removing`` until ``forget``."""
        with self._lock:
            self.removing = self.removing | {name}

    def forget(self, name: str) -> None:
        """Stop showing a removed source (its outputs are final); its lane of the first
        queue, closed and empty, no longer counts in that queue's capacity."""
        with self._lock:
            if name in self.names:
                first = self.graph.chain[0].name
                self._capacity = {**self._capacity, first: self._capacity[first]
                                  - self.config.runtime.queue_size}
            self.names = [n for n in self.names if n != name]
            self._sampled = {n: s for n, s in self._sampled.items() if n != name}
            self._shown_since = {n: t for n, t in self._shown_since.items() if n != name}
            self.removing = self.removing - {name}
            sink = self.graph.sinks.get(name)
            if sink is not None:
                self._capacity = {q: c for q, c in self._capacity.items() if q != sink.name}
                self._full_since.pop(sink.name, None)

    def sample(self) -> None:
        """Take one sample of every source's counters (the monitor thread, twice a second)."""
        self.graph.refresh_source_metrics()
        now = time.monotonic()
        with self._lock:
            for name, sampled in self._sampled.items():
                metrics = self.graph.source_metrics[name]
                sampled.history.append((now, metrics.frames_out))
                while len(sampled.history) > 2 and now - sampled.history[1][0] >= FPS_WINDOW_S:
                    sampled.history.popleft()
        depths = self.graph.queue_depths()
        with self._lock:
            for queue, capacity in self._capacity.items():
                if depths.get(queue, 0) < capacity:
                    self._full_since[queue] = None
                elif self._full_since.get(queue) is None:
                    self._full_since[queue] = now
        if self._media_losses is not None:
            self._media_losses.sample()

    def fps(self, name: str) -> float:
        """Frames/s reaching ``name``'s sink over the last ~``FPS_WINDOW_S`` seconds."""
        with self._lock:
            sampled = self._sampled.get(name)
            history = sampled.history if sampled is not None else deque()
            if len(history) < 2:
                return 0.0
            (then, before), (now, frames) = history[0], history[-1]
        return (frames - before) / (now - then) if now > then else 0.0

    def state(self, name: str) -> str:
        """One of the states of the module docstring (the graph's counters as last
        refreshed: ``sample``, or a request)."""
        with self._lock:
            shown_since, live = self._shown_since[name], self._live[name]
            removing = name in self.removing
        return source_state(self.graph.source_metrics[name], live, self.graph.source_done(name),
                            removing, shown_since, self.stale_after_s)

    def why(self, name: str, state: str) -> str | None:
        """Why ``name`` is not running, in a few words (``state``: its state), or None."""
        metrics = self.graph.source_metrics[name]
        link = metrics.link
        if state == "failed":
            return metrics.error or self.hub.activity(name).error
        if state == "reconnecting" and link is not None:
            wait = link.retry_in_s()
            return (f"attempt {link.attempt}, next try in {wait:.1f} s"
                    if wait else f"attempt {link.attempt}, trying now") + f": {link.error}"
        if state == "stalled":
            last = metrics.last_frame_at
            with self._lock:
                since = self._shown_since[name] if last is None else last
            return (f"no frame for {time.monotonic() - since:.0f} s"
                    + (" (none yet)" if last is None else "")
                    + (f"; last error: {link.error}" if link is not None and link.error else ""))
        return None

    def source(self, name: str, counts: dict[str, dict[str, Any]] | None = None,
               refresh: bool = True) -> dict[str, Any]:
        """The JSON of one source (``pipeline.app.http``'s module docstring); ``counts``:
        ``self.counts()`` when the caller has it already; ``refresh``: bring the graph's
        connection counters up to date first (``sources`` does it once for all)."""
        if refresh:
            self.graph.refresh_source_metrics()  # the latest connection news, not 0.5 s old
        metrics, activity = self.graph.source_metrics[name], self.hub.activity(name)
        age = (None if activity.last_capture_time is None
               else round(max(0.0, time.time() - activity.last_capture_time), 3))
        state, link = self.state(name), metrics.link
        wait = link.retry_in_s() if link is not None else None
        return {
            "name": name,
            "uri": self._uris[name],
            "live": self._live[name],
            "state": state,
            "frames": metrics.frames_out,
            "fps": round(self.fps(name), 2),
            "dropped": metrics.dropped,
            "reconnects": metrics.reconnects,
            "reconnect": ({"attempt": link.attempt,
                           "next_try_in_s": None if wait is None else round(wait, 1)}
                          if state == "reconnecting" and link is not None else None),
            "last_frame_age_s": age,
            "latency_ms": {"p50": metrics.latency_percentile(50),
                           "p99": metrics.latency_percentile(99)},
            "error": (metrics.error or activity.error
                      or (link.error if link is not None and state in ("reconnecting", "stalled")
                          else None)),
            "last_error": metrics.error or (link.error if link is not None else None),
            "picture": ({"width": activity.width, "height": activity.height}
                        if activity.picture_seq else None),
            "viewers": self.hub.viewers(name),
            "counts": (self.counts() if counts is None else counts).get(name),
        }

    def sources(self) -> dict[str, dict[str, Any]]:
        """Every shown source's JSON (``source``), in the order they were shown."""
        self.graph.refresh_source_metrics()
        counts = self.counts()
        return {name: self.source(name, counts, refresh=False) for name in list(self.names)}

    def counts(self) -> dict[str, dict[str, Any]]:
        """Source name -> its analytics counts, for the sources with analytics."""
        found: dict[str, dict[str, Any]] = {}
        for stage in self.graph.chain:
            if isinstance(stage, AnalyticsStage):
                found.update(stage.counts())
        return found

    def reasons(self, states: dict[str, str] | None = None) -> list[str]:
        """Why the graph is not healthy (module docstring), one line each; ``states``: the
        shown sources' states when the caller has them already (counters refreshed)."""
        reasons = []
        if states is None:
            self.graph.refresh_source_metrics()
            states = {name: self.state(name) for name in list(self.names)}
        for name, state in states.items():
            why = self.why(name, state)
            if state == "failed":
                reasons.append(f"source {name} failed: {why}")
            elif state == "reconnecting":
                reasons.append(f"source {name} is reconnecting ({why})")
            elif state == "stalled":
                reasons.append(f"source {name}: {why}")
        if any(self._live.values()):
            now = time.monotonic()
            with self._lock:
                full = {queue: since for queue, since in self._full_since.items()
                        if since is not None and now - since >= FULL_FOR_S}
            for queue, since in full.items():
                reasons.append(f"queue {queue} has been full for {now - since:.0f} s "
                               f"({self._capacity[queue]} items)")
        for stage in self.graph.chain:
            if isinstance(stage, AnalyticsStage):
                for publisher in stage.publishers:
                    if isinstance(publisher, WebhookPublisher):
                        reasons += publisher.reasons()
        if self._media_losses is not None and (lost := self._media_losses.reason()) is not None:
            reasons.append(lost)
        return reasons

    def health(self) -> dict[str, Any]:
        """``{"status", "reasons", "sources": {name: state}}`` of this graph alone:
        ``starting`` until it is ready, then ``degraded`` with ``reasons``, else ``ok``."""
        if not self.graph.ready.is_set():
            return {"status": "starting", "reasons": ["the model is warming up"],
                    "sources": {name: "starting" for name in self.names}}
        self.graph.refresh_source_metrics()
        states = {name: self.state(name) for name in list(self.names)}
        reasons = self.reasons(states)
        return {"status": "degraded" if reasons else "ok", "reasons": reasons,
                "sources": states}


class HostView:
    """One host's live view: a ``SourceMonitor`` of its graph sampled twice a second, and
    the ``ViewReport`` its host sends to the control process (module docstring).

    Usage (in the host, beside its graph)::

        view = HostView("pipeline0", graph, hub, config)
        view.start()
        ...  # ~10 times a second:
        send(view.report(wanted))   # wanted: the board's ``wanted(host)``
        ...
        view.close()

    Args:
        host: the host's name, in every report.
        graph: the host's ``pipeline.graph.Graph``.
        hub: the ``PreviewHub`` its sinks report to, or None (no pictures, and no
            ``last_frame_age_s``: the hub is where the sinks tell capture times).
        config: the graph's configuration (the sources it started with).
        stale_after_s: a live source with no frame this long is ``stalled``.
    """

    def __init__(self, host: str, graph: Any, hub: PreviewHub | None, config: PipelineConfig,
                 stale_after_s: float = STALE_AFTER_S) -> None:
        self.host, self.graph = host, graph
        self.hub = hub if hub is not None else PreviewHub()  # nothing offers to it
        self.monitor = SourceMonitor(graph, self.hub, config, stale_after_s)
        self._sent: dict[str, int] = {}  # source -> number of the picture last reported
        self._lock = threading.Lock()  # a report vs a source shown or forgotten
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Take a first sample and start the sampling thread (every ``SAMPLE_S``)."""
        self.monitor.sample()
        self._closing.clear()
        self._thread = threading.Thread(target=self._loop, name=f"view:{self.host}",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the sampling thread; idempotent."""
        self._closing.set()
        if self._thread is not None:
            self._thread.join(CLOSE_TIMEOUT_S)
            if self._thread.is_alive():
                log.warning("the view's sampling thread did not stop in time: left behind",
                            host=self.host)
            self._thread = None

    def _loop(self) -> None:
        while not self._closing.wait(SAMPLE_S):
            try:
                self.monitor.sample()
                for name in list(self.monitor.removing):  # its outputs are final: not shown
                    if self.graph.source_done(name):
                        self.forget(name)
            except Exception as error:  # noqa: BLE001 - the view must not stop the run
                log.error("sampling the graph failed", host=self.host,
                          error=f"{type(error).__name__}: {error}")

    def add(self, source: SourceConfig) -> None:
        """Show ``source``, which the graph took (added while it runs); one that takes the
        name of an ended source replaces it."""
        with self._lock:
            self.hub.restart(source.name)  # nothing of an earlier source of that name shows
            self.monitor.add(source)
            self._sent.pop(source.name, None)

    def mark_removing(self, name: str) -> None:
        """Source ``name`` was asked to stop: ``removing`` until ``forget``."""
        with self._lock:
            self.monitor.mark_removing(name)

    def forget(self, name: str) -> None:
        """Stop showing source ``name`` (its outputs are final); idempotent. The sampling
        thread does it by itself for a ``removing`` source once its outputs are final."""
        with self._lock:
            if name in self.monitor.names:
                self.monitor.forget(name)
            self._sent.pop(name, None)

    def names(self) -> list[str]:
        """The sources shown, in the order they came."""
        return list(self.monitor.names)

    def report(self, wanted: Collection[str]) -> ViewReport:
        """What this host shows now (``ViewReport``); called by the host ~5-10 times a
        second.

        Args:
            wanted: the sources a viewer watches now (the board's ``wanted(host)``): their
                pictures keep coming (``PreviewHub.request``: for ``WANT_WINDOW_S`` after the
                last report that wanted them), and each one newer than the one last reported
                is JPEG-encoded here, in the caller's thread (OpenCV releases the GIL).
        """
        with self._lock:
            ready = self.graph.ready.is_set()
            sources = self.monitor.sources()
            reasons = self.monitor.reasons({n: s["state"] for n, s in sources.items()}
                                           ) if ready else []
            pictures: dict[str, tuple[int, bytes]] = {}
            for name in wanted:
                if name not in sources:
                    continue
                self.hub.request(name)
                sent = self._sent.get(name, 0)
                if self.hub.activity(name).picture_seq <= sent:
                    continue
                try:
                    picture = self.hub.jpeg(name)
                except ValueError as error:  # one bad picture: the next may do
                    log.warning("a preview could not be encoded", source=name, error=str(error))
                    continue
                if picture is not None and picture[0] > sent:
                    pictures[name] = picture
                    self._sent[name] = picture[0]
        return ViewReport(self.host, ready, sources, pictures, reasons, made_at=time.time())
