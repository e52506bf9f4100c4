"""A graph's Prometheus metrics served as a run serves them, and scrapes parsed.

A run's pipeline host reads its graph with ``GraphCollector`` and sends a snapshot
(``cluster_metrics.snapshot``, labelled ``pipeline="pipeline0"``) to the supervisor, whose
``ClusterExporter`` serves it (``pipeline.app.host.PipelineHost._snapshot``). ``HostMetrics``
does the same in one process, taking a fresh snapshot before each scrape instead of once a
second.
"""

from __future__ import annotations

import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pipeline.app.cluster_metrics import ClusterExporter, snapshot
from pipeline.app.prometheus import GraphCollector, LatencyHistogram

HOST = "pipeline0"  # a run of one pipeline has one host, pipeline0

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class HostMetrics:
    """``graph``'s metrics served by a ``ClusterExporter`` on a free loopback port.

    Args:
        graph: a ``pipeline.graph.Graph`` (or what ``GraphCollector`` reads of one).
        latency: the histogram the graph's ``on_batch_done`` feeds (a fresh one by default).
    """

    def __init__(self, graph: Any, latency: LatencyHistogram | None = None) -> None:
        self.latency = latency if latency is not None else LatencyHistogram()
        self.collector = GraphCollector(graph, self.latency)
        self.exporter = ClusterExporter(0, "127.0.0.1")
        self.port = 0

    def __enter__(self) -> HostMetrics:
        self.port = self.exporter.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.exporter.stop()

    def text(self) -> str:
        """The /metrics page after the host's next snapshot."""
        self.exporter.update(HOST, snapshot(self.collector, {"pipeline": HOST}))
        url = f"http://127.0.0.1:{self.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read().decode()

    def scrape(self) -> Samples:
        return parse(self.text())


def parse(text: str) -> Samples:
    """Every sample as {(sample name, sorted labels): value}."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The sample ``name`` of host pipeline0 with ``labels``, or None."""
    return samples.get((name, tuple(sorted({"pipeline": HOST, **labels}.items()))))
