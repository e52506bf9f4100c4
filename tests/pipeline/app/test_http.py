"""The live view's HTTP API for real: a uvicorn server on a free port in front of a running
pipeline (the sample street clip paced as a live camera, and a camera that refuses every
connection) whose host view reports to the server's board (``local_board``), asked with
httpx: the listing and one source, health, a snapshot that is a JPEG of the frame's size, an
MJPEG stream, 404s, the token on a non-loopback bind, and no response holding a camera's
password."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import cv2
import httpx
import numpy as np
import pytest

from pipeline.app.http import HttpServer, check_settings
from pipeline.config import is_loopback, parse_config
from tests.e2e.conftest import pipeline_config
from tests.support.harness import wait_for
from tests.support.live_view import HttpSettings, Served, served

PASSWORD = "s3cr3t-pw"
DOOR_URI = f"rtsp://admin:{PASSWORD}@127.0.0.1:1/stream1"  # refused: reconnects all along
TOKEN = "tok-9f2c1e77"


@pytest.fixture(scope="module")
def live(samples, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The pipeline running (annotated video on) with the live view on a free port."""
    config = parse_config(pipeline_config(
        samples, tmp_path_factory.mktemp("http"),
        [{"name": "street", "uri": str(samples.bikes), "pace_fps": 6, "live": True},
         {"name": "door", "uri": DOOR_URI, "open_timeout_s": 1, "reconnect_max_s": 1}],
        output={"video": "{source}.mp4", "jsonl": None}, runtime={"decode_workers": 0, "http": {"port": 0}}))
    with served(config) as view:
        wait_for(lambda: source(view, "street")["frames"] > 0, "the first frame", 30)
        yield view


def source(view: Served, name: str) -> dict:
    response = view.client.get(f"/api/sources/{name}")
    assert response.status_code == 200, response.text
    return response.json()


def test_sources_lists_every_source_with_its_counters(live: Served) -> None:
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


def test_health_is_degraded_with_the_reconnecting_camera_named(live: Served) -> None:
    wait_for(lambda: source(live, "door")["state"] == "reconnecting", "door reconnecting", 10)
    health = live.client.get("/api/health").json()
    assert health["status"] == "degraded"
    assert health["sources"]["street"] == "running"
    assert health["sources"]["door"] == "reconnecting"
    assert any(reason.startswith("source door is reconnecting") for reason in health["reasons"])
    assert not any("street" in reason for reason in health["reasons"])
    assert source(live, "door")["reconnects"] >= 1


def test_snapshot_is_a_jpeg_of_the_frame_size(live: Served) -> None:
    response = live.client.get("/api/sources/street/snapshot.jpg")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "image/jpeg"
    picture = cv2.imdecode(np.frombuffer(response.content, np.uint8), cv2.IMREAD_COLOR)
    assert picture is not None and picture.shape == (272, 640, 3)
    assert int(response.headers["x-picture"]) >= 1
    assert source(live, "street")["picture"] == {"width": 640, "height": 272}


def test_snapshot_of_a_camera_without_frames_is_503(live: Served) -> None:
    response = live.client.get("/api/sources/door/snapshot.jpg")
    assert response.status_code == 503
    assert response.json() == {"error": "source 'door' has no picture yet"}


def test_snapshot_of_a_file_that_ended_unwatched_is_404_not_a_retry(live: Served,
                                                                      make_clip) -> None:
    """No picture of it was made (nobody asked while it ran) and none will come."""
    clip = make_clip("bikes", 8, (320, 240))
    live.board.add({"name": "short", "uri": str(clip)})
    wait_for(lambda: source(live, "short")["state"] == "ended", "short ended", 30)
    response = live.client.get("/api/sources/short/snapshot.jpg")
    assert response.status_code == 404 and "retry-after" not in response.headers
    assert response.json() == {"error": "source 'short' ended with no picture taken (pictures "
                                        "are made only while it is watched)"}
    live.board.remove("short", 10)


def test_mjpeg_stream_sends_new_pictures_at_most_preview_fps(live: Served) -> None:
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
                assert live.board.viewers("street") == 1  # watched while the stream is open
            if len(parts) >= 3:
                assert source(live, "street")["viewers"] == 1  # and in its JSON
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
    wait_for(lambda: live.board.viewers("street") == 0, "the stream's viewer to leave", 5)


@pytest.mark.parametrize("path", [
    "/api/sources/nope", "/api/sources/nope/snapshot.jpg", "/api/sources/nope/stream.mjpg"])
def test_unknown_source_is_404(live: Served, path: str) -> None:
    response = live.client.get(path)
    assert response.status_code == 404
    assert response.json() == {"error": "no source named 'nope'"}


def test_page_lists_every_source(live: Served) -> None:
    response = live.client.get("/")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    assert 'data-source="street"' in response.text and 'data-source="door"' in response.text
    assert "rtsp://***@127.0.0.1:1/stream1" in response.text


def test_no_response_contains_the_camera_password(live: Served) -> None:
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
def test_a_non_loopback_bind_requires_the_token(live: Served, host: str) -> None:
    host = non_loopback_address() if host == "interface" else host
    server = HttpServer(HttpSettings(host=host, token=TOKEN), live.board, live.server.config)
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


def test_a_taken_port_is_one_line_naming_the_key(live: Served) -> None:
    server = HttpServer(HttpSettings(port=live.server.port), live.board, live.server.config)
    with pytest.raises(OSError, match=rf"^\[Errno \d+\] runtime\.http: cannot serve on "
                                      rf"127\.0\.0\.1:{live.server.port}: "):
        server.start()
