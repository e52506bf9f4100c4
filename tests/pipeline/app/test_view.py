"""The live view's host side (``pipeline.app.view``): a ``HostView`` beside a real pipeline
(the sample clips paced as live cameras, on the CPU with the test model) reports every
source's JSON and health reasons, and a JPEG of a wanted source only when it is newer; a
source added, removed and forgotten at runtime; the ``SourceMonitor``'s states and health
reasons, step by step, with the graph's counters set by hand."""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import cv2
import numpy as np
import pytest

import pipeline.app.view as view_module
from pipeline.app.build import build_graph
from pipeline.app.preview import PreviewHub
from pipeline.app.view import HostView, SourceMonitor, ViewReport
from pipeline.config import parse_config
from pipeline.graph import Graph
from pipeline.metrics import LinkStatus, SourceMetrics
from stages.analytics import AnalyticsStage
from stages.event_media import EventMediaStats
from tests.e2e.conftest import pipeline_config
from tests.support.harness import wait_for
from tests.support.live_view import running

JSON_KEYS = {"name", "uri", "live", "state", "frames", "fps", "dropped", "reconnects",
             "reconnect", "last_frame_age_s", "latency_ms", "error", "last_error", "picture",
             "viewers", "counts"}


def jpeg_shape(data: bytes) -> tuple[int, ...]:
    picture = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    assert picture is not None, "not a JPEG"
    return picture.shape


@pytest.fixture(scope="module")
def hosted(samples, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Graph, HostView]]:
    """The street and car clips as 6 fps cameras through a pipeline that runs until stopped
    (sources can be added), its ``HostView`` sampling."""
    out = tmp_path_factory.mktemp("view")
    config = parse_config(pipeline_config(
        samples, out,
        [{"name": "street", "uri": str(samples.bikes), "pace_fps": 6, "live": True},
         {"name": "car", "uri": str(samples.carphone), "pace_fps": 6, "live": True}],
        runtime={"decode_workers": 0, "stop_when": "never", "http": {"port": 0}}))
    graph = build_graph(config)
    view = HostView("pipeline0", graph, graph.preview, config)
    view.start()
    try:
        with running(graph):
            wait_for(lambda: all(s["frames"] > 0 for s in view.report([]).sources.values()),
                     "the first frames", 30)
            yield graph, view
    finally:
        view.close()


def test_a_report_has_every_source_and_is_picklable(hosted) -> None:
    graph, view = hosted
    wait_for(lambda: view.report([]).sources["street"]["fps"] > 0, "a frame rate", 10)
    report = view.report([])
    assert (report.host, report.ready, list(report.sources)) == ("pipeline0", True,
                                                                  ["street", "car"])
    for name, source in report.sources.items():
        assert set(source) == JSON_KEYS and source["name"] == name
        assert source["state"] == "running" and source["live"] is True
    assert report.sources["street"]["uri"].endswith("bikes.mp4")
    assert report.pictures == {}  # nobody watches: no picture kept, none encoded
    copied = pickle.loads(pickle.dumps(report))
    assert copied == report and isinstance(copied, ViewReport)


def test_only_wanted_sources_get_a_jpeg_and_only_a_newer_one(hosted) -> None:
    graph, view = hosted
    pictures: list[tuple[int, bytes]] = []

    def street_picture() -> bool:
        report = view.report(["street"])
        assert "car" not in report.pictures  # not wanted
        if "street" in report.pictures:
            pictures.append(report.pictures["street"])
        return len(pictures) >= 2

    wait_for(street_picture, "two pictures of the street", 10)
    (first, data), (second, _) = pictures
    assert second > first >= 1, "a picture reported twice"
    assert jpeg_shape(data) == (272, 640, 3)
    sent = second
    report = view.report(["street"])  # at once: no newer picture yet (6 fps, 5 kept a second)
    assert report.pictures.get("street", (sent + 1,))[0] > sent
    assert report.sources["street"]["picture"] == {"width": 640, "height": 272}
    car: list[bytes] = []

    def car_picture() -> bool:
        picture = view.report(["car"]).pictures.get("car")
        if picture is not None:
            car.append(picture[1])
        return bool(car)

    wait_for(car_picture, "a picture of the car", 10)
    assert jpeg_shape(car[0]) == (144, 176, 3)


def test_a_source_added_removed_and_forgotten(hosted, samples) -> None:
    graph, view = hosted
    before = view.monitor.capacities
    source = graph.control.add({"name": "clip", "uri": str(samples.carphone), "pace_fps": 30})
    view.add(source)
    assert view.monitor.capacities["batch"] == before["batch"] + graph.queue_size
    assert list(view.report([]).sources) == ["street", "car", "clip"]
    wait_for(lambda: view.report([]).sources["clip"]["frames"] > 0, "frames of the clip", 20)
    graph.control.remove("clip")
    view.mark_removing("clip")
    assert view.report([]).sources["clip"]["state"] == "removing"
    # the sampling thread forgets it once its outputs are final
    wait_for(lambda: "clip" not in view.report([]).sources, "the clip to be forgotten", 20)
    assert graph.source_done("clip") and view.names() == ["street", "car"]
    view.forget("clip")  # again: nothing happens
    assert list(view.report(["clip"]).sources) == ["street", "car"]
    # the first queue's capacity is back where it was (it once only grew: after many adds
    # and removes it could never read full)
    assert view.monitor.capacities == before


