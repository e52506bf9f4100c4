"""The live view's control side: every host's latest ``ViewReport`` merged into one board,
which the HTTP server (``pipeline.app.http``) reads and changes sources through.

```
hosts (pipeline.app.view.HostView, one per graph)      control process
  report(wanted) ──ViewReport──> supervisor loop ──> board.update(report)
                 <──wanted(host)──                     board.added / forget / host_gone
                                                          │
                        HTTP threads: names, source, health, picture, request, watching,
                                      add (-> the supervisor), remove (-> the supervisor)
```

Nothing here reads a graph or encodes a picture: a source's JSON and its JPEGs are what its
host sent (``pipeline.app.view``); the board adds ``"host"`` (the host it is on) and
``"viewers"`` (its open MJPEG streams here).

**Which host a source is on**: the host it was placed on (``added``), else the first host
that reported it. Reports of other hosts about it are ignored (a host it moved away from,
still cutting it short). A report's sources replace what that host showed before: a source
its host no longer reports has left (its outputs were final after a removal), unless it is
``pending`` (``added``, not reported by its host yet: shown ``starting`` at once) or its host
is gone.

**A host gone** (``host_gone``: its process died, or stopped reporting for good): each of
its sources that had not ended shows as ``reconnecting`` with the error ``its host H
stopped: being placed again`` (a health reason) until the host it is placed on next
(``added``) reports it; one that ended or failed stays as it was until it is removed
(``forget``), also once the host is back (a host that comes back starts empty and reports
afresh). ``frames`` and ``dropped`` count over the source's hosts (each earlier host's last
report of it added: ``CARRIED``); the other counters are its current host's.

**Ordering**: reports of a host must reach ``update`` in the order the host made them, and
``added``/``forget`` must follow the host's own ``HostView.add``/``forget`` (the supervisor
calls them when the host has answered). A report made before a ``forget`` that arrives after
it is ignored for that source (until a report without it), so a removed source never
reappears.

**Pictures**: a host sends a wanted source's JPEG only when it is newer than the last one
sent; the board numbers the pictures it receives per source (1, 2, ...: ``X-Picture``), so
the numbers keep rising when a source moves between hosts. A source is wanted while an
MJPEG stream of it is open (``watching``) and for ``WANT_WINDOW_S`` after a snapshot was
asked for (``request``), as ``PreviewHub`` decides for the sinks of one graph.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pipeline.config import SourceConfig, redact_url
from pipeline.graph import SourceConflict

__all__ = ["SourceBoard", "SourceConflict", "ViewReport"]

WANT_WINDOW_S = 5.0  # a snapshot request keeps its source's pictures coming this long
CARRIED = ("frames", "dropped")  # counters a moved source carries over from its earlier hosts
SILENT_AFTER_S = 3.0  # a host that has not reported this long is a health reason
FINAL_STATES = ("ended", "failed")


@dataclass(frozen=True)
class ViewReport:
    """What one host shows now (picklable: sent over a pipe, or by Ray).

    Attributes:
        host: the host's name (``pipeline0``, ``gpu0``, ...).
        ready: its graph has opened its stages (``graph.ready``: the model is warm).
        sources: source name -> that source's JSON exactly as ``GET /api/sources`` gives it
            (``SourceMonitor.source``; the board adds ``host`` and its own ``viewers``), for
            every source the host shows, in the order it took them.
        pictures: source name -> (picture number on this host, JPEG bytes), only for the
            wanted sources whose latest picture is newer than the one last reported.
        reasons: why the host is not healthy, one line each (``SourceMonitor.reasons``:
            sources failed, reconnecting or stalled, queues full); empty while not ``ready``.
        made_at: wall-clock ``time.time()`` when the host made it (0.0: not known). A report
            can wait in the pipe (the supervisor busy restarting a process): the ages in it
            count on from here, not only from its arrival.
    """

    host: str
    ready: bool
    sources: dict[str, dict[str, Any]]
    pictures: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    made_at: float = 0.0


@dataclass
class _Host:
    """A host as the board knows it: its latest report, when it came, whether it is gone."""

    report: ViewReport
    at: float  # time.monotonic() when the report came
    gone: bool = False


@dataclass
class _Shown:
    """A source as its host last reported it."""

    host: str
    data: dict[str, Any]
    at: float  # time.monotonic() when that report came
    made_at: float = 0.0  # time.time() when its host made it (0.0: not known)

    def waited_s(self, now: float) -> float:
        """Seconds since the report was made: since it came (``now``: monotonic), or since
        its host made it where that is longer (it waited in the pipe)."""
        since_made = time.time() - self.made_at if self.made_at else 0.0
        return max(now - self.at, since_made)


def starting_json(source: SourceConfig) -> dict[str, Any]:
    """The JSON of a source placed but not reported by its host yet (``starting``)."""
    return {"name": source.name, "uri": redact_url(source.uri), "live": source.is_live,
            "state": "starting", "frames": 0, "fps": 0.0, "dropped": 0, "reconnects": 0,
            "reconnect": None, "last_frame_age_s": None,
            "latency_ms": {"p50": None, "p99": None}, "error": None, "last_error": None,
            "picture": None, "viewers": 0, "counts": None}


class SourceBoard:
    """Every host's latest ``ViewReport`` merged: what the HTTP server reads (module
    docstring). Thread-safe: ``update`` and the others from the supervisor's loop, the
    readers from the server's threads.

    Args:
        add: validates a POSTed ``sources[]`` entry and starts it on some host, then calls
            ``added``; returns the source. Raises ``pipeline.config.ConfigError`` (a 400)
            or ``SourceConflict`` (a 409). None: this run cannot add sources (a 501).
        remove: ``(name, wait_s)``: stops source ``name``; returns ``{"name", "state":
            "removed", "frames", "outputs"}`` once its outputs are final within ``wait_s``
            seconds (the board then forgets it), else ``{"name", "state": "removing"}``.
            Raises ``SourceConflict`` (no such source running or ended). None: this run
            cannot remove sources.
        preview_fps: most pictures per second and source the hosts send (their hubs').
        order: the configured sources' names: listed first, in this order, then the others
            in the order they were added or first reported.
    """

    def __init__(self, add: Callable[[Any], SourceConfig] | None,
                 remove: Callable[[str, float], dict[str, Any]] | None, preview_fps: float,
                 order: Iterable[str] = ()) -> None:
        if preview_fps <= 0:
            raise ValueError(f"preview_fps must be > 0, got {preview_fps}")
        self._add, self._remove = add, remove
        self.preview_fps = preview_fps
        self.period_s = 1.0 / preview_fps
        self._lock = threading.Lock()
        self._hosts: dict[str, _Host] = {}
        self._spares: frozenset[str] = frozenset()  # hosts idle as spares (set_spares)
        self._engines: dict[str, dict[str, Any]] = {}  # each engine's state (set_engines)
        self._order: list[str] = list(dict.fromkeys(order))
        self._shown: dict[str, _Shown] = {}
        self._placed: dict[str, str] = {}  # source -> the host it is on
        self._pending: dict[str, dict[str, Any]] = {}  # placed, not reported yet: its JSON
        self._orphaned: set[str] = set()  # its host is gone
        self._removing: set[str] = set()  # a DELETE asked, not forgotten yet
        self._forgotten: dict[str, str] = {}  # source -> host whose older reports to ignore
        self._pictures: dict[str, tuple[int, bytes]] = {}  # board's number, JPEG
        self._viewers: dict[str, int] = {}
        self._wanted_until: dict[str, float] = {}
        self._carried: dict[str, dict[str, int]] = {}  # source -> its earlier hosts' counts

    # -- changes, through the supervisor -----------------------------------------------------
    @property
    def editable(self) -> bool:
        """Whether sources can be added and removed in this run."""
        return self._add is not None and self._remove is not None

    def add(self, data: Any) -> SourceConfig:
        """Add a POSTed ``sources[]`` entry (the ``add`` given); returns the source.

        Raises:
            ConfigError: the entry is not valid (one line naming the key).
            SourceConflict: its name is in use, or the run is ending.
            RuntimeError: this run cannot add sources (``editable``).
        """
        if self._add is None:
            raise RuntimeError("this pipeline cannot add sources")
        return self._add(data)

    def remove(self, name: str, wait_s: float) -> dict[str, Any]:
        """Remove source ``name`` (the ``remove`` given): ``removing`` at once, forgotten
        when the answer is ``removed``.

        Raises:
            SourceConflict: no source of that name is running or has ended.
            RuntimeError: this run cannot remove sources (``editable``).
        """
        if self._remove is None:
            raise RuntimeError("this pipeline cannot remove sources")
        with self._lock:
            before = name in self._removing
            self._removing.add(name)
        try:
            answer = self._remove(name, wait_s)
        except BaseException:
            if not before:
                with self._lock:
                    self._removing.discard(name)
            raise
        if answer.get("state") == "removed":
            self.forget(name)
        return answer

    # -- what the hosts tell -----------------------------------------------------------------
    def update(self, report: ViewReport) -> None:
        """Merge a host's latest report (module docstring)."""
        now = time.monotonic()
        host = report.host
        with self._lock:
            self._hosts[host] = _Host(report, now)  # (a host back after it was gone too)
            for name, forgotten_on in list(self._forgotten.items()):
                if forgotten_on == host and name not in report.sources:
                    del self._forgotten[name]
            for name, data in report.sources.items():
                if self._forgotten.get(name) == host:
                    continue  # made before it was forgotten
                if self._placed.setdefault(name, host) != host:
                    continue  # it is on another host now
                self._pending.pop(name, None)
                self._orphaned.discard(name)
                self._shown[name] = _Shown(host, data, now, report.made_at)
                if name not in self._order:
                    self._order.append(name)
            for name in [n for n, shown in self._shown.items() if shown.host == host
                         and n not in report.sources and self._placed.get(n) == host
                         and n not in self._pending and n not in self._orphaned]:
                self._drop(name)  # its host forgot it: its outputs are final
            for name, (_, data) in report.pictures.items():
                if self._placed.get(name) == host and name in self._shown:
                    number = self._pictures.get(name, (0, b""))[0] + 1
                    self._pictures[name] = (number, data)

    def host_gone(self, host: str) -> None:
        """Host ``host`` stopped (died, or will not report again): its sources that had not
        ended show as ``reconnecting`` until the host they are placed on next reports them
        (module docstring)."""
        with self._lock:
            state = self._hosts.get(host)
            if state is not None:
                state.gone = True
            self._orphaned |= {name for name, shown in self._shown.items()
                               if shown.host == host and self._placed.get(name) == host}

    def set_spares(self, hosts: Collection[str]) -> None:
        """``hosts`` are idle spares now (``runtime.spare_workers``): told in ``health``."""
        self._spares = frozenset(hosts)

    def set_engines(self, engines: dict[str, dict[str, Any]]) -> None:
        """Each engine process's state now (``EngineProcess.state``; none where the model
        runs in the hosts): told in ``health``."""
        self._engines = engines

    def added(self, source: SourceConfig, host: str) -> None:
        """``source`` was placed on ``host`` (added, or moved there): shown at once as
        ``starting`` (a moved one keeps its last counters) until that host reports it. A source
        new to the board goes to the end of the list; a configured one keeps its place. One
        that takes the name of an ended or failed source (never moved) starts afresh."""
        name = source.name
        with self._lock:
            moving = (name in self._orphaned
                      and self._shown[name].data["state"] not in FINAL_STATES)
            self._forgotten.pop(name, None)
            self._removing.discard(name)
            self._placed[name] = host
            if moving:
                shown = self._shown[name]
                carried = self._carried.setdefault(name, dict.fromkeys(CARRIED, 0))
                for key in CARRIED:  # its gone host's counts, carried once (told again: 0)
                    carried[key] += shown.data.get(key) or 0
                shown.data = {**shown.data, **dict.fromkeys(CARRIED, 0)}
                data = {**shown.data, "state": "starting", "fps": 0.0,
                        "reconnect": None, "error": None}
            else:
                self._carried.pop(name, None)
                data = starting_json(source)
                self._pictures.pop(name, None)
                self._shown.pop(name, None)
                self._orphaned.discard(name)
                if name not in self._order:  # a configured one keeps its place
                    self._order.append(name)
            self._pending[name] = data

    def forget(self, name: str) -> None:
        """Stop showing source ``name`` (removed: its outputs are final); idempotent."""
        with self._lock:
            shown = self._shown.get(name)
            host = self._placed.get(name) or (shown.host if shown is not None else None)
            self._drop(name)
            if host is not None:
                self._forgotten[name] = host

    def _drop(self, name: str) -> None:
        """Forget everything about ``name`` but its viewers; the caller holds ``_lock``."""
        self._shown.pop(name, None)
        self._placed.pop(name, None)
        self._pending.pop(name, None)
        self._orphaned.discard(name)
        self._removing.discard(name)
        self._pictures.pop(name, None)
        self._wanted_until.pop(name, None)
        self._carried.pop(name, None)
        self._order = [n for n in self._order if n != name]

    # -- what the server reads -------------------------------------------------------------
    def names(self) -> list[str]:
        """The sources shown: the configured ones in config order, then the others in the
        order they were added."""
        with self._lock:
            return [n for n in self._order if n in self._shown or n in self._pending]

    def host_of(self, name: str) -> str | None:
        """The host source ``name`` is on, or None for an unknown name."""
        with self._lock:
            return self._host_of(name)

    def _host_of(self, name: str) -> str | None:
        if name in self._pending:
            return self._placed[name]
        shown = self._shown.get(name)
        return None if shown is None else shown.host

    def source(self, name: str) -> dict[str, Any] | None:
        """Source ``name``'s JSON as its host reported it, plus ``"host"``, or None for an
        unknown name. ``last_frame_age_s`` counts on from when the report was made (its
        arrival, or its host's ``made_at`` where that is earlier), ``viewers`` are its open
        streams here."""
        with self._lock:
            return self._source(name, time.monotonic())

    def _source(self, name: str, now: float) -> dict[str, Any] | None:
        """``source``; the caller holds ``_lock``."""
        host = self._host_of(name)
        if host is None:
            return None
        if name in self._pending:
            data = dict(self._pending[name])
        else:
            shown = self._shown[name]
            data = dict(shown.data)
            if data.get("last_frame_age_s") is not None:
                data["last_frame_age_s"] = round(data["last_frame_age_s"]
                                                 + shown.waited_s(now), 3)
            if name in self._orphaned and data["state"] not in (*FINAL_STATES, "removing"):
                data.update(state="reconnecting", fps=0.0, reconnect=None,
                            error=f"its host {host} stopped: being placed again")
        for key, count in self._carried.get(name, {}).items():
            data[key] = (data.get(key) or 0) + count
        if name in self._removing and data["state"] != "failed":
            data["state"] = "removing"
        data["host"] = host
        data["viewers"] = self._viewers.get(name, 0)
        return data

    def state(self, name: str) -> str | None:
        """Source ``name``'s state, or None for an unknown name."""
        source = self.source(name)
        return None if source is None else source["state"]

    def health(self) -> dict[str, Any]:
        """``{"status", "reasons", "sources": {name: state}, "hosts": {host: {"ready",
        "sources", "report_age_s", "gone", "spare"}}, "engines": {name: {...}}}``.

        ``starting`` while no host has reported yet, a host that sources are placed on has
        not, or a live host is not ready (its model warming up: its sources are ``starting``
        here); else ``degraded`` when there are
        reasons: each live host's (``ViewReport.reasons``; prefixed ``HOST: `` when there
        are several hosts), a host that has not reported for ``SILENT_AFTER_S``, a host
        gone, a source reconnecting because its host is gone; else ``ok``. ``sources``: the
        number of sources on that host; ``report_age_s``: seconds since its last report;
        ``spare``: an idle spare worker, there to take a dying worker's sources.
        ``engines``: each engine process's state (``EngineProcess.state``: ``pid``,
        ``ready``, ``restarts``, ``standby``, ``failed``; empty where the model runs in the
        hosts); an engine restarting or failed is a reason.
        """
        now = time.monotonic()
        with self._lock:
            several = len(self._hosts) > 1
            reasons: list[str] = []
            hosts: dict[str, dict[str, Any]] = {}
            starting = not self._hosts
            if starting:
                reasons.append("no pipeline has reported yet")
            for host in sorted({self._placed[name] for name in self._pending} - set(self._hosts)):
                starting = True  # its sources are placed there: it is still starting
                reasons.append(f"host {host} has not reported yet")
            for host, known in self._hosts.items():
                age = now - known.at
                hosts[host] = {"ready": known.report.ready and not known.gone,
                               "sources": sum(1 for n in self._order
                                              if self._host_of(n) == host),
                               "report_age_s": round(age, 1), "gone": known.gone,
                               "spare": host in self._spares}
                tag = f"{host}: " if several else ""
                if known.gone:
                    reasons.append(f"host {host} stopped")
                    continue
                if not known.report.ready:
                    starting = True
                    reasons.append(f"{tag}the model is warming up")
                reasons.extend(f"{tag}{reason}" for reason in known.report.reasons)
                if age > SILENT_AFTER_S:
                    reasons.append(f"host {host} has not reported for {age:.0f} s")
            states = {}
            for name in [n for n in self._order if n in self._shown or n in self._pending]:
                source = self._source(name, now)
                assert source is not None
                host = self._hosts.get(source["host"])
                warming = host is not None and not host.gone and not host.report.ready
                states[name] = "starting" if warming else source["state"]
                if name in self._orphaned and source["state"] == "reconnecting":
                    reasons.append(f"source {name} is reconnecting ({source['error']})")
        engines = self._engines
        for name, engine in engines.items():
            if engine["failed"] is not None:
                reasons.append(f"{name} failed: {engine['failed']}")
            elif not engine["ready"] and engine["restarts"]:
                reasons.append(f"{name} is restarting: its workers' cameras drop, files wait")
        status = "starting" if starting else "degraded" if reasons else "ok"
        return {"status": status, "reasons": reasons, "sources": states, "hosts": hosts,
                "engines": engines}

    # -- pictures and viewers --------------------------------------------------------------
    def picture(self, name: str) -> tuple[int, bytes] | None:
        """Source ``name``'s latest picture as (its number here, JPEG bytes), or None when
        none came yet."""
        with self._lock:
            return self._pictures.get(name)

    def picture_number(self, name: str) -> int:
        """The number of source ``name``'s latest picture here (0: none yet)."""
        with self._lock:
            return self._pictures.get(name, (0, b""))[0]

    def request(self, name: str) -> None:
        """A snapshot was asked for: keep ``name``'s pictures coming for ``WANT_WINDOW_S``."""
        with self._lock:
            self._wanted_until[name] = time.monotonic() + WANT_WINDOW_S

    @contextmanager
    def watching(self, name: str) -> Iterator[None]:
        """An open stream of ``name``: its pictures keep coming while the block runs."""
        with self._lock:
            self._viewers[name] = self._viewers.get(name, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._viewers[name] -= 1
                if not self._viewers[name]:
                    del self._viewers[name]

    def viewers(self, name: str) -> int:
        """Open streams of ``name`` now."""
        with self._lock:
            return self._viewers.get(name, 0)

    def watched(self, name: str) -> bool:
        """Whether ``name``'s pictures are wanted now (a stream open, or a snapshot asked
        for in the last ``WANT_WINDOW_S``)."""
        with self._lock:
            return self._watched(name, time.monotonic())

    def _watched(self, name: str, now: float) -> bool:
        return self._viewers.get(name, 0) > 0 or now < self._wanted_until.get(name, 0.0)

    def wanted(self, host: str) -> list[str]:
        """The sources on ``host`` whose pictures are wanted now (for its next report)."""
        now = time.monotonic()
        with self._lock:
            return [name for name in {*self._viewers, *self._wanted_until}
                    if self._watched(name, now) and self._host_of(name) == host]
