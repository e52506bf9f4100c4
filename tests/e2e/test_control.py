"""Sources added and removed while the pipeline runs, through the HTTP API of a real uvicorn
server on a free loopback port: a file and a camera of the real GStreamer RTSP server added,
a camera removed while two other sources run (their outputs complete, frame counts exact),
bad bodies answered with the configuration file's one-line messages."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from pipeline.config import ConfigError, parse_config
from tests.e2e.conftest import pipeline_config
from tests.support import RtspServer, free_port, require_rtsp_server
from tests.support.harness import wait_for
from tests.support.live_view import served

pytestmark = pytest.mark.slow  # real RTSP servers, paced files

# Clips of the samples' first frames: street long enough (12 s at 15 fps) to be running
# while a camera is added and removed, car only to end.
BIKES_FRAMES, CARPHONE_FRAMES = 180, 40


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@contextmanager
def control_run(samples, make_clip, out: Path, cameras: RtspServer
                ) -> Iterator[tuple[httpx.Client, dict, object]]:
    """A run with one paced file (``street``) and one camera (``door``), decoded in two
    worker processes, writing into ``out``, that ends only when stopped (``stop_when:
    never``); its API client."""
    data = pipeline_config(
        samples, out,
        [{"name": "street", "uri": str(make_clip("bikes", BIKES_FRAMES, (640, 272))),
          "pace_fps": 15},
         {"name": "door", "uri": cameras.url("door")}],
        runtime={"decode_workers": 2, "stop_when": "never", "http": {"port": 0}})
    with served(parse_config(data), timeout_s=60) as run:
        yield run.client, {"data": data, "yard": cameras.url("yard"), "out": out}, run.graph


CAMERAS = {"door": "live:5", "yard": "live:5"}  # 5 frames/s: CI has 2 cores


@pytest.fixture()
def api(samples, make_clip, tmp_path: Path, rtsp_server
        ) -> Iterator[tuple[httpx.Client, dict, object]]:
    """``control_run`` of this test alone, into ``tmp_path``."""
    with control_run(samples, make_clip, tmp_path, rtsp_server(CAMERAS)) as api:
        yield api


@pytest.fixture(scope="module")
def shared_api(samples, make_clip, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[httpx.Client, dict, object]]:
    """One ``control_run`` for the tests that leave its sources as they found them (requests
    refused, a source added and removed again): its start, and its stop that waits for the
    camera's open (FFmpeg probes about 5 s of a 5 frames/s camera), once for them all."""
    require_rtsp_server()
    with RtspServer(CAMERAS) as cameras, control_run(
            samples, make_clip, tmp_path_factory.mktemp("control"), cameras) as api:
        yield api


def state(client: httpx.Client, name: str) -> str:
    return client.get(f"/api/sources/{name}").json()["state"]


def test_add_and_remove_sources_while_others_run(api, make_clip, tmp_path: Path) -> None:
    client, run, graph = api
    car = make_clip("carphone", CARPHONE_FRAMES, (176, 144))
    added = client.post("/api/sources", json={"name": "car", "uri": str(car),
                                              "pace_fps": 15})
    assert added.status_code == 201, added.text
    assert added.json()["name"] == "car" and added.json()["live"] is False
    camera = client.post("/api/sources", json={"name": "yard", "uri": run["yard"]})
    assert camera.status_code == 201, camera.text
    assert [s["name"] for s in client.get("/api/sources").json()["sources"]] == [
        "street", "door", "car", "yard"]

    wait_for(lambda: client.get("/api/sources/yard").json()["frames"] >= 10,
             "10 frames of the added camera", 60)
    # (sources POSTed while the model warms up start with the configured ones: door may
    # deliver its first frame after yard's tenth)
    wait_for(lambda: state(client, "street") == "running" and state(client, "door") == "running",
             "street and door running", 30)
    removed = client.delete("/api/sources/yard")  # while street and door (at least) run
    assert removed.status_code == 200, removed.text
    body = removed.json()
    assert body["name"] == "yard" and body["state"] == "removed"
    yard = records(tmp_path / "yard.jsonl")  # final: renamed from yard.partial.jsonl
    assert not (tmp_path / "yard.partial.jsonl").exists()
    assert len(yard) == body["frames"] >= 10
    assert client.get("/api/sources/yard").status_code == 404
    assert "yard" not in [s["name"] for s in client.get("/api/sources").json()["sources"]]
    assert client.delete("/api/sources/yard").status_code == 404

    wait_for(lambda: state(client, "street") == "ended" and state(client, "car") == "ended",
             "the two files to end", 180)
    for name, frames in (("street", BIKES_FRAMES), ("car", CARPHONE_FRAMES)):
        assert [r["frame"] for r in records(tmp_path / f"{name}.jsonl")] == list(range(frames))
    ended = client.delete("/api/sources/car")  # an ended card goes
    assert ended.status_code == 200 and ended.json()["frames"] == CARPHONE_FRAMES
    assert "car" not in [s["name"] for s in client.get("/api/sources").json()["sources"]]
    assert state(client, "door") == "running"
    assert graph.source_metrics["door"].frames_out > 0

    # A removed source's name may be used again: its new outputs get numbered names.
    again = client.post("/api/sources", json={"name": "yard", "uri": run["yard"]})
    assert again.status_code == 201, again.text
    wait_for(lambda: client.get("/api/sources/yard").json()["frames"] >= 5,
             "frames of the camera added again", 60)
    removed = client.delete("/api/sources/yard").json()
    assert removed["outputs"] == [str(tmp_path / "yard.2.jsonl")]
    assert len(records(tmp_path / "yard.2.jsonl")) == removed["frames"] >= 5
    assert records(tmp_path / "yard.jsonl") == yard  # the first outputs are untouched


