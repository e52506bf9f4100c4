"""The live view's HTTP API for real: a uvicorn server on a free port in front of a running
pipeline (the sample street clip paced as a live camera, and a camera that refuses every
connection), asked with httpx: the listing and one source, health, a snapshot that is a JPEG
of the frame's size, an MJPEG stream, 404s, the token on a non-loopback bind, and no
response holding a camera's password."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import cv2
import httpx
import numpy as np
import pytest

import pipeline.app.http as http
from pipeline.app.build import build_graph
from pipeline.app.http import HttpServer, SourceMonitor, check_settings, is_loopback
from pipeline.app.preview import PreviewHub
from pipeline.config import parse_config
from pipeline.graph import Graph
from pipeline.metrics import LinkStatus, SourceMetrics
from tests.e2e.conftest import pipeline_config
from tests.support.harness import wait_for
from tests.support.live_view import HttpSettings, running

PASSWORD = "s3cr3t-pw"
DOOR_URI = f"rtsp://admin:{PASSWORD}@127.0.0.1:1/stream1"  # refused: reconnects all along
TOKEN = "tok-9f2c1e77"


@dataclass
class LiveView:
    graph: Graph
    hub: PreviewHub
    server: HttpServer
    client: httpx.Client


@pytest.fixture(scope="module")
def live(samples, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveView]:
    """The pipeline running (annotated video on) with the live view on a free port."""
    config = parse_config(pipeline_config(
        samples, tmp_path_factory.mktemp("http"),
        [{"name": "street", "uri": str(samples.bikes), "pace_fps": 6, "live": True},
         {"name": "door", "uri": DOOR_URI, "open_timeout_s": 1, "reconnect_max_s": 1}],
        output={"video": "{source}.mp4", "jsonl": None}, runtime={"decode_workers": 0, "http": {"port": 0}}))
    graph = build_graph(config)
    hub = graph.preview
    server = HttpServer(config.runtime.http, graph, hub, config)
    port = server.start()
    try:
        with running(graph), httpx.Client(base_url=f"http://127.0.0.1:{port}",
                                          timeout=10) as client:
            view = LiveView(graph, hub, server, client)
            wait_for(lambda: source(view, "street")["frames"] > 0, "the first frame", 30)
            yield view
    finally:
        server.close()


def source(view: LiveView, name: str) -> dict:
    response = view.client.get(f"/api/sources/{name}")
    assert response.status_code == 200, response.text
    return response.json()


def test_sources_lists_every_source_with_its_counters(live: LiveView) -> None:
    wait_for(lambda: source(live, "street")["fps"] > 0, "a frame rate", 10)
    listed = live.client.get("/api/sources").json()["sources"]
    assert [s["name"] for s in listed] == ["street", "door"]
    street, door = listed
    assert street["state"] == "running" and street["live"] is True
    assert street["uri"].endswith("bikes.mp4")
    assert street["frames"] > 0 and 0 < street["fps"] < 20
    assert 0 <= street["last_frame_age_s"] < 5
    assert street["latency_ms"]["p50"] is not None and street["latency_ms"]["p99"] is not None
    assert street["dropped"] >= 0 and street["reconnects"] == 0 and street["error"] is None
    assert door["uri"] == "rtsp://***@127.0.0.1:1/stream1"
    assert door["frames"] == 0 and door["last_frame_age_s"] is None and door["picture"] is None


def test_health_is_degraded_with_the_reconnecting_camera_named(live: LiveView) -> None:
    wait_for(lambda: source(live, "door")["state"] == "reconnecting", "door reconnecting", 10)
    health = live.client.get("/api/health").json()
    assert health["status"] == "degraded"
    assert health["sources"]["street"] == "running"
    assert health["sources"]["door"] == "reconnecting"
    assert any(reason.startswith("source door is reconnecting") for reason in health["reasons"])
    assert not any("street" in reason for reason in health["reasons"])
    assert source(live, "door")["reconnects"] >= 1


def test_snapshot_is_a_jpeg_of_the_frame_size(live: LiveView) -> None:
    response = live.client.get("/api/sources/street/snapshot.jpg")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "image/jpeg"
    picture = cv2.imdecode(np.frombuffer(response.content, np.uint8), cv2.IMREAD_COLOR)
    assert picture is not None and picture.shape == (272, 640, 3)
    assert int(response.headers["x-picture"]) >= 1
    assert source(live, "street")["picture"] == {"width": 640, "height": 272}


def test_snapshot_of_a_camera_without_frames_is_503(live: LiveView) -> None:
    response = live.client.get("/api/sources/door/snapshot.jpg")
    assert response.status_code == 503
    assert response.json() == {"error": "source 'door' has no picture yet"}


def test_mjpeg_stream_sends_new_pictures_at_most_preview_fps(live: LiveView) -> None:
    parts: list[bytes] = []
    buffer = b""
    started = time.monotonic()
    with live.client.stream("GET", "/api/sources/street/stream.mjpg") as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "multipart/x-mixed-replace; boundary=frame"
        for chunk in response.iter_bytes():
            buffer += chunk
            while (end := buffer.find(b"\r\n--frame", 1)) >= 0:
                parts.append(buffer[:end])
                buffer = buffer[end + 2:]
                assert live.hub.viewers("street") == 1  # watched while the stream is open
            if len(parts) >= 3:
                break
    elapsed = time.monotonic() - started
    pictures = []
    for part in parts:
        head, _, body = part.partition(b"\r\n\r\n")
        assert head.startswith(b"--frame\r\nContent-Type: image/jpeg")
        pictures.append(cv2.imdecode(np.frombuffer(body, np.uint8), cv2.IMREAD_COLOR))
    assert all(p is not None and p.shape == (272, 640, 3) for p in pictures)
    assert elapsed >= 2 * 0.2 * 0.9, f"3 parts in {elapsed:.2f} s: faster than preview_fps 5"
    numbers = [int(p.split(b"X-Picture: ")[1].split(b"\r\n")[0]) for p in parts]
    assert numbers == sorted(set(numbers)), f"a picture sent twice: {numbers}"
    wait_for(lambda: live.hub.viewers("street") == 0, "the stream's viewer to leave", 5)


@pytest.mark.parametrize("path", [
    "/api/sources/nope", "/api/sources/nope/snapshot.jpg", "/api/sources/nope/stream.mjpg"])
def test_unknown_source_is_404(live: LiveView, path: str) -> None:
    response = live.client.get(path)
    assert response.status_code == 404
    assert response.json() == {"error": "no source named 'nope'"}


def test_page_lists_every_source(live: LiveView) -> None:
    response = live.client.get("/")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    assert 'data-source="street"' in response.text and 'data-source="door"' in response.text
    assert "rtsp://***@127.0.0.1:1/stream1" in response.text


def test_no_response_contains_the_camera_password(live: LiveView) -> None:
    wait_for(lambda: source(live, "door")["reconnects"] >= 1, "a reconnection", 10)
    bodies = [live.client.get(path).text for path in (
        "/", "/api/health", "/api/sources", "/api/sources/door", "/api/sources/door/snapshot.jpg",
        "/api/sources/nope")]
    assert all(PASSWORD not in body and "admin" not in body for body in bodies)


def non_loopback_address() -> str:
    """This machine's address on its default route, or 0.0.0.0 (all interfaces) without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent by a UDP connect
            address = probe.getsockname()[0]
        except OSError:
            return "0.0.0.0"
    return "0.0.0.0" if is_loopback(address) else address


