"""Metrics of every pipeline host of a run on one Prometheus endpoint (``runtime.metrics_port``).

Each pipeline host (``pipeline.app.host``: in the ``run.py`` process with one pipeline, else a
process, also in a Ray unit) reads its graph's metrics with ``GraphCollector``
(``pipeline.app.prometheus``) and sends them to the supervisor as plain records
(``FamilySnapshot``: picklable, no prometheus-client objects), every sample labelled with the
host (``pipeline="pipeline0"``, ``"gpu1.worker0"``, ``"unit1.worker0"``): a source moved to
another host continues as a new series there. The supervisor serves the latest snapshot of
every host on one port (``ClusterExporter``), each metric family merged across them, so
``sum by (source) (pipeline_source_frames_total)`` counts a moved source's frames across its
hosts. A host that died keeps its last snapshot until the run ends (counters never fall)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from pipeline.app.prometheus import check_bind, serve, stop_serving

METRIC_TYPES = ("counter", "gauge", "histogram", "summary", "info", "stateset", "unknown")


@dataclass(frozen=True)
class FamilySnapshot:
    """One metric family as read once: ``samples`` are (sample name, labels, value).

    Attributes:
        name: the family's name (``pipeline_source_frames``: counters without ``_total``).
        type: one of ``METRIC_TYPES``.
        documentation: its help text.
        samples: (sample name, labels, value) per sample.
    """

    name: str
    type: str
    documentation: str
    samples: tuple[tuple[str, tuple[tuple[str, str], ...], float], ...]

    def __post_init__(self) -> None:
        if self.type not in METRIC_TYPES:
            raise ValueError(f"FamilySnapshot {self.name!r}: type must be one of "
                             f"{METRIC_TYPES}, got {self.type!r}")


def snapshot(collector: Collector, labels: dict[str, str]) -> list[FamilySnapshot]:
    """Everything ``collector`` yields now, each sample with ``labels`` added."""
    extra = tuple(labels.items())
    return [FamilySnapshot(family.name, family.type, family.documentation,
                           tuple((s.name, (*extra, *sorted(s.labels.items())), float(s.value))
                                 for s in family.samples))
            for family in collector.collect()]


def merge(snapshots: Iterable[Iterable[FamilySnapshot]]) -> list[Metric]:
    """Families of the same name from several snapshots as one family each."""
    merged: dict[str, Metric] = {}
    for families in snapshots:
        for family in families:
            metric = merged.get(family.name)
            if metric is None:
                metric = merged[family.name] = Metric(family.name, family.documentation,
                                                      family.type)
            for name, labels, value in family.samples:
                metric.add_sample(name, dict(labels), value)
    return list(merged.values())


class SnapshotCollector(Collector):
    """Yields the merged families of the snapshots ``supplier()`` returns at scrape time."""

    def __init__(self, supplier: Callable[[], Iterable[Iterable[FamilySnapshot]]]) -> None:
        self.supplier = supplier

    def collect(self) -> Iterator[Metric]:
        yield from merge(self.supplier())


class ClusterExporter:
    """Serves the latest metrics snapshot of every pipeline on one port.

    Args:
        port: TCP port; 0 picks a free one (``start`` returns it).
        addr: address to bind (``runtime.metrics_host``); this machine only by default.
        token: the bearer token requests must carry, or None; required when ``addr`` is not
            loopback (``pipeline.app.prometheus.check_bind``).
    """

    def __init__(self, port: int, addr: str = "127.0.0.1", token: str | None = None) -> None:
        check_bind(addr, token)
        self.port, self.addr, self.token = port, addr, token
        self._latest: dict[str, list[FamilySnapshot]] = {}
        self._lock = threading.Lock()
        self._server: Any = None

    def update(self, pipeline: str, families: list[FamilySnapshot]) -> None:
        """Replace the snapshot of ``pipeline`` (thread-safe)."""
        with self._lock:
            self._latest[pipeline] = families

    def snapshots(self) -> list[list[FamilySnapshot]]:
        with self._lock:
            return list(self._latest.values())

    def start(self) -> int:
        """Start serving; returns the port bound.

        Raises:
            OSError: the port cannot be bound (the message names it).
        """
        registry = CollectorRegistry()
        registry.register(SnapshotCollector(self.snapshots))
        self._server = serve(registry, self.port, self.addr, self.token)
        return int(self._server.server_port)

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        server, self._server = self._server, None
        stop_serving(server)