class FakeGraph:
    """What ``SourceMonitor`` reads of a graph, set by hand (states that a real run reaches
    only by chance or after long waits)."""

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
    monkeypatch.setattr(view_module, "FULL_FOR_S", 0.1)
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


class FakeMedia:
    """What ``SourceMonitor`` reads of the event media (``stats()``), set by hand."""

    def __init__(self) -> None:
        self.dropped = self.failed = 0

    def stats(self) -> EventMediaStats:
        return EventMediaStats(0, 0, self.dropped, self.failed, 0)


def test_event_media_dropped_or_failed_in_the_last_window_is_a_health_reason(
        samples, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The media the analytics stage's ``EventMedia`` dropped and failed since the sample a
    window old (``MEDIA_LOSS_WINDOW_S``), or since the view started: a reason until a
    window passes with none."""
    monkeypatch.setattr(view_module, "MEDIA_LOSS_WINDOW_S", 0.3)
    config = parse_config(pipeline_config(samples, tmp_path, [
        {"name": "clip", "uri": str(samples.bikes)}]))
    graph, media = FakeGraph(["clip"]), FakeMedia()
    graph.chain = [*graph.chain, AnalyticsStage("analytics", {}, None, {}, (), media)]
    media.dropped = 5  # before the view started
    monitor = SourceMonitor(graph, PreviewHub(), config)
    assert monitor.health()["reasons"] == []
    media.dropped, media.failed = 17, 1
    health = monitor.health()
    assert health["status"] == "degraded"
    assert health["reasons"] == ["event media: 12 dropped (queue full), 1 failed in the last "
                                 "0.3 s"]
    monitor.sample()
    time.sleep(0.35)
    monitor.sample()
    assert monitor.health()["reasons"] == []  # none for a window
    media.failed = 3
    assert monitor.health()["reasons"] == ["event media: 2 failed in the last 0.3 s"]


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


def test_a_host_view_reports_ready_only_once_the_graph_is_and_reasons_then(
        samples, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(view_module, "FULL_FOR_S", 0.1)
    config = parse_config(pipeline_config(samples, tmp_path, [
        {"name": "cam", "uri": "rtsp://127.0.0.1:8554/cam"}]))
    graph = FakeGraph(["cam"])
    view = HostView("gpu1", graph, None, config, stale_after_s=0.2)
    graph.ready.clear()
    time.sleep(0.25)
    report = view.report(["cam"])
    assert (report.host, report.ready, report.reasons, report.pictures) == ("gpu1", False, [],
                                                                             {})
    graph.ready.set()
    view.monitor.sample()
    report = view.report(["cam"])
    assert report.ready and report.reasons == ["source cam: no frame for 0 s (none yet)"]
    assert report.sources["cam"]["state"] == "stalled"


def test_a_source_added_again_under_a_removed_one_s_name_shows_nothing_of_the_earlier(
        samples, tmp_path: Path) -> None:
    """The hub keeps a source's last frame, picture and end by name: a source that takes
    the name of one removed shows no ``last_frame_age_s``, picture or error of the earlier
    one, and sends none of its pictures, until it has its own."""
    config = parse_config(pipeline_config(samples, tmp_path, [
        {"name": "gate", "uri": "rtsp://127.0.0.1:8554/gate"}]))
    graph, hub = FakeGraph(["gate"]), PreviewHub()
    view = HostView("pipeline0", graph, hub, config)
    picture = np.zeros((144 * 3 // 2, 176), np.uint8)
    hub.request("gate")
    graph.source_metrics["gate"].frames_done(np.zeros(1))
    hub.offer("gate", picture, 176, 144, time.time() - 9.0)  # captured 9 s ago
    hub.end("gate", "reading rtsp://127.0.0.1:8554/gate failed: refused")
    report = view.report(["gate"])
    gate = report.sources["gate"]
    assert gate["last_frame_age_s"] >= 9.0 and gate["picture"] is not None
    assert gate["error"] is not None and "gate" in report.pictures
    view.mark_removing("gate")
    graph.done.add("gate")
    view.forget("gate")  # removed: its outputs are final

    graph.source_metrics["gate"] = SourceMetrics("gate")  # added again (the graph's own)
    graph.done.discard("gate")
    view.add(config.sources[0])
    report = view.report(["gate"])
    gate = report.sources["gate"]
    assert (gate["state"], gate["frames"], gate["last_frame_age_s"], gate["picture"],
            gate["error"], gate["last_error"]) == ("starting", 0, None, None, None, None)
    assert report.pictures == {}  # not the earlier one's picture
    time.sleep(hub.period_s + 0.05)  # a picture of it is kept (at most preview_fps a second)
    graph.source_metrics["gate"].frames_done(np.zeros(1))
    hub.offer("gate", picture, 176, 144, time.time())  # its own first frame
    report = view.report(["gate"])
    gate = report.sources["gate"]
    assert gate["state"] == "running" and 0.0 <= gate["last_frame_age_s"] < 1.0
    assert gate["picture"] == {"width": 176, "height": 144} and "gate" in report.pictures