@pytest.mark.parametrize("host", ["0.0.0.0", "interface"])
def test_a_non_loopback_bind_requires_the_token(live: LiveView, host: str) -> None:
    host = non_loopback_address() if host == "interface" else host
    server = HttpServer(HttpSettings(host=host, token=TOKEN), live.graph, live.hub,
                        live.server.config)
    port = server.start()
    target = "127.0.0.1" if host == "0.0.0.0" else host
    try:
        with httpx.Client(base_url=f"http://{target}:{port}", timeout=10) as client:
            for path in ("/api/sources", "/api/health", "/api/sources/street/snapshot.jpg",
                         "/api/sources/street/stream.mjpg"):
                assert client.get(path).status_code == 401
                assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            # Adding and removing sources too: nothing is added or removed without it.
            assert client.post("/api/sources", json={"name": "x", "uri": "rtsp://h/x"}
                               ).status_code == 401
            assert client.delete("/api/sources/street").status_code == 401
            denied = client.get("/api/sources")
            assert denied.json() == {"error": "missing or wrong token"}
            assert denied.headers["www-authenticate"].startswith("Bearer")
            allowed = client.get("/api/sources", headers={"Authorization": f"Bearer {TOKEN}"})
            assert allowed.status_code == 200
            assert [s["name"] for s in allowed.json()["sources"]] == ["street", "door"]

            page = client.get("/")  # the page asks for the token, and keeps it in a cookie
            assert page.status_code == 401 and "<form" in page.text
            assert client.post("/login", data={"token": "wrong"}).status_code == 401
            login = client.post("/login", data={"token": TOKEN})
            assert login.status_code == 303
            page = client.get("/")
            assert page.status_code == 200 and 'data-source="street"' in page.text
            assert client.get("/api/health").status_code == 200
            assert all(TOKEN not in text for text in (
                page.text, login.text, client.get("/api/sources").text,
                *login.headers.get_list("set-cookie")))
    finally:
        server.close()


