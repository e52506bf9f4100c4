"""A real pipeline run on a thread (``running``) and ``runtime.http`` settings made by hand
(``HttpSettings``), for the HTTP API and page tests."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pipeline.graph import Graph


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
