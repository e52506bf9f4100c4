"""A graph's Prometheus metrics as a run serves them: ``GraphCollector`` on a stand-in graph,
snapshot as a pipeline host sends it (``pipeline="pipeline0"``) and served by the
supervisor's ``ClusterExporter``, scraped over HTTP on loopback; the bind and token rules of
``runtime.metrics_host`` / ``runtime.metrics_token``."""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pipeline.app.cluster_metrics import ClusterExporter, snapshot
from pipeline.app.prometheus import LATENCY_BUCKETS_S, GraphCollector, LatencyHistogram
from pipeline.config import ConfigError, RuntimeConfig, build_section
from pipeline.metrics import SourceMetrics, StageMetrics
from tests.pipeline.app.test_http import non_loopback_address
from tests.support.metrics import HostMetrics, Samples, parse, value


class FakeGraph:
    """What the collector reads from a graph, and nothing else."""

    def __init__(self, stages: list[str], sources: list[str]) -> None:
        self.stage_metrics = {name: StageMetrics(name) for name in stages}
        self.source_metrics = {name: SourceMetrics(name) for name in sources}
        self.depths = {name: 0 for name in stages}
        self.refreshes = 0

    def refresh_source_metrics(self) -> None:
        self.refreshes += 1

    def queue_depths(self) -> dict[str, int]:
        return dict(self.depths)


def latency_samples(samples: Samples, source: str) -> dict[str, float]:
    """The latency histogram of one source: {"le" bound or "sum"/"count": value}."""
    out = {}
    for (name, labels), v in samples.items():
        label = dict(labels)
        if label.get("source") != source:
            continue
        if name == "pipeline_frame_latency_seconds_bucket":
            out[label["le"]] = v
        elif name in ("pipeline_frame_latency_seconds_sum", "pipeline_frame_latency_seconds_count"):
            out[name.rsplit("_", 1)[1]] = v
    return out


def reference_histogram(batches: list[np.ndarray]) -> dict[str, float]:
    """The same latencies fed one by one to prometheus_client's own Histogram."""
    registry = CollectorRegistry()
    histogram = Histogram("pipeline_frame_latency_seconds", "reference", ["source"],
                          buckets=LATENCY_BUCKETS_S, registry=registry)
    for batch in batches:
        for latency in batch:
            histogram.labels("cam").observe(float(latency))
    return latency_samples(parse(generate_latest(registry).decode()), "cam")


@pytest.fixture
def served() -> Iterator[tuple[HostMetrics, FakeGraph]]:
    graph = FakeGraph(["preprocess", "infer", "sink:cam"], ["cam", "file"])
    with HostMetrics(graph) as metrics:
        yield metrics, graph


def test_stage_source_and_queue_metrics(served: tuple[HostMetrics, FakeGraph]) -> None:
    metrics, graph = served
    graph.stage_metrics["infer"].record(8, 0.04, 0.01)
    graph.stage_metrics["infer"].record(8, 0.06, 0.0)
    graph.stage_metrics["sink:cam"].record(3, 0.002, 0.5)
    cam = graph.source_metrics["cam"]
    cam.frames_done(np.full(5, 0.02))
    cam.dropped, cam.reconnects = 7, 2
    graph.depths["infer"] = 3
    samples = metrics.scrape()
    assert graph.refreshes == 1
    expected = {
        ("pipeline_stage_frames_total", "stage", "infer"): 16,
        ("pipeline_stage_calls_total", "stage", "infer"): 2,
        ("pipeline_stage_work_seconds_total", "stage", "infer"): 0.1,
        ("pipeline_stage_blocked_seconds_total", "stage", "infer"): 0.01,
        ("pipeline_stage_frames_total", "stage", "sink:cam"): 3,
        ("pipeline_stage_work_seconds_total", "stage", "sink:cam"): 0.002,
        ("pipeline_stage_blocked_seconds_total", "stage", "sink:cam"): 0.5,
        ("pipeline_stage_frames_total", "stage", "preprocess"): 0,
        ("pipeline_stage_blocked_seconds_total", "stage", "preprocess"): 0.0,
        ("pipeline_source_frames_total", "source", "cam"): 5,
        ("pipeline_source_frames_total", "source", "file"): 0,
        ("pipeline_source_dropped_frames_total", "source", "cam"): 7,
        ("pipeline_source_reconnects_total", "source", "cam"): 2,
        ("pipeline_queue_depth", "queue", "infer"): 3,
        ("pipeline_queue_depth", "queue", "preprocess"): 0,
    }
    for (name, label, label_value), want in expected.items():
        assert value(samples, name, **{label: label_value}) == pytest.approx(want), name
    assert value(samples, "pipeline_source_fps", source="cam") > 0.0
    assert value(samples, "pipeline_source_fps", source="file") == 0.0
    assert not any("busy" in name for name, _ in samples)
    # Sources the histogram has not seen yet appear with zeros.
    keys = {*(str(b) for b in LATENCY_BUCKETS_S), "+Inf", "sum", "count"}
    assert latency_samples(samples, "file") == dict.fromkeys(keys, 0.0)
    assert latency_samples(samples, "cam") == dict.fromkeys(keys, 0.0)  # fed by on_batch_done only
    metrics.exporter.stop()
    with pytest.raises(urllib.error.URLError):
        metrics.text()  # stopped: nothing listens any more (the fixture stops it again)