@pytest.mark.parametrize(("host", "token", "error"), [
    ("127.0.0.1", None, None),
    ("::1", None, None),
    ("localhost", None, None),
    ("0.0.0.0", "t0ken", None),
    ("0.0.0.0", None, "runtime.http.token: required when runtime.http.host is not a loopback "
                      "address (got '0.0.0.0'); use token: ${VAR}"),
    ("camera-box.local", None, "runtime.http.token: required when runtime.http.host is not a "
                               "loopback address (got 'camera-box.local'); use token: ${VAR}"),
    ("127.0.0.1", " ", "runtime.http.token: expected a non-empty token (an unset variable?), "
                       "got ''"),
])
def test_check_settings(host: str, token: str | None, error: str | None) -> None:
    settings = HttpSettings(host=host, token=token)
    if error is None:
        check_settings(settings)
    else:
        with pytest.raises(ValueError) as raised:
            check_settings(settings)
        assert str(raised.value) == error


def test_a_taken_port_is_one_line_naming_the_key(live: LiveView) -> None:
    server = HttpServer(HttpSettings(port=live.server.port), live.graph, live.hub,
                        live.server.config)
    with pytest.raises(OSError, match=rf"^\[Errno \d+\] runtime\.http: cannot serve on "
                                      rf"127\.0\.0\.1:{live.server.port}: "):
        server.start()


class FakeGraph:
    """What ``SourceMonitor`` reads of a graph, set by hand."""

    def __init__(self, names: list[str]) -> None:
        self.sources = [SimpleNamespace(name=name, restarts=0) for name in names]
        self.source_metrics = {name: SourceMetrics(name) for name in names}
        self.chain = [SimpleNamespace(name="batch"), SimpleNamespace(name="infer")]
        self.sinks = {name: SimpleNamespace(name=f"sink:{name}") for name in names}
        self.depths: dict[str, int] = {}
        self.done: set[str] = set()  # sources whose outputs are final
        self.ready = threading.Event()  # the stages opened (the model warmed up)
        self.ready.set()

    def source_done(self, name: str) -> bool:
        return name in self.done

    def refresh_source_metrics(self) -> None:
        pass

    def queue_depths(self) -> dict[str, int]:
        return dict(self.depths)


