"""A camera's state told truthfully, for real: cameras of the GStreamer RTSP server (and a
closed port) decoded in a decode worker process, the live view's API and the Prometheus
endpoint asked over HTTP while the pipeline runs: a refused camera is ``reconnecting`` with
the refusal and a rising count from its first attempt; a camera whose server goes away for
10 s is ``reconnecting`` (health degraded) within ``stale_after_s`` + 1 s, then ``running``
again, and its records' pts go on increasing across the outage."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from pipeline.config import parse_config
from pipeline.metrics import STALE_AFTER_S
from tests.e2e.conftest import pipeline_config, records
from tests.support import live_view
from tests.support.harness import wait_for
from tests.support.metrics import HostMetrics

OUTAGE_S = 10.0


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def served(config: dict) -> Iterator[tuple[httpx.Client, HostMetrics]]:
    """The pipeline of ``config`` running, with its live view on a free port and its
    metrics served as a run serves them (host ``pipeline0``): (API client, metrics)."""
    with live_view.served(parse_config(config)) as run, HostMetrics(run.graph) as metrics:
        yield run.client, metrics


def reconnects_metric(metrics: HostMetrics, name: str) -> float:
    found = re.search(rf'^pipeline_source_reconnects_total{{pipeline="pipeline0",source="{name}"}}'
                      rf' (\S+)$', metrics.text(), re.M)
    return float(found.group(1)) if found else -1.0


def test_a_refused_camera_in_a_worker_is_reconnecting_with_why_within_5_s(
        samples, tmp_path: Path) -> None:
    uri = f"rtsp://127.0.0.1:{closed_port()}/cam"
    config = pipeline_config(
        samples, tmp_path,
        [{"name": "door", "uri": uri, "reconnect_initial_s": 0.2, "reconnect_max_s": 0.5}],
        runtime={"decode_workers": 1, "stop_when": "never", "http": {"port": 0}})
    with served(config) as (api, metrics):
        started = time.monotonic()
        wait_for(lambda: api.get("/api/sources/door").json()["state"] == "reconnecting",
                 "door reconnecting", 5)
        door = api.get("/api/sources/door").json()
        assert "refused" in door["error"].lower(), door
        assert door["last_error"] == door["error"] and door["reconnects"] >= 1
        assert door["reconnect"]["attempt"] >= 1
        listed = {s["name"]: s for s in api.get("/api/sources").json()["sources"]}
        assert listed["door"]["state"] == "reconnecting"
        first = reconnects_metric(metrics, "door")
        assert first >= 1
        wait_for(lambda: reconnects_metric(metrics, "door") > first
                 and api.get("/api/sources/door").json()["reconnects"] > door["reconnects"],
                 "a rising reconnection count", max(0.5, 5 - (time.monotonic() - started)))
        text = metrics.text()
        assert 'pipeline_source_state{pipeline="pipeline0",source="door",state="reconnecting"} ' \
               '1.0' in text
        assert re.search(r'pipeline_source_last_error_info\{error="[^"]*[Rr]efused[^"]*",'
                         r'pipeline="pipeline0",source="door"\} 1\.0', text), text
        health = api.get("/api/health").json()
        assert health["status"] == "degraded"
        assert any(r.startswith("source door is reconnecting (attempt ") and "efused" in r
                   for r in health["reasons"]), health


@pytest.mark.slow  # a real RTSP server
def test_a_10_s_outage_shows_reconnecting_then_running_and_pts_keep_increasing(
        samples, tmp_path: Path, rtsp_server) -> None:
    camera = rtsp_server({"cam": "live:5"})
    config = pipeline_config(
        samples, tmp_path,
        [{"name": "door", "uri": camera.url("cam"), "reconnect_initial_s": 0.2,
          "reconnect_max_s": 1.0}],
        runtime={"decode_workers": 1, "stop_when": "never", "http": {"port": 0}})
    with served(config) as (api, metrics):
        wait_for(lambda: api.get("/api/sources/door").json()["frames"] >= 5,
                 "frames of the camera", 60)
        assert api.get("/api/health").json()["status"] == "ok"
        camera.kill()
        killed_at = time.monotonic()
        wait_for(lambda: api.get("/api/sources/door").json()["state"] == "reconnecting",
                 "door reconnecting", STALE_AFTER_S + 1)
        print(f"\nreconnecting shown {time.monotonic() - killed_at:.1f} s into the outage")
        health = api.get("/api/health").json()
        assert health["status"] == "degraded" and health["sources"]["door"] == "reconnecting"
        assert any(r.startswith("source door is reconnecting") for r in health["reasons"])
        assert reconnects_metric(metrics, "door") >= 1
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - killed_at)))
        camera.start()
        wait_for(lambda: api.get("/api/sources/door").json()["state"] == "running",
                 "door running again", 30)
        back = api.get("/api/sources/door").json()
        frames_back = back["frames"]
        assert back["error"] is None and back["last_error"] and back["reconnect"] is None
        wait_for(lambda: api.get("/api/sources/door").json()["frames"] >= frames_back + 5,
                 "frames after the outage", 30)
        assert api.get("/api/health").json()["status"] == "ok"
    written = records(tmp_path / "door.jsonl")
    pts = [r["pts"] for r in written]
    assert len(pts) >= 10 and None not in pts, pts[:5]
    # from 0 at the camera's first frame; a loaded machine may drop the first ones, or skip
    # its first GOPs to catch up (max_lag_ms 500; a GOP is 1 s here): seconds, not a clock
    assert 0.0 <= pts[0] < 5.0, pts[:5]
    assert all(b > a for a, b in zip(pts, pts[1:])), "pts went back"
    gap = max(b - a for a, b in zip(pts, pts[1:]))
    assert gap >= OUTAGE_S * 0.8, f"the outage is not in the pts (largest step {gap:.2f} s)"


def test_an_ended_card_can_be_deleted_and_its_name_added_again(samples, make_clip,
                                                               tmp_path: Path) -> None:
    clip = str(make_clip("carphone", 30, (176, 144)))
    config = pipeline_config(samples, tmp_path, [{"name": "clip", "uri": clip}],
                             runtime={"decode_workers": 0, "stop_when": "never",
                                      "http": {"port": 0}})
    with served(config) as (api, _):
        busy = api.post("/api/sources", json={"name": "clip", "uri": clip})
        assert busy.status_code == 409, busy.text  # running: its name is in use
        assert "in use" in busy.json()["error"]
        wait_for(lambda: api.get("/api/sources/clip").json()["state"] == "ended",
                 "the clip to end", 120)
        first = records(tmp_path / "clip.jsonl")
        deleted = api.delete("/api/sources/clip")  # an ended card goes
        assert deleted.status_code == 200, deleted.text
        assert deleted.json() == {"name": "clip", "state": "removed", "frames": len(first),
                                  "outputs": [str(tmp_path / "clip.jsonl")]}
        assert api.get("/api/sources").json()["sources"] == []
        assert api.get("/api/sources/clip").status_code == 404

        again = api.post("/api/sources", json={"name": "clip", "uri": clip})
        assert again.status_code == 201, again.text
        assert [s["name"] for s in api.get("/api/sources").json()["sources"]] == ["clip"]
        wait_for(lambda: api.get("/api/sources/clip").json()["state"] == "ended",
                 "the clip added again to end", 120)
        # Ended (not deleted): its name may be used a third time, with the next number.
        third = api.post("/api/sources", json={"name": "clip", "uri": clip, "start_frame": 20})
        assert third.status_code == 201, third.text
        wait_for(lambda: api.get("/api/sources/clip").json()["state"] == "ended",
                 "the third clip to end", 120)
        gone = api.delete("/api/sources/clip").json()
        assert gone["outputs"] == [str(tmp_path / "clip.3.jsonl")]
    assert records(tmp_path / "clip.jsonl") == first  # the first outputs are untouched
    assert [r["frame"] for r in first] == list(range(30))
    assert [r["frame"] for r in records(tmp_path / "clip.2.jsonl")] == list(range(30))
    assert [r["frame"] for r in records(tmp_path / "clip.3.jsonl")] == list(range(20, 30))
    assert sorted(p.name for p in tmp_path.glob("clip*")) == [
        "clip.2.jsonl", "clip.3.jsonl", "clip.jsonl"]
