"""The live view: a read-only HTTP API and page in the pipeline process (``runtime.http``).

=======================================  ==================================================
route                                    answer
=======================================  ==================================================
``GET /``                                the page: every source with its live picture,
                                         state and counters (``pipeline/app/web/index.html``)
``GET /api/health``                      ``{"status": "starting" | "ok" | "degraded",
                                         "reasons": [...], "sources": {name: state}}``
                                         (200 always)
``GET /api/sources``                     ``{"sources": [source, ...]}`` in config order
``GET /api/sources/{name}``              one source (below); 404 for an unknown name
``GET /api/sources/{name}/snapshot.jpg`` its latest annotated frame as JPEG (header
                                         ``X-Picture``: the picture's number); 503 when it
                                         has none yet (starting, decoded on the GPU)
``GET /api/sources/{name}/stream.mjpg``  ``multipart/x-mixed-replace`` JPEGs of its frames,
                                         at most ``preview_fps`` a second; ends with the
                                         source
``POST /api/sources``                    body: one ``sources[]`` entry as JSON; adds it to
                                         the running pipeline (``pipeline.app.control``): 201
                                         and the source; 400 ``{"error"}`` with the config
                                         file's one-line message; 409 for a name in use
                                         (running, or its outputs being finalised) or a run
                                         that is ending. The name of a removed or ended
                                         source may be used again: its new outputs get
                                         numbered names (``pipeline.app.control``)
``DELETE /api/sources/{name}``           stops it and finalises its outputs (an ended
                                         source: its card leaves the list): 200 ``{"name",
                                         "state": "removed", "frames", "outputs"}`` once they
                                         are final (waits up to ``REMOVE_WAIT_S``), else 202
                                         with ``"state": "removing"``; 404 unknown
``POST /login``                          form field ``token``: sets the page's cookie
=======================================  ==================================================

A source: ``{"name", "uri" (credentials shown as ***), "live", "state", "frames", "fps"
(over the last ~5 s), "dropped", "reconnects" (failed connection attempts and decode worker
restarts, counted from the first failure, before any first connection too), "reconnect"
(while ``reconnecting``: ``{"attempt": N, "next_try_in_s": S}``, else null), "error" (why it
is not running: a failed source's error, or the last failed attempt's while reconnecting or
stalled; else null), "last_error" (the latest failed attempt's reason, kept once it is
running again; null before any), "last_frame_age_s" (since the capture of the latest frame
that reached its sink; null before the first), "latency_ms": {"p50", "p99"}, "picture":
{"width", "height"} or null, "viewers", "counts"}`` (``counts``: its zones' and lines'
counts, as ``AnalyticsCounts.to_json``, for a source with analytics).

States (``pipeline.metrics.source_state``): ``starting`` (no frame yet, no attempt failed),
``running``, ``reconnecting`` (an attempt to connect failed, before any first connection
too, and the next is due, or its decode worker is being restarted: attempt N, next try in S
s, the last error), ``stalled`` (live and connected, but no frame for ``stale_after_s``, or
none since it was shown that long ago), ``failed`` (it ended with an error), ``ended``
(its outputs are final), ``removing`` (``DELETE`` asked, outputs being finalised; the source
leaves the list once they are). Decode worker processes report each attempt as it happens.

Health is ``starting`` until the graph has opened its stages (the model is warming up: no
source has started yet), then ``degraded`` when a source failed, or a camera is reconnecting
or stalled (each named, with why: the attempt, the next try and the last error), or
when a queue was full in every sample for ``FULL_FOR_S`` while the graph has a live source
(the pipeline is not keeping up: a live source's frames are being dropped; a queue full for
an instant is a burst, and with files only a full queue is back-pressure, by design).

Security: bound to 127.0.0.1 by default. ``token`` is required whenever ``host`` is not a
loopback address; when set, every route but ``POST /login`` wants ``Authorization: Bearer
TOKEN`` or the cookie ``POST /login`` sets (what the page uses: an ``<img>`` cannot send a
header); a missing or wrong one is a 401. Responses never contain credentials: URIs and
errors are redacted, and every text response is also scrubbed of the sources' passwords and
the token.

Threads: uvicorn runs in one daemon thread (its own event loop); JSON routes run in
Starlette's thread pool, JPEG encoding too (``PreviewHub.jpeg``: OpenCV releases the GIL),
never in a pipeline thread. A monitor thread samples the graph's counters twice a second
(frame rates, reconnection times).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import html
import ipaddress
import json
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol
from urllib.parse import parse_qs, unquote, urlsplit

import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from pipeline.app.preview import PreviewHub
from pipeline.config import ConfigError, PipelineConfig, SourceConfig, partial_path, redact_url
from pipeline.graph import SourceConflict
from pipeline.metrics import STALE_AFTER_S, source_state
from stages.analytics import AnalyticsStage

log = structlog.get_logger("http")

PAGE = Path(__file__).with_name("web") / "index.html"
COOKIE = "streamdet_session"
SAMPLE_S = 0.5  # the monitor's period
FPS_WINDOW_S = 5.0
FULL_FOR_S = 2.0  # a queue full in every sample this long makes the health degraded
SNAPSHOT_WAIT_S = 2.0  # a snapshot with no fresh picture waits this long for one
REMOVE_WAIT_S = 30.0  # a DELETE waits this long for the outputs to be final (then 202)
START_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 5.0
BOUNDARY = "frame"


class HttpSettings(Protocol):
    """What the server reads of ``runtime.http`` (``pipeline.config.HttpConfig``)."""

    host: str
    port: int
    token: str | None
    preview_fps: float


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_settings(settings: HttpSettings, key: str = "runtime.http") -> None:
    """Raise ValueError (one line naming the key) unless ``settings`` may be served: a
    token is set whenever ``host`` is not loopback, and it is not empty."""
    if settings.token is not None and not settings.token.strip():
        raise ValueError(f"{key}.token: expected a non-empty token (an unset variable?), got ''")
    if settings.token is None and not is_loopback(settings.host):
        raise ValueError(f"{key}.token: required when {key}.host is not a loopback address "
                         f"(got {settings.host!r}); use token: ${{VAR}}")


def secrets_of(config: PipelineConfig, token: str | None) -> list[str]:
    """The strings no response may contain: each source URI's user info and password
    (also percent-decoded) and password-like query values, and the token, each also as JSON
    and HTML escape them; longest first, those shorter than 4 characters left out (they
    would mangle numbers; ``redact_url`` hides them in URIs)."""
    found = {token} if token else set()
    for source in config.sources:
        parts = urlsplit(source.uri)
        if "@" in parts.netloc:
            info = parts.netloc.rsplit("@", 1)[0]
            found.update({info, unquote(info)})
            if ":" in info:
                password = info.split(":", 1)[1]
                found.update({password, unquote(password)})
        for name, values in parse_qs(parts.query).items():
            if name.lower() in ("password", "passwd", "pwd", "pass", "token", "auth", "key",
                                "secret"):
                found.update(values)
    found |= {json.dumps(s)[1:-1] for s in found} | {html.escape(s) for s in found}
    return sorted((s for s in found if len(s) >= 4), key=len, reverse=True)


@dataclass
class _Sampled:
    """The monitor's view of one source: (monotonic time, frames out) samples."""

    history: deque[tuple[float, int]] = field(default_factory=deque)


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

    def mark_removing(self, name: str) -> None:
        """A source asked to stop (``DELETE``): ``removing`` until ``forget``."""
        with self._lock:
            self.removing = self.removing | {name}

    def forget(self, name: str) -> None:
        """Stop showing a removed source (its outputs are final)."""
        with self._lock:
            self.names = [n for n in self.names if n != name]
            self._sampled = {n: s for n, s in self._sampled.items() if n != name}
            self._shown_since = {n: t for n, t in self._shown_since.items() if n != name}
            self.removing = self.removing - {name}
            sink = self.graph.sinks[name].name
            self._capacity = {q: c for q, c in self._capacity.items() if q != sink}
            self._full_since.pop(sink, None)

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

    def fps(self, name: str) -> float:
        """Frames/s reaching ``name``'s sink over the last ~``FPS_WINDOW_S`` seconds."""
        with self._lock:
            history = self._sampled[name].history
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

    def source(self, name: str, counts: dict[str, dict[str, Any]] | None = None
               ) -> dict[str, Any]:
        """The JSON of one source (module docstring); ``counts``: ``self.counts()`` when
        the caller has it already."""
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

    def counts(self) -> dict[str, dict[str, Any]]:
        """Source name -> its analytics counts, for the sources with analytics."""
        found: dict[str, dict[str, Any]] = {}
        for stage in self.graph.chain:
            if isinstance(stage, AnalyticsStage):
                found.update(stage.counts())
        return found

    def health(self) -> dict[str, Any]:
        """``{"status", "reasons", "sources": {name: state}}`` (module docstring)."""
        reasons, states = [], {}
        if not self.graph.ready.is_set():
            return {"status": "starting", "reasons": ["the model is warming up"],
                    "sources": {name: "starting" for name in self.names}}
        self.graph.refresh_source_metrics()
        for name in self.names:
            states[name] = state = self.state(name)
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
        return {"status": "degraded" if reasons else "ok", "reasons": reasons,
                "sources": states}


