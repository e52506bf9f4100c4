"""A real webhook receiver for the tests: ``http.server`` on a loopback port, in a thread.

``stop()`` closes the port (requests are refused, as when the receiver is down) and
``start()`` opens the same port again. Each request gets a fresh connection (HTTP/1.0): a
stopped receiver holds no kept-alive connection that would still take requests.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Request:
    """One POST as it came: ``body`` (bytes), ``headers`` (lower-case names) and the status
    the receiver answered."""

    path: str
    body: bytes
    headers: dict[str, str]
    status: int

    @property
    def event(self) -> dict[str, Any]:
        return json.loads(self.body)


# (request body, headers, attempt number of this Idempotency-Key from 1) -> (status, delay s)
Answer = Callable[[bytes, dict[str, str], int], tuple[int, float]]


class WebhookReceiver:
    """Takes POSTs on ``url`` and keeps them (``requests``: every one; ``delivered``: those
    answered 2xx); ``answer`` picks each request's status and how long to wait before
    answering (default: 200 at once).

    Args:
        answer: see ``Answer``.
        port: the port, or 0 for a free one (kept across ``stop`` and ``start``).
    """

    def __init__(self, answer: Answer | None = None, port: int = 0) -> None:
        self.answer = answer or (lambda body, headers, attempt: (200, 0.0))
        self.port = port
        self.requests: list[Request] = []
        self._attempts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    @property
    def delivered(self) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if 200 <= r.status < 300]

    def events(self) -> list[dict[str, Any]]:
        """The delivered requests' events, in the order they came."""
        return [r.event for r in self.delivered]

    def start(self) -> WebhookReceiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                headers = {k.lower(): v for k, v in self.headers.items()}
                key = headers.get("idempotency-key", "")
                with receiver._lock:
                    attempt = receiver._attempts[key] = receiver._attempts.get(key, 0) + 1
                status, delay = receiver.answer(body, headers, attempt)
                if delay:
                    time.sleep(delay)
                with receiver._lock:  # before answering: the next request comes after it
                    receiver.requests.append(Request(self.path, body, headers, status))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True,
                                        name="webhook-receiver")
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop taking requests and close the port (the port number is kept)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(5)
            self._server = self._thread = None

    def wait_for(self, count: int, timeout_s: float = 20.0) -> list[dict[str, Any]]:
        """The delivered events once there are at least ``count`` (or the timeout passed)."""
        deadline = time.monotonic() + timeout_s
        while len(self.delivered) < count and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.events()
