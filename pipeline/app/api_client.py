"""The HTTP API (``pipeline.app.http``) as a client sees it, for measurements that change a
run while it is measured (``capacity --http``, ``benchmarks.live_control``): one camera
added and removed inside a window.

    window [t0, t0 + S]
      0.2 S  POST /api/sources {name: added, ...}          201: a host took it
             GET /api/sources until added's frames > 0     its first frame
      0.6 S  DELETE /api/sources/added                     200: its outputs are final
             (or once it delivered, at most 0.9 S)         202: still finalising
             GET /api/sources until added is gone
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.app.measurement import MeasurementError

ADDED = "added"  # the name of the camera added and removed


def request(url: str, method: str = "GET", body: Any = None, timeout: float = 60.0
            ) -> tuple[int, bytes, dict[str, str]]:
    """(status, body, headers with lower-case names) of one request; an HTTP error status is
    returned, not raised.

    Raises:
        OSError: nothing answered.
    """
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    call = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(call, timeout=timeout) as answer:
            return answer.status, answer.read(), {k.lower(): v for k, v in answer.headers.items()}
    except urllib.error.HTTPError as error:
        return error.code, error.read(), {k.lower(): v for k, v in error.headers.items()}


def get_json(url: str) -> Any:
    """The JSON answer of ``GET url``.

    Raises:
        MeasurementError: it answered other than 200.
        OSError: nothing answered.
    """
    status, body, _ = request(url, timeout=10)
    if status != 200:
        raise MeasurementError(f"GET {url}: status {status}")
    return json.loads(body)


def source_entry(base: str, name: str) -> dict[str, Any] | None:
    """``name``'s entry of ``/api/sources``, or None when it is not listed."""
    for entry in get_json(f"{base}/api/sources")["sources"]:
        if entry["name"] == name:
            return entry
    return None


@dataclass
class AddRemove:
    """What adding and removing one camera inside a window gave (None: not reached)."""

    post_status: int | None = None
    post_ms: float | None = None
    added_host: str | None = None
    first_frame_s: float | None = None  # POST answered until added's frames > 0
    added_frames: int | None = None  # its frames, as the DELETE answered
    delete_status: int | None = None
    delete_s: float | None = None  # DELETE sent until it answered
    gone_s: float | None = None  # DELETE sent until added left /api/sources
    notes: list[str] = field(default_factory=list)

    @property
    def added_ok(self) -> bool:
        """The POST answered 201 and the camera delivered a frame."""
        return self.post_status == 201 and self.first_frame_s is not None

    @property
    def removed_ok(self) -> bool:
        """The DELETE answered 200 (outputs final) and the camera left the list."""
        return self.delete_status == 200 and self.gone_s is not None

    @property
    def delivered(self) -> bool:
        """The added camera delivered: a frame seen in ``/api/sources``, or frames in the
        DELETE's answer (an overloaded run's first frames can reach the sinks late)."""
        return self.first_frame_s is not None or bool(self.added_frames)

    def text(self) -> str:
        """``POST 201 ok, DELETE 200 ok, added delivered 12 frames (first seen 0.4 s after the
        POST)``, or what failed."""
        post = f"POST {self.post_status or '-'} {'ok' if self.post_status == 201 else 'FAILED'}"
        delete = (f"DELETE {self.delete_status or '-'} "
                  f"{'ok' if self.removed_ok else 'FAILED'}")
        frames = "-" if self.added_frames is None else f"{self.added_frames:,}"
        seen = ("none seen in /api/sources before the DELETE" if self.first_frame_s is None
                else f"first seen {self.first_frame_s:.1f} s after the POST")
        return (f"{post}, {delete}, added {'delivered' if self.delivered else 'delivered NO'} "
                f"frames: {frames} ({seen})")


def add_and_remove(base: str, source: dict[str, Any], t0: float, seconds: float,
                   host_of: Callable[[], dict[str, str]] | None = None) -> AddRemove:
    """Add ``source`` (its name ``ADDED``) through the API at 20% of the window that opened at
    ``t0`` (``time.monotonic()``) and lasts ``seconds``, wait for its first frame, remove it
    at 60% (module docstring). ``host_of`` (source -> host, e.g. ``MetricsPoller.host_of``)
    names its host when the API does not. Never raises for what the API answered: the
    answers, and notes on what went wrong, are the result."""
    result = AddRemove()
    try:
        _add_and_remove(base, source, t0, seconds, host_of, result)
    except (OSError, ValueError, MeasurementError) as error:
        result.notes.append(f"add/remove: {type(error).__name__}: {error}")
    return result


def _add_and_remove(base: str, source: dict[str, Any], t0: float, seconds: float,
                    host_of: Callable[[], dict[str, str]] | None, result: AddRemove) -> None:
    name = source["name"]
    time.sleep(max(0.0, t0 + 0.2 * seconds - time.monotonic()))
    began = time.monotonic()
    status, body, _ = request(f"{base}/api/sources", "POST", source)
    answered = time.monotonic()
    result.post_status, result.post_ms = status, 1000 * (answered - began)
    if status != 201:
        result.notes.append(f"POST answered {status}: {body.decode(errors='replace')[:200]}")
        return
    while time.monotonic() < t0 + 0.9 * seconds:
        entry = source_entry(base, name)
        if entry is not None and entry.get("frames", 0) > 0:
            result.first_frame_s = time.monotonic() - answered
            result.added_host = entry.get("host")  # the live view names each source's host
            break
        time.sleep(0.1)
    else:
        result.notes.append(f"{name} delivered no frame within {0.9 * seconds:g} s of the "
                            f"window")
    if result.added_host is None and host_of is not None:
        result.added_host = host_of().get(name)
    time.sleep(max(0.0, t0 + 0.6 * seconds - time.monotonic()))
    began = time.monotonic()
    status, body, _ = request(f"{base}/api/sources/{name}", "DELETE", timeout=120)
    result.delete_status, result.delete_s = status, time.monotonic() - began
    try:
        answer = json.loads(body)
    except ValueError:
        answer = {}
    if status == 200:
        result.added_frames = answer.get("frames")
    else:
        result.notes.append(f"DELETE answered {status}: {body.decode(errors='replace')[:200]}")
    while time.monotonic() - began < 60:
        if source_entry(base, name) is None:
            result.gone_s = time.monotonic() - began
            break
        time.sleep(0.1)