@pytest.mark.parametrize("batches", [
    pytest.param([np.array([0.001, 0.007, 0.05, 0.3, 45.0])], id="one-batch"),
    pytest.param([np.asarray(LATENCY_BUCKETS_S)], id="exactly-on-the-bounds"),
    pytest.param([np.array([0.0]), np.array([], dtype=np.float64), np.array([1e9])],
                 id="zero-empty-huge"),
    pytest.param([np.random.default_rng(seed).exponential(0.2, size) for seed, size in
                  enumerate([1, 8, 64, 3, 500])], id="random-batches"),
    pytest.param([np.array([0.004, 0.02, 0.6], dtype=np.float32)], id="float32"),
])
def test_latency_histogram_matches_prometheus_clients(
        served: tuple[HostMetrics, FakeGraph], batches: list[np.ndarray]) -> None:
    metrics, _ = served
    for batch in batches:
        metrics.latency.observe("cam", batch)
    got = latency_samples(metrics.scrape(), "cam")
    want = reference_histogram(batches)
    assert set(got) == set(want)
    assert set(want) == {*(str(b) for b in LATENCY_BUCKETS_S), "+Inf", "sum", "count"}
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-9), key
    assert got["+Inf"] == got["count"] == sum(len(b) for b in batches)
    bounds = [got[str(b)] for b in LATENCY_BUCKETS_S] + [got["+Inf"]]
    assert bounds == sorted(bounds)  # cumulative


