"""PipelineHost: what its reports tell the supervisor (no graph is built: a stand-in graph)."""

from __future__ import annotations

import threading

from pipeline.app.host import PipelineHost, SourceEnded
from pipeline.config import parse_config


class EndingGraph:
    """A graph whose one source ends, and whose run returns, while the host checks it: the
    moment a 150-camera run on the H200 hit (its first source reported cut short)."""

    def __init__(self, host: PipelineHost) -> None:
        self.host = host
        self.source_metrics: dict = {}
        self.ready = threading.Event()
        self.checks = 0

    def source_done(self, name: str) -> bool:
        self.checks += 1
        if self.checks == 1:  # not done at this check, but the run returns right after it
            self.host._finished.set()
            return False
        return True


def test_finished_is_reported_only_with_the_last_source_s_end(samples, monkeypatch):
    config = parse_config({"sources": [{"name": "cam", "uri": str(samples.bikes)}]})
    host = PipelineHost(config, "worker0", 1)
    graph = EndingGraph(host)
    host.graph = graph
    host._running = {"cam": 0.0}
    monkeypatch.setattr(host, "_source_ended",
                        lambda name, added_at: SourceEnded(name, None, True, None, 7, {}))

    first = host.poll()
    assert first.ended == () and not first.finished
    second = host.poll()
    assert [ended.name for ended in second.ended] == ["cam"] and second.finished
    assert host.finished


def test_a_host_whose_thread_fails_before_its_graph_is_built_reports_a_failure(
        samples, monkeypatch) -> None:
    """A module that failed to import in the host's thread (a new user's stray /tmp/http.py
    shadowed the standard library) ended the thread silently, and Pipeline.run() waited for
    ever: the host now reports the failure, and finished."""
    import sys

    config = parse_config({"sources": [{"name": "cam", "uri": str(samples.bikes)}]})
    monkeypatch.setitem(sys.modules, "pipeline.app.prometheus", None)  # its import fails
    host = PipelineHost(config, "worker0", 1)
    host.start()
    host.join(10)
    report = host.poll()
    assert report.finished and report.failure is not None
    assert report.failure.startswith("failed to start: ModuleNotFoundError: import of "
                                     "pipeline.app.prometheus halted")