def test_states_and_health_reasons(samples, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http, "FULL_FOR_S", 0.1)
    config = parse_config(pipeline_config(samples, tmp_path, [
        {"name": "cam", "uri": "rtsp://127.0.0.1:8554/cam"}]))
    graph, hub = FakeGraph(["cam"]), PreviewHub()
    monitor = SourceMonitor(graph, hub, config, stale_after_s=0.2)
    metrics = graph.source_metrics["cam"]

    def check(state: str, reasons: list[str]) -> None:
        monitor.sample()
        health = monitor.health()
        assert (monitor.state("cam"), health["reasons"]) == (state, reasons)
        assert health["status"] == ("degraded" if reasons else "ok")

    def frame() -> None:
        metrics.frames_done(np.zeros(1))

    graph.ready.clear()  # the model is warming up: starting, whatever the sources do
    time.sleep(0.25)
    monitor.sample()
    assert monitor.health() == {"status": "starting", "reasons": ["the model is warming up"],
                                "sources": {"cam": "starting"}}
    graph.ready.set()
    monitor = SourceMonitor(graph, hub, config, stale_after_s=0.2)
    check("starting", [])
    time.sleep(0.25)
    check("stalled", ["source cam: no frame for 0 s (none yet)"])
    frame()
    check("running", [])
    refused = "cannot open rtsp://127.0.0.1:8554/cam: Connection refused"
    metrics.reconnects = 1
    metrics.link = LinkStatus("reconnecting", 1, time.monotonic() + 30, refused)
    check("reconnecting", [f"source cam is reconnecting (attempt 1, next try in 30.0 s: "
                           f"{refused})"])
    metrics.link = LinkStatus("reconnecting", 2, None, refused)
    check("reconnecting", [f"source cam is reconnecting (attempt 2, trying now: {refused})"])
    metrics.link = LinkStatus("connected", error=refused)
    frame()
    check("running", [])
    time.sleep(0.25)
    check("stalled", [f"source cam: no frame for 0 s; last error: {refused}"])
    frame()
    graph.depths = {"infer": 4, "sink:cam": 3}  # queue_size 4: infer full, the sink not
    check("running", [])  # full for an instant: a burst
    time.sleep(0.15)
    frame()
    check("running", ["queue infer has been full for 0 s (4 items)"])
    graph.depths = {}
    metrics.error = "reading rtsp://127.0.0.1:8554/cam failed: refused"
    check("failed", ["source cam failed: reading rtsp://127.0.0.1:8554/cam failed: refused"])
    metrics.error = None
    graph.done.add("cam")
    check("ended", [])


def test_a_source_added_late_is_starting_until_it_has_been_shown_stale_after_s(
        samples, tmp_path: Path) -> None:
    config = parse_config(pipeline_config(samples, tmp_path, [
        {"name": "cam", "uri": "rtsp://127.0.0.1:8554/cam"}]))
    graph, hub = FakeGraph(["cam"]), PreviewHub()
    monitor = SourceMonitor(graph, hub, config, stale_after_s=0.2)
    time.sleep(0.25)  # the view has run longer than stale_after_s
    added = parse_config(pipeline_config(samples, tmp_path, [
        {"name": "door", "uri": "rtsp://127.0.0.1:8554/door"}])).sources[0]
    graph.sources.append(SimpleNamespace(name="door", restarts=0))
    graph.source_metrics["door"] = SourceMetrics("door")
    graph.sinks["door"] = SimpleNamespace(name="sink:door")
    monitor.add(added)
    monitor.sample()
    assert (monitor.state("cam"), monitor.state("door")) == ("stalled", "starting")
    assert monitor.health()["reasons"] == ["source cam: no frame for 0 s (none yet)"]
    time.sleep(0.25)
    monitor.sample()
    assert monitor.state("door") == "stalled"