def test_latency_histogram_per_source_and_from_threads(
        served: tuple[HostMetrics, FakeGraph]) -> None:
    metrics, _ = served
    batch = np.array([0.003, 0.015, 0.15, 3.0])

    def feed(source: str) -> None:
        for _ in range(250):
            metrics.latency.observe(source, batch)

    threads = [threading.Thread(target=feed, args=(source,))
               for source in ("cam", "cam", "file", "other")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    samples = metrics.scrape()
    for source, times in (("cam", 2), ("file", 1), ("other", 1)):
        histogram = latency_samples(samples, source)
        n = 250 * times
        assert histogram["count"] == 4 * n
        assert histogram["sum"] == pytest.approx(float(batch.sum()) * n)
        assert (histogram["0.005"], histogram["0.02"], histogram["0.2"], histogram["5.0"]) == \
            (n, 2 * n, 3 * n, 4 * n)


def test_latency_observed_before_serving_is_kept() -> None:
    latency = LatencyHistogram()  # a host makes it before its graph, fed from the first batch
    latency.observe("cam", np.array([0.01, 0.02]))
    with HostMetrics(FakeGraph(["s"], ["cam"]), latency) as metrics:
        assert latency_samples(metrics.scrape(), "cam")["count"] == 2
    metrics.exporter.stop()  # idempotent


def test_a_taken_port_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        exporter = ClusterExporter(port, "127.0.0.1")
        with pytest.raises(OSError, match=f"runtime.metrics_port: cannot serve metrics on "
                                          f"127.0.0.1:{port}"):
            exporter.start()


def test_analytics_counts_are_exported_by_source_region_class_and_direction() -> None:
    """The counts of the graph's analytics stage after the synthetic trajectories of
    tests/stages/test_analytics.py (whose events are known by construction)."""
    from stages.analytics import AnalyticsStage
    from tests.stages.test_analytics import (
        DOCK,
        FORGET_S,
        FRAMES,
        GATE,
        NAMES,
        TRACKS,
        frame_rows,
        region,
        run,
    )

    graph = FakeGraph(["analytics"], ["cam"])
    stage = AnalyticsStage("analytics", {"cam": [region(GATE), region(DOCK)]}, NAMES,
                           {"cam": FORGET_S})
    graph.chain = [stage]
    with HostMetrics(graph) as metrics:
        before = metrics.scrape()
        assert value(before, "pipeline_zone_objects", source="cam", zone="dock", **{"class": "person"}) == 0
        assert not [name for name, _ in before if name == "pipeline_line_crossings_total"]
        run(stage, frame_rows(TRACKS, 13))  # frames 0-12: track 10 is inside the dock again
        samples = metrics.scrape()
        crossings = {(labels["pipeline"], labels["source"], labels["line"], labels["class"],
                      labels["direction"]): v
                     for (name, raw), v in samples.items() if name == "pipeline_line_crossings_total"
                     for labels in [dict(raw)]}
        assert crossings == {("pipeline0", "cam", *key): n for key, n in {
            ("gate", "bicycle", "in"): 1, ("gate", "person", "in"): 1, ("gate", "car", "out"): 1,
            ("gate", "bicycle", "out"): 0, ("gate", "person", "out"): 0, ("gate", "car", "in"): 0,
        }.items()}
        person = {"source": "cam", "zone": "dock", "class": "person"}
        assert value(samples, "pipeline_zone_events_total", kind="enter", **person) == 3
        # track 10 exited once (frames 8-9); track 11, lost after frame 4, exited on frame 6
        assert value(samples, "pipeline_zone_events_total", kind="exit", **person) == 2
        assert value(samples, "pipeline_zone_objects", **person) == 1  # track 10, back inside
        run(stage, frame_rows(TRACKS, FRAMES)[13:])
        samples = metrics.scrape()
        assert value(samples, "pipeline_zone_objects", **person) == 0
        assert value(samples, "pipeline_zone_events_total", kind="exit", **person) == 3


def test_metrics_bind_this_machine_only_unless_configured() -> None:
    exporter = ClusterExporter(0)  # what runtime.metrics_port alone gives
    exporter.update("pipeline0", snapshot(GraphCollector(FakeGraph(["infer"], ["cam"])),
                                          {"pipeline": "pipeline0"}))
    port = exporter.start()
    try:
        assert exporter._server.server_address[0] == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            samples = parse(response.read().decode())
        assert value(samples, "pipeline_source_frames_total", source="cam") == 0
    finally:
        exporter.stop()
    assert RuntimeConfig().metrics_host == "127.0.0.1"


@pytest.mark.parametrize(("host", "token", "error"), [
    ("0.0.0.0", None, "runtime.metrics_token: required when runtime.metrics_host is not a "
                      "loopback address (got '0.0.0.0'); use metrics_token: ${VAR}"),
    ("cam-box.local", None, "runtime.metrics_token: required when runtime.metrics_host is not "
                            "a loopback address (got 'cam-box.local'); use metrics_token: ${VAR}"),
    ("127.0.0.1", " ", "runtime.metrics_token: expected a non-empty token (an unset "
                       "variable?), got ''"),
])
def test_a_non_loopback_bind_without_a_token_is_refused(host: str, token: str | None,
                                                        error: str) -> None:
    with pytest.raises(ValueError) as raised:
        ClusterExporter(0, host, token)
    assert str(raised.value) == error
    with pytest.raises(ConfigError) as refused:
        build_section(RuntimeConfig, {"metrics_port": 9100, "metrics_host": host,
                                      "metrics_token": token}, "runtime")
    assert str(refused.value) == error


@pytest.mark.parametrize("host", ["0.0.0.0", "interface"])
def test_a_non_loopback_bind_serves_only_with_the_token(host: str) -> None:
    host = non_loopback_address() if host == "interface" else host
    target = "127.0.0.1" if host == "0.0.0.0" else host
    build_section(RuntimeConfig, {"metrics_host": host, "metrics_token": "tok-77"}, "runtime")
    exporter = ClusterExporter(0, host, "tok-77")
    exporter.update("pipeline0", snapshot(GraphCollector(FakeGraph(["infer"], ["cam"])),
                                          {"pipeline": "pipeline0"}))
    port = exporter.start()
    url = f"http://{target}:{port}/metrics"
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "tok-77"}):
            with pytest.raises(urllib.error.HTTPError) as denied:
                urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5)
            assert denied.value.code == 401
            assert denied.value.headers["WWW-Authenticate"].startswith("Bearer")
        request = urllib.request.Request(url, headers={"Authorization": "Bearer tok-77"})
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.status == 200
            assert 'pipeline_source_frames_total{pipeline="pipeline0",source="cam"} 0.0' in \
                response.read().decode()
    finally:
        exporter.stop()
