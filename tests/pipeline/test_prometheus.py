"""The Prometheus exporter on a real graph, scraped over HTTP on loopback while it runs."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.graph import Graph
from pipeline.prometheus import PrometheusExporter
from pipeline.records import Frame
from pipeline.stage import Stage
from tests.pipeline.test_graph import ListSink, ListSource


class Gate(Stage):
    """Holds the first frame until ``opened`` is set, so the queues behind it fill up."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.opened = threading.Event()

    def process(self, item: Frame) -> Iterable[Frame]:
        self.opened.wait(10)
        return (item,)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics as {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_metrics_while_running_and_after_the_end():
    sources = [ListSource("cam", 20, live=True), ListSource("file", 10)]
    gate = Gate("gate")
    sinks = {s.name: ListSink(f"sink:{s.name}") for s in sources}
    exporter = PrometheusExporter(0, "127.0.0.1")
    graph = Graph(sources, [gate], sinks, queue_size=2, on_frame_done=exporter.observe_frame)
    port = exporter.start(graph)
    runner = threading.Thread(target=graph.run)
    runner.start()
    try:
        # Held at the gate: the live camera drops its oldest frames, the file source waits.
        wait_for(lambda: (value(scrape(port), "pipeline_source_dropped_frames_total",
                                source="cam") or 0) >= 15)
        held = scrape(port)
        assert value(held, "pipeline_queue_depth", queue="gate") == 4  # both lanes full
        assert value(held, "pipeline_source_dropped_frames_total", source="file") == 0
        assert value(held, "pipeline_source_frames_total", source="file") == 0
        time.sleep(0.1)  # the frames held here are at least 0.1 s late
        gate.opened.set()
        runner.join(10)
        assert not runner.is_alive()
        done = scrape(port)
    finally:
        gate.opened.set()
        exporter.stop()
    cam_frames = len(sinks["cam"].frames)
    dropped = graph.source_metrics["cam"].dropped
    assert cam_frames + dropped == 20 and dropped >= 15
    expected = {
        ("pipeline_stage_frames_total", "stage", "sink:file"): 10,
        ("pipeline_stage_frames_total", "stage", "sink:cam"): cam_frames,
        ("pipeline_stage_frames_total", "stage", "gate"): graph.stage_metrics["gate"].frames,
        ("pipeline_source_frames_total", "source", "file"): 10,
        ("pipeline_source_frames_total", "source", "cam"): cam_frames,
        ("pipeline_source_dropped_frames_total", "source", "cam"): dropped,
        ("pipeline_source_reconnects_total", "source", "cam"): 0,
        ("pipeline_frame_latency_seconds_count", "source", "file"): 10,
        ("pipeline_frame_latency_seconds_count", "source", "cam"): cam_frames,
        ("pipeline_queue_depth", "queue", "gate"): 0,
    }
    for (name, label, label_value), want in expected.items():
        assert value(done, name, **{label: label_value}) == want, name
    assert value(done, "pipeline_stage_busy_seconds_total", stage="gate") > 0.0
    assert value(done, "pipeline_source_fps", source="file") > 0.0
    # The file frames held in and before the gate (at least 3) took longer than 0.05 s.
    assert value(done, "pipeline_frame_latency_seconds_bucket", source="file", le="0.05") <= 7
    assert value(done, "pipeline_frame_latency_seconds_bucket", source="file", le="+Inf") == 10
    with pytest.raises(urllib.error.URLError):
        scrape(port)  # stopped: nothing listens any more


def test_a_taken_port_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        exporter = PrometheusExporter(port, "127.0.0.1")
        graph = Graph([ListSource("a", 1)], [Gate("gate")], {"a": ListSink("sink:a")}, 2)
        with pytest.raises(OSError, match=f"runtime.metrics_port: cannot serve metrics on "
                                          f"127.0.0.1:{port}"):
            exporter.start(graph)
