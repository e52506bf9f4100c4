"""The live view: an HTTP API and page in the control process (``runtime.http``), for every
source of every host, read from the ``SourceBoard`` (``pipeline.app.board``) that merges the
hosts' reports (``pipeline.app.view``).

=======================================  ==================================================
route                                    answer
=======================================  ==================================================
``GET /``                                the page: every source of every host with its
                                         live picture, state, counters and host, a form
                                         that adds a source (``POST /api/sources``, the
                                         answer's error shown in it) and a remove button
                                         per source (``DELETE``), when the run can change
                                         its sources (``pipeline/app/web/index.html``)
``GET /api/health``                      ``{"status": "starting" | "ok" | "degraded",
                                         "reasons": [...], "sources": {name: state},
                                         "hosts": {host: {"ready", "sources",
                                         "report_age_s", "gone", "spare"}}}`` (200 always;
                                         ``SourceBoard.health``)
``GET /api/sources``                     ``{"sources": [source, ...]}`` in config order
``GET /api/sources/{name}``              one source (below); 404 for an unknown name
``GET /api/sources/{name}/snapshot.jpg`` its latest annotated frame as JPEG (header
                                         ``X-Picture``: the picture's number, rising); 503
                                         when it has none yet (starting, decoded on the
                                         GPU), 404 when none will come (it ended or failed
                                         before anyone watched it)
``GET /api/sources/{name}/stream.mjpg``  ``multipart/x-mixed-replace`` JPEGs of its frames,
                                         at most ``preview_fps`` a second; ends with the
                                         source
``POST /api/sources``                    body: one ``sources[]`` entry as JSON; adds it to
                                         the run (``SourceBoard.add``: a host takes it): 201
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

A source: ``{"name", "host" (the host it is on: ``pipeline0``, ``gpu1``, ...), "uri"
(credentials shown as ***), "live", "state", "frames", "fps" (over the last ~5 s),
"dropped", "reconnects" (failed connection attempts and decode worker restarts, counted from
the first failure, before any first connection too), "reconnect" (while ``reconnecting``:
``{"attempt": N, "next_try_in_s": S}``, else null), "error" (why it is not running: a failed
source's error, or the last failed attempt's while reconnecting or stalled; else null),
"last_error" (the latest failed attempt's reason, kept once it is running again; null before
any), "last_frame_age_s" (since the capture of the latest frame that reached its sink; null
before the first), "latency_ms": {"p50", "p99"}, "picture": {"width", "height"} or null,
"viewers" (its open MJPEG streams), "counts"}`` (``counts``: its zones' and lines' counts,
as ``AnalyticsCounts.to_json``, for a source with analytics). The counters are its host's
(``pipeline.app.view.SourceMonitor``), as that host last reported them (a tenth of a second
ago): they start afresh when a source moves to another host.

States (``pipeline.metrics.source_state``): ``starting`` (no frame yet, no attempt failed),
``running``, ``reconnecting`` (an attempt to connect failed, before any first connection
too, and the next is due, or its decode worker is being restarted: attempt N, next try in S
s, the last error), ``stalled`` (live and connected, but no frame for ``stale_after_s``, or
none since it was shown that long ago), ``failed`` (it ended with an error), ``ended``
(its outputs are final), ``removing`` (``DELETE`` asked, outputs being finalised; the source
leaves the list once they are). Decode worker processes report each attempt as it happens.
A source whose host died is ``reconnecting`` (error: ``its host H stopped: being placed
again``) until the host it is placed on next reports it.

Health is ``starting`` until every host has opened its stages (the model is warming up: no
source has started yet), then ``degraded`` when a source failed, or a camera is reconnecting
or stalled (each named, with why: the attempt, the next try and the last error), or
when a queue was full in every sample for ``pipeline.app.view.FULL_FOR_S`` while its graph
has a live source (the pipeline is not keeping up: a live source's frames are being dropped;
a queue full for an instant is a burst, and with files only a full queue is back-pressure,
by design), or a host stopped, or has not reported for a few seconds
(``pipeline.app.board.SILENT_AFTER_S``). With several hosts each reason names its host.

Security: bound to 127.0.0.1 by default. ``token`` is required whenever ``host`` is not a
loopback address; when set, every route but ``POST /login`` wants ``Authorization: Bearer
TOKEN`` or the cookie ``POST /login`` sets (what the page uses: an ``<img>`` cannot send a
header); a missing or wrong one is a 401. Responses never contain credentials: URIs and
errors are redacted, and every text response is also scrubbed of the sources' passwords and
the token.

Previews travel as small JPEGs at ``preview_fps``, not frames: each host encodes a picture
of the sources someone watches (an open stream, or a snapshot in the last few seconds) and
sends it with its report; this server only serves those bytes (it encodes nothing, and reads
no graph: it imports neither the graph nor a stage).

Threads: uvicorn runs in one daemon thread (its own event loop); JSON routes and source
changes (``SourceBoard.add``, ``remove``: they wait on a host) run in Starlette's thread
pool.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import html
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
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

from pipeline.app.board import SourceBoard, SourceConflict
from pipeline.config import ConfigError, PipelineConfig, SourceConfig, is_loopback

log = structlog.get_logger("http")

PAGE = Path(__file__).with_name("web") / "index.html"
COOKIE = "streamdet_session"
SNAPSHOT_WAIT_S = 2.0  # a snapshot with no fresh picture waits this long for one
REMOVE_WAIT_S = 30.0  # a DELETE waits this long for the outputs to be final (then 202)
START_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 5.0
BOUNDARY = "frame"
ENDED = ("ended", "failed", None)  # a source's states with no picture to come (None: gone)


class HttpSettings(Protocol):
    """What the server reads of ``runtime.http`` (``pipeline.config.HttpConfig``)."""

    host: str
    port: int
    token: str | None
    preview_fps: float


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
    """Serves the live view of every source on the board (module docstring).

    Usage (as the tests join one graph to a board: ``tests.support.live_view.local_board``)::

        board, view, pump = local_board(graph, graph.preview, config)
        server = HttpServer(config.runtime.http, board, config)
        port = server.start()      # before the run: health says starting until it reports
        with pump:                 # the host's reports reach the board
            graph.run()
        server.close()

    Args:
        settings: ``runtime.http``: host, port (0: a free one), token, preview_fps.
        board: the ``SourceBoard`` the hosts' reports are merged into.
        config: the run's configuration (the sources' credentials are scrubbed from every
            response).

    Raises:
        ValueError: the settings may not be served (``check_settings``).
    """

    def __init__(self, settings: HttpSettings, board: SourceBoard,
                 config: PipelineConfig) -> None:
        check_settings(settings)
        self.settings, self.board, self.config = settings, board, config
        self.port: int | None = None
        self._token = settings.token
        self._session = (None if settings.token is None else hmac.new(
            settings.token.encode(), b"streamdet live view session", hashlib.sha256).hexdigest())
        self._secrets = secrets_of(config, settings.token)
        self._period_s = max(1.0 / settings.preview_fps, board.period_s)  # the slower
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
        self._threads = [
            threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="http:server",
                             daemon=True)]
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
        return name if self.board.source(name) is not None else None

    def _unknown(self, request: Request) -> Response:
        return self.json({"error": f"no source named {request.path_params['name']!r}"}, 404)

    # -- routes --------------------------------------------------------------------------
    def _page(self, request: Request) -> Response:
        cards = "\n".join(card for name in self.board.names()
                          if (card := self._card(name)) is not None)
        text = (self._page_text.replace("{{SOURCES}}", cards)
                .replace("{{PERIOD_MS}}", str(round(1000 * self._period_s)))
                .replace("{{EDITABLE}}", "true" if self.board.editable else "false"))
        return HTMLResponse(self.scrub(text), headers={"Cache-Control": "no-store"})

    def _card(self, name: str) -> str | None:
        """A source's card as the page starts with it (its script makes the same for
        sources that come later); None when it is gone."""
        source = self.board.source(name)
        if source is None:
            return None
        quoted = html.escape(name)
        stats = "".join(f"<dt>{label}</dt><dd data-field={key}>-</dd>" for label, key in (
            ("fps", "fps"), ("frames", "frames"), ("dropped", "dropped"),
            ("reconnects", "reconnects"), ("last frame", "age"), ("latency p50/p99", "latency")))
        return (f'<section class=source data-source="{quoted}" data-state="{source["state"]}">'
                f'<h2><span>{quoted}</span><span class="state {source["state"]}">'
                f'{source["state"]}</span><button type=button class=remove>remove</button></h2>'
                f'<div class=uri>{html.escape(source["uri"])}</div>'
                f'<div class=host>on <span data-field=host>{html.escape(source["host"])}'
                '</span></div>'
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
        return self.json(self.board.health())

    def _sources(self, request: Request) -> Response:
        return self.json({"sources": [source for name in self.board.names()
                                      if (source := self.board.source(name)) is not None]})

    def _source(self, request: Request) -> Response:
        source = self.board.source(request.path_params["name"])
        return self._unknown(request) if source is None else self.json(source)

    async def _add(self, request: Request) -> Response:
        if not self.board.editable:
            return self.json({"error": "this pipeline cannot add sources"}, 501)
        try:
            data = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as error:
            return self.json({"error": f"request body: expected a JSON object of a source's "
                                       f"keys ({error})"}, 400)
        try:
            source: SourceConfig = await run_in_threadpool(self.board.add, data)
        except ConfigError as error:
            self._learn_secrets(data)  # a rejected body's password is not echoed either
            return self.json({"error": str(error)}, 400)
        except SourceConflict as error:
            return self.json({"error": str(error)}, 409)
        self._learn_secrets(data)
        shown = self.board.source(source.name) or {"name": source.name, "state": "starting"}
        return self.json(shown, 201)

    async def _remove(self, request: Request) -> Response:
        name = self._known(request)
        if name is None:
            return self._unknown(request)
        if not self.board.editable:
            return self.json({"error": "this pipeline cannot remove sources"}, 501)
        try:
            # waits until its outputs are final (a host's answer), at most REMOVE_WAIT_S
            answer = await run_in_threadpool(self.board.remove, name, REMOVE_WAIT_S)
        except SourceConflict as error:
            return self.json({"error": str(error)}, 409)
        return self.json(answer, 200 if answer.get("state") == "removed" else 202)

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
        board = self.board
        fresh = board.watched(name)
        before = board.picture_number(name)
        board.request(name)  # the next reports of its host bring its pictures
        if not fresh:  # what came earlier may be old: wait a moment for a newer picture
            deadline = time.monotonic() + SNAPSHOT_WAIT_S
            while time.monotonic() < deadline and not self._closing.is_set():
                if board.picture_number(name) > before or board.state(name) in ENDED:
                    break
                await asyncio.sleep(0.02)
        picture = board.picture(name)
        if picture is None and (state := board.state(name)) in ENDED:  # none will come
            return self.json({"error": f"source {name!r} {state or 'left'} with no picture "
                                       "taken (pictures are made only while it is watched)"},
                             404)
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
        second, until the source ended (after its last picture) or left, or the server
        closes."""
        board = self.board
        poll_s = min(0.05, self._period_s / 4)
        sent, sent_at = 0, float("-inf")
        if not board.watched(name) and board.state(name) not in ENDED:
            sent = board.picture_number(name)  # came for an earlier viewer: maybe long ago
        with board.watching(name):
            while not self._closing.is_set():
                await asyncio.sleep(max(0.0, sent_at + self._period_s - time.monotonic()))
                if board.picture_number(name) == sent:
                    if board.state(name) in ENDED:
                        return
                    await asyncio.sleep(poll_s)
                    continue
                picture = board.picture(name)
                if picture is None:  # none yet, or it left (its pictures went with it)
                    if board.state(name) is None:
                        return
                    await asyncio.sleep(poll_s)
                    continue
                sent, data = picture
                sent_at = time.monotonic()
                yield (f"--{BOUNDARY}\r\nContent-Type: image/jpeg\r\nContent-Length: "
                       f"{len(data)}\r\nX-Picture: {sent}\r\n\r\n").encode() + data + b"\r\n"
