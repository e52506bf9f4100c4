"""pipeline.app.cluster_metrics: the metrics of several pipelines merged on one endpoint."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pipeline.app.cluster_metrics import ClusterExporter, FamilySnapshot, merge, snapshot


class Fixed:
    """A collector of one counter and one gauge for ``source``."""

    def __init__(self, source: str, frames: int) -> None:
        self.source, self.frames = source, frames

    def collect(self):
        counter = CounterMetricFamily("pipeline_source_frames", "Frames.", labels=["source"])
        counter.add_metric([self.source], self.frames)
        gauge = GaugeMetricFamily("pipeline_source_fps", "Fps.", labels=["source"])
        gauge.add_metric([self.source], 2.5)
        yield from (counter, gauge)


def test_snapshots_of_two_pipelines_merge_into_one_family_each_with_their_labels():
    first = snapshot(Fixed("a", 10), {"pipeline": "gpu0", "run": "0"})
    second = snapshot(Fixed("b", 7), {"pipeline": "gpu1", "run": "1"})
    assert first[0] == FamilySnapshot("pipeline_source_frames", "counter", "Frames.", (
        ("pipeline_source_frames_total", (("pipeline", "gpu0"), ("run", "0"), ("source", "a")),
         10.0),))
    merged = {family.name: family for family in merge([first, second])}
    assert sorted(merged) == ["pipeline_source_fps", "pipeline_source_frames"]
    assert [(s.labels["pipeline"], s.labels["source"], s.value)
            for s in merged["pipeline_source_frames"].samples] == [("gpu0", "a", 10.0),
                                                                   ("gpu1", "b", 7.0)]


def test_a_snapshot_type_is_validated():
    with pytest.raises(ValueError, match="type must be one of"):
        FamilySnapshot("x", "countr", "", ())


def test_one_endpoint_serves_every_pipeline():
    exporter = ClusterExporter(0, "127.0.0.1")
    exporter.update("gpu0", snapshot(Fixed("a", 10), {"pipeline": "gpu0", "run": "0"}))
    exporter.update("gpu1", snapshot(Fixed("b", 7), {"pipeline": "gpu1", "run": "1"}))
    port = exporter.start()
    try:
        exporter.update("gpu1", snapshot(Fixed("b", 9), {"pipeline": "gpu1", "run": "1"}))
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        exporter.stop()
    assert text.count("# TYPE pipeline_source_frames_total counter") == 1
    assert 'pipeline_source_frames_total{pipeline="gpu0",run="0",source="a"} 10.0' in text
    assert 'pipeline_source_frames_total{pipeline="gpu1",run="1",source="b"} 9.0' in text