class _TokenGate:
    """ASGI middleware: every request but ``POST /login`` needs the token (a bearer header
    or the session cookie); others get a 401 (the login form for the page)."""

    def __init__(self, app: ASGIApp, server: HttpServer) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or self.server.authorised(Request(scope))
                or (scope["path"] == "/login" and scope["method"] == "POST")):
            await self.app(scope, receive, send)
            return
        if scope["path"] == "/" and scope["method"] in ("GET", "HEAD"):
            response: Response = self.server.login_page(status_code=401)
        else:
            response = self.server.json({"error": "missing or wrong token"}, 401,
                                        {"WWW-Authenticate": 'Bearer realm="streamdet"'})
        await response(scope, receive, send)


class HttpServer:
    """Serves the live view of a running graph (module docstring).

    Usage::

        server = HttpServer(config.runtime.http, graph, hub, config)
        port = server.start()      # right after build_graph, before graph.run()
        try:
            graph.run()
        finally:
            server.close()

    Args:
        settings: ``runtime.http``: host, port (0: a free one), token, preview_fps.
        graph: the ``pipeline.graph.Graph`` to show.
        hub: the ``PreviewHub`` its sinks report to (``offer_part``, ``end``).
        config: the run's configuration.
        stale_after_s: a live source with no frame this long is ``stalled`` (degraded).

    Raises:
        ValueError: the settings may not be served (``check_settings``).
    """

    def __init__(self, settings: HttpSettings, graph: Any, hub: PreviewHub,
                 config: PipelineConfig, stale_after_s: float = STALE_AFTER_S) -> None:
        check_settings(settings)
        self.settings, self.graph, self.hub, self.config = settings, graph, hub, config
        self.monitor = SourceMonitor(graph, hub, config, stale_after_s)
        self.port: int | None = None
        self._token = settings.token
        self._session = (None if settings.token is None else hmac.new(
            settings.token.encode(), b"streamdet live view session", hashlib.sha256).hexdigest())
        self._secrets = secrets_of(config, settings.token)
        self._period_s = max(1.0 / settings.preview_fps, hub.period_s)  # the slower of both
        self._page_text = PAGE.read_text()
        self._closing = threading.Event()
        self._server: uvicorn.Server | None = None
        self._threads: list[threading.Thread] = []
        self.app = _TokenGate(Starlette(routes=[
            Route("/", self._page, methods=["GET"]),
            Route("/login", self._login, methods=["POST"]),
            Route("/api/health", self._health, methods=["GET"]),
            Route("/api/sources", self._sources, methods=["GET"]),
            Route("/api/sources", self._add, methods=["POST"]),
            Route("/api/sources/{name}", self._source, methods=["GET"]),
            Route("/api/sources/{name}", self._remove, methods=["DELETE"]),
            Route("/api/sources/{name}/snapshot.jpg", self._snapshot, methods=["GET"]),
            Route("/api/sources/{name}/stream.mjpg", self._stream, methods=["GET"]),
        ]), self)

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> int:
        """Bind, start serving from a daemon thread, and return the port bound.

        Raises:
            OSError: the address cannot be bound (the message names it).
            RuntimeError: the server did not start within ``START_TIMEOUT_S``.
        """
        host, port = self.settings.host, self.settings.port
        sock = None
        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
        except OSError as error:
            if sock is not None:
                sock.close()
            reason = error.strerror or str(error)
            raise OSError(error.errno, f"runtime.http: cannot serve on {host}:{port}: "
                                       f"{reason}") from None
        self.port = sock.getsockname()[1]
        self._server = server = uvicorn.Server(uvicorn.Config(
            self.app, log_config=None, access_log=False, lifespan="off", http="h11",
            ws="none", server_header=False, timeout_graceful_shutdown=2))
        self.monitor.sample()
        self._threads = [
            threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="http:server",
                             daemon=True),
            threading.Thread(target=self._sample_loop, name="http:monitor", daemon=True)]
        for thread in self._threads:
            thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.started:
            if not self._threads[0].is_alive() or time.monotonic() > deadline:
                self.close()
                sock.close()
                raise RuntimeError(f"runtime.http: the server on {host}:{self.port} did not "
                                   "start")
            time.sleep(0.01)
        log.info("serving the live view", url=self.url)
        return self.port

    @property
    def url(self) -> str:
        """The page's URL (a wildcard host shown as 127.0.0.1)."""
        host = self.settings.host
        host = "127.0.0.1" if host in ("0.0.0.0", "") else "[::1]" if host == "::" else (
            f"[{host}]" if ":" in host else host)
        return f"http://{host}:{self.port}/"

    def close(self) -> None:
        """Stop serving (open streams end within a picture period); idempotent."""
        self._closing.set()
        if self._server is not None:
            self._server.should_exit = True
        for thread in self._threads:
            thread.join(CLOSE_TIMEOUT_S)
        if any(t.is_alive() for t in self._threads):
            log.warning("the live view's server did not stop in time: left behind")
        self._threads = []

    def _sample_loop(self) -> None:
        while not self._closing.wait(SAMPLE_S):
            try:
                self.monitor.sample()
                for name in list(self.monitor.removing):  # a DELETE answered 202
                    if self.graph.source_done(name):
                        self.monitor.forget(name)
            except Exception as error:  # noqa: BLE001 - the view must not stop the run
                log.error("sampling the graph failed", error=f"{type(error).__name__}: {error}")

    # -- helpers -------------------------------------------------------------------------
    def authorised(self, request: Request) -> bool:
        """Whether ``request`` carries the token (always, when none is configured)."""
        if self._token is None:
            return True
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(),
                                                              self._token.encode()):
            return True
        cookie = request.cookies.get(COOKIE, "")
        return bool(cookie) and hmac.compare_digest(cookie.encode(), self._session.encode())

    def scrub(self, text: str) -> str:
        """``text`` with every secret of ``secrets_of`` replaced by ``***``."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def json(self, data: Any, status_code: int = 200,
             headers: dict[str, str] | None = None) -> Response:
        """A JSON response, scrubbed, never cached."""
        body = self.scrub(json.dumps(data, separators=(",", ":")))
        return Response(body, status_code, {"Cache-Control": "no-store", **(headers or {})},
                        media_type="application/json")

    def login_page(self, status_code: int = 401, wrong: bool = False) -> HTMLResponse:
        """The small form that sets the session cookie (``POST /login``)."""
        note = "<p>Wrong token.</p>" if wrong else ""
        return HTMLResponse(
            "<!doctype html><title>streamdet: live view</title><h1>streamdet</h1>"
            f"{note}<form method=post action=login><label>Token <input type=password "
            "name=token autofocus></label> <button>Open</button></form>",
            status_code, {"WWW-Authenticate": 'Bearer realm="streamdet"',
                          "Cache-Control": "no-store"})

    def _known(self, request: Request) -> str | None:
        name = request.path_params["name"]
        return name if name in self.monitor.names else None

    def _unknown(self, request: Request) -> Response:
        return self.json({"error": f"no source named {request.path_params['name']!r}"}, 404)

    # -- routes --------------------------------------------------------------------------
    def _page(self, request: Request) -> Response:
        cards = "\n".join(self._card(name) for name in self.monitor.names)
        text = (self._page_text.replace("{{SOURCES}}", cards)
                .replace("{{PERIOD_MS}}", str(round(1000 * self._period_s))))
        return HTMLResponse(self.scrub(text), headers={"Cache-Control": "no-store"})

    def _card(self, name: str) -> str:
        source = self.monitor.source(name)
        quoted = html.escape(name)
        stats = "".join(f"<dt>{label}</dt><dd data-field={key}>-</dd>" for label, key in (
            ("fps", "fps"), ("frames", "frames"), ("dropped", "dropped"),
            ("reconnects", "reconnects"), ("last frame", "age"), ("latency p50/p99", "latency")))
        return (f'<section class=source data-source="{quoted}" data-state="{source["state"]}">'
                f'<h2><span>{quoted}</span><span class="state {source["state"]}">'
                f'{source["state"]}</span></h2>'
                f'<div class=uri>{html.escape(source["uri"])}</div>'
                f'<div class=frame><img alt="{quoted}"><span class=placeholder>no picture '
                f'yet</span></div><dl>{stats}</dl><div class=counts data-field=counts></div>'
                f'<div class=error data-field=error></div></section>')

    async def _login(self, request: Request) -> Response:
        form = parse_qs((await request.body()).decode("utf-8", "replace"))
        given = (form.get("token") or [""])[0]
        if self._token is None:
            return RedirectResponse("./", 303)
        if not hmac.compare_digest(given.encode(), self._token.encode()):
            return self.login_page(401, wrong=True)
        response = RedirectResponse("./", 303)
        response.set_cookie(COOKIE, self._session or "", httponly=True, samesite="strict")
        return response

    def _health(self, request: Request) -> Response:
        return self.json(self.monitor.health())

    def _sources(self, request: Request) -> Response:
        counts = self.monitor.counts()
        return self.json({"sources": [self.monitor.source(n, counts)
                                      for n in self.monitor.names]})

    def _source(self, request: Request) -> Response:
        name = self._known(request)
        return self._unknown(request) if name is None else self.json(self.monitor.source(name))

    async def _add(self, request: Request) -> Response:
        control = getattr(self.graph, "control", None)
        if control is None:
            return self.json({"error": "this pipeline cannot add sources"}, 501)
        try:
            data = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as error:
            return self.json({"error": f"request body: expected a JSON object of a source's "
                                       f"keys ({error})"}, 400)
        try:
            source: SourceConfig = await run_in_threadpool(control.add, data)
        except ConfigError as error:
            self._learn_secrets(data)  # a rejected body's password is not echoed either
            return self.json({"error": str(error)}, 400)
        except SourceConflict as error:
            return self.json({"error": str(error)}, 409)
        self._learn_secrets(data)
        self.monitor.add(source)
        return self.json(self.monitor.source(source.name), 201)

    async def _remove(self, request: Request) -> Response:
        name = self._known(request)
        control = getattr(self.graph, "control", None)
        if name is None:
            return self._unknown(request)
        if control is None:
            return self.json({"error": "this pipeline cannot remove sources"}, 501)
        try:
            await run_in_threadpool(control.remove, name)
        except SourceConflict as error:
            return self.json({"error": str(error)}, 409)
        self.monitor.mark_removing(name)
        deadline = time.monotonic() + REMOVE_WAIT_S
        while not self.graph.source_done(name) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self.graph.source_done(name):
            return self.json({"name": name, "state": "removing"}, 202)
        frames = self.graph.source_metrics[name].frames_out
        # what it left: each output under its .partial name (a file source removed before its
        # end) or its final one; none for a source that delivered no frame
        outputs = [str(partial_path(path) if partial_path(path).exists() else path)
                   for path in control.output_paths(name)
                   if path.exists() or partial_path(path).exists()]
        self.monitor.forget(name)
        return self.json({"name": name, "state": "removed", "frames": frames,
                          "outputs": outputs})

    def _learn_secrets(self, data: Any) -> None:
        """Add the credentials in a POSTed source's URI to what responses are scrubbed of."""
        uri = data.get("uri") if isinstance(data, dict) else None
        if isinstance(uri, str):
            probe = SimpleNamespace(sources=[SimpleNamespace(uri=uri)])
            found = set(self._secrets) | set(secrets_of(probe, None))  # type: ignore[arg-type]
            self._secrets = sorted(found, key=len, reverse=True)

    async def _snapshot(self, request: Request) -> Response:
        name = self._known(request)
        if name is None:
            return self._unknown(request)
        fresh = self.hub.wanted(name)
        before = self.hub.activity(name).picture_seq
        self.hub.request(name)
        if not fresh:  # what it kept may be old: wait a moment for a newer picture
            deadline = time.monotonic() + SNAPSHOT_WAIT_S
            while time.monotonic() < deadline and not self._closing.is_set():
                activity = self.hub.activity(name)
                if activity.picture_seq > before or activity.ended or activity.error:
                    break
                await asyncio.sleep(0.02)
        picture = await run_in_threadpool(self.hub.jpeg, name)
        if picture is None:
            return self.json({"error": f"source {name!r} has no picture yet"}, 503,
                             {"Retry-After": "1"})
        seq, data = picture
        return Response(data, media_type="image/jpeg",
                        headers={"Cache-Control": "no-store", "X-Picture": str(seq)})

    async def _stream(self, request: Request) -> Response:
        name = self._known(request)
        if name is None:
            return self._unknown(request)
        return StreamingResponse(
            self._parts(name), media_type=f"multipart/x-mixed-replace; boundary={BOUNDARY}",
            headers={"Cache-Control": "no-store"})

    async def _parts(self, name: str) -> AsyncIterator[bytes]:
        """The MJPEG parts of ``name``: each new picture once, at most ``preview_fps`` a
        second, until the source ended (after its last picture) or the server closes."""
        poll_s = min(0.05, self._period_s / 4)
        sent, sent_at = 0, float("-inf")
        activity = self.hub.activity(name)
        if not self.hub.wanted(name) and not (activity.ended or activity.error):
            sent = activity.picture_seq  # kept for an earlier viewer: maybe long ago
        with self.hub.watching(name):
            while not self._closing.is_set():
                await asyncio.sleep(max(0.0, sent_at + self._period_s - time.monotonic()))
                activity = self.hub.activity(name)
                if activity.picture_seq == sent:
                    if activity.ended or activity.error:
                        return
                    await asyncio.sleep(poll_s)
                    continue
                picture = await run_in_threadpool(self.hub.jpeg, name)
                if picture is None:
                    await asyncio.sleep(poll_s)
                    continue
                sent, data = picture
                sent_at = time.monotonic()
                yield (f"--{BOUNDARY}\r\nContent-Type: image/jpeg\r\nContent-Length: "
                       f"{len(data)}\r\nX-Picture: {sent}\r\n\r\n").encode() + data + b"\r\n"
