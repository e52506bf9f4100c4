"""A real pipeline run on a thread (``running``), ``runtime.http`` settings made by hand
(``HttpSettings``), and one graph's live view joined to a board in this process
(``local_board``: a ``HostView`` and a ``SourceBoard`` joined by a ``LocalPump`` thread, where
a run joins them through its supervisor), all of them served over HTTP (``served``), for the
HTTP API and page tests; and a source's config and JSON made by hand (``source_config``,
``shown``) for a board fed reports by hand."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import structlog

from pipeline.app.board import SourceBoard, starting_json
from pipeline.app.build import build_graph
from pipeline.app.http import HttpServer
from pipeline.app.preview import PreviewHub
from pipeline.app.view import CLOSE_TIMEOUT_S, HostView
from pipeline.config import PipelineConfig, SourceConfig, build_section
from pipeline.graph import Graph
from pipeline.metrics import STALE_AFTER_S

log = structlog.get_logger("view")

PUMP_S = 0.1  # local_board: a report this often


def source_config(name: str, uri: str | None = None) -> SourceConfig:
    """A camera source ``name`` (``rtsp://cam/NAME`` unless ``uri``)."""
    return build_section(SourceConfig, {"name": name, "uri": uri or f"rtsp://cam/{name}"},
                         "sources[0]")


def shown(name: str, state: str = "running", frames: int = 0) -> dict:
    """A source's JSON as a host reports it."""
    return {**starting_json(source_config(name)), "state": state, "frames": frames}


@dataclass
class HttpSettings:
    """The fields of ``runtime.http`` (``pipeline.config.HttpConfig``)."""

    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None
    preview_fps: float = 5.0


@contextmanager
def running(graph: Graph) -> Iterator[Graph]:
    """``graph.run()`` on a thread for the block; then a graceful stop (an abort if it
    does not end in time). Raises the run's error, if any, at the end."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            graph.run()
        except BaseException as error:  # noqa: BLE001 - raised again at the end
            errors.append(error)

    thread = threading.Thread(target=run, name="test:graph", daemon=True)
    thread.start()
    try:
        yield graph
    finally:
        graph.request_stop()
        thread.join(30)
        if thread.is_alive():
            graph.abort()
            thread.join(10)
    if errors:
        raise errors[0]
    assert not thread.is_alive(), "the graph did not stop"


class LocalPump:
    """Feeds a ``SourceBoard`` from a ``HostView`` in the same process: a thread calls
    ``board.update(view.report(board.wanted(host)))`` every ``PUMP_S``. ``start`` starts the
    view too, ``close`` closes both. Its ``lock`` makes a report and its update one step
    against a source shown or forgotten on both sides (``local_board``'s add and remove), so
    the board never takes a report older than such a change."""

    def __init__(self, board: SourceBoard, view: HostView, period_s: float = PUMP_S) -> None:
        self.board, self.view, self.period_s = board, view, period_s
        self.lock = threading.Lock()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    def pump(self) -> None:
        """One report, taken and merged now."""
        with self.lock:
            self.board.update(self.view.report(self.board.wanted(self.view.host)))

    def start(self) -> None:
        """Start the view's sampling, report once, then start the pump thread."""
        self.view.start()
        self.pump()
        self._closing.clear()
        self._thread = threading.Thread(target=self._loop, name=f"view:{self.view.host}:pump",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the pump thread, then the view's sampling; idempotent."""
        self._closing.set()
        if self._thread is not None:
            self._thread.join(CLOSE_TIMEOUT_S)
            self._thread = None
        self.view.close()

    def __enter__(self) -> LocalPump:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _loop(self) -> None:
        while not self._closing.wait(self.period_s):
            try:
                self.pump()
            except Exception as error:  # noqa: BLE001 - the view must not stop the run
                log.error("reporting the view failed", host=self.view.host,
                          error=f"{type(error).__name__}: {error}")


def local_board(graph: Any, hub: PreviewHub | None, config: PipelineConfig,
                host: str = "pipeline0", stale_after_s: float = STALE_AFTER_S,
                preview_fps: float | None = None) -> tuple[SourceBoard, HostView, LocalPump]:
    """A ``SourceBoard`` fed by one graph of this process: its ``HostView`` and the
    ``LocalPump`` that joins them (start the pump with the run, close it after).

    The board's ``add`` is ``graph.control.add`` (then shown on both sides at once), its
    ``remove`` is ``graph.control.remove`` and a wait until the outputs are final (then
    forgotten on both sides: ``{"name", "state": "removed", "frames", "outputs"}``, each
    output under its ``.partial`` name when cut short, or its final one; none for a source
    that delivered no frame), or ``{"name", "state": "removing"}`` after ``wait_s`` (the
    view forgets it once they are). A graph without ``control`` can neither (None: 501).

    Args:
        graph: the ``pipeline.graph.Graph`` (``control``: a ``SourceControl`` or None).
        hub: the ``PreviewHub`` its sinks report to, or None.
        config: its configuration.
        host: the name the board shows it under.
        stale_after_s: a live source with no frame this long is ``stalled``.
        preview_fps: pictures per second and source (default: the hub's, else 5).
    """
    view = HostView(host, graph, hub, config, stale_after_s)
    control = getattr(graph, "control", None)
    pump: LocalPump

    def add(data: Any) -> SourceConfig:
        source: SourceConfig = control.add(data)
        with pump.lock:
            view.add(source)
            board.added(source, host)
            board.update(view.report(board.wanted(host)))  # its first state, not a placeholder
        return source

    def remove(name: str, wait_s: float) -> dict[str, Any]:
        control.remove(name)  # SourceConflict: no source of that name
        view.mark_removing(name)
        deadline = time.monotonic() + wait_s
        while not graph.source_done(name) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not graph.source_done(name):
            return {"name": name, "state": "removing"}
        frames = graph.source_metrics[name].frames_out
        outputs = control.outputs_left(name)
        with pump.lock:
            view.forget(name)
            board.forget(name)
        return {"name": name, "state": "removed", "frames": frames, "outputs": outputs}

    fps = preview_fps if preview_fps is not None else (hub.preview_fps if hub is not None
                                                       else 5.0)
    board = SourceBoard(add if control is not None else None,
                        remove if control is not None else None, fps,
                        order=[source.name for source in config.sources])
    pump = LocalPump(board, view)
    return board, view, pump


@dataclass
class Served:
    """What ``served`` runs: the graph, its board, the HTTP server and a client of it."""

    graph: Graph
    board: SourceBoard
    server: HttpServer
    client: httpx.Client


@contextmanager
def served(config: PipelineConfig, timeout_s: float = 10.0) -> Iterator[Served]:
    """The pipeline of ``config`` running on a thread (``running``), its live view joined to
    a board (``local_board``, host ``pipeline0``) that an ``HttpServer`` serves on
    ``config.runtime.http``'s port (0: a free one); an ``httpx.Client`` of that server (request
    timeout ``timeout_s``) for the block. The server closes after the graph has stopped."""
    graph = build_graph(config)
    board, _, pump = local_board(graph, graph.preview, config)
    server = HttpServer(config.runtime.http, board, config)
    port = server.start()
    try:
        with pump, running(graph), httpx.Client(base_url=f"http://127.0.0.1:{port}",
                                                timeout=timeout_s) as client:
            yield Served(graph, board, server, client)
    finally:
        server.close()