BAD_BODIES = [
    {},
    {"name": "x"},
    {"name": "x", "uri": "/no/such/clip.mp4"},
    {"name": "x", "uri": "rtsp://cam:99999/stream"},
    {"name": "x", "uri": "ftp://cam/stream"},
    {"name": "bad name!", "uri": "rtsp://cam/stream"},
    {"name": "x", "uri": "rtsp://cam/stream", "fps": 5},
    {"name": "x", "uri": "rtsp://cam/stream", "detect_every": 0},
    {"name": "x", "uri": "rtsp://cam/stream", "analytics": [{"name": "z", "type": "zone",
                                                             "points": [[0, 0], [1, 1]]}]},
]


def test_bad_bodies_get_the_config_file_s_messages(shared_api) -> None:
    client, run, graph = shared_api
    for body in BAD_BODIES:
        # The message the same entry gets in the file, as the run's third source.
        data = {**run["data"], "sources": [*run["data"]["sources"], body]}
        with pytest.raises(ConfigError) as expected:
            parse_config(data)
        answer = client.post("/api/sources", json=body)
        assert answer.status_code == 400, (body, answer.text)
        assert answer.json() == {"error": str(expected.value)}, body
        assert "\n" not in answer.json()["error"]
    for text in ("not json", "[1, 2]", '"cam"'):
        answer = client.post("/api/sources", content=text)
        assert answer.status_code == 400
        assert answer.json()["error"].startswith(("request body: expected a JSON object",
                                                  "sources[2]: expected a mapping"))
    taken = client.post("/api/sources", json={"name": "door", "uri": "rtsp://cam/x"})
    assert taken.status_code == 409 and "is in use" in taken.json()["error"]
    secret = client.post("/api/sources", json={"name": "y", "uri": "rtsp://u:hunter22@cam:0/x"})
    assert secret.status_code == 400 and "hunter22" not in secret.text
    assert [s["name"] for s in client.get("/api/sources").json()["sources"]] == ["street", "door"]


def test_an_unreadable_file_is_a_400_naming_its_key_and_a_frameless_removal_lists_nothing(
        shared_api, tmp_path: Path) -> None:
    client, run, _ = shared_api
    bad = tmp_path / "empty.mp4"
    bad.write_bytes(b"")
    answer = client.post("/api/sources", json={"name": "bad", "uri": str(bad)})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == (f"sources[2].uri (source 'bad'): cannot read {str(bad)!r}: "
                                      "Invalid data found when processing input")
    port = free_port()  # nothing listens: the camera never delivers a frame
    added = client.post("/api/sources", json={"name": "gate",
                                              "uri": f"rtsp://127.0.0.1:{port}/gate"})
    assert added.status_code == 201, added.text
    removed = client.delete("/api/sources/gate")
    assert removed.status_code == 200, removed.text
    assert removed.json()["outputs"] == []
    assert not list(run["out"].glob("gate*"))
    assert [s["name"] for s in client.get("/api/sources").json()["sources"]] == ["street", "door"]
    # the next is the run's fourth source (gate was the third): every message numbers it so,
    # those of the whole-config checks (a missing file) as those of its own keys
    missing = client.post("/api/sources", json={"name": "late", "uri": str(tmp_path / "no.mp4")})
    assert missing.json()["error"] == (f"sources[3].uri (source 'late'): file not found: "
                                       f"{str(tmp_path / 'no.mp4')!r}")
    typed = client.post("/api/sources", json={"name": "late", "uri": "rtsp://cam/x",
                                              "pace_fps": "fast"})
    assert typed.json()["error"].startswith("sources[3].pace_fps: "), typed.text
