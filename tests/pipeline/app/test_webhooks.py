"""WebhookPublisher against a real HTTP server on loopback (tests/support/webhook_receiver.py),
no mocks: delivery in order and exactly once across an outage, the kinds filter, retries
and refusals, the bounded queue, the bounded close, the counters and health reasons."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from pipeline.app import webhooks
from pipeline.app.preview import PreviewHub
from pipeline.app.view import SourceMonitor
from pipeline.app.webhooks import WebhookPublisher
from pipeline.config import WebhookConfig, parse_config
from pipeline.records import AnalyticsEvent
from stages.analytics import AnalyticsStage
from tests.e2e.conftest import pipeline_config
from tests.support.harness import wait_for
from tests.support.metrics import HostMetrics, value
from tests.support.webhook_receiver import WebhookReceiver

KINDS = ("enter", "cross_in", "exit", "cross_out")


def event(frame: int, kind: str | None = None, source: str = "cam") -> dict[str, Any]:
    """The JSON of an analytics event on ``frame`` (kinds rotate through ``KINDS``)."""
    kind = kind or KINDS[frame % len(KINDS)]
    return AnalyticsEvent(source, kind, "gate" if kind.startswith("cross") else "dock", frame,
                          frame / 25, 1_800_000_000 + frame / 25, 7, 0, "person", 0.8125,
                          (10.0, 20.5, 30.0, 40.25), 1.5 if kind == "exit" else None).to_json()


def line(record: dict[str, Any]) -> bytes:
    """``record`` as its line of the events file, without the newline (``EventsWriter``)."""
    return json.dumps(record, separators=(",", ":")).encode()


def free_port() -> int:
    """A loopback port with nothing listening on it (now)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture()
def receivers() -> Iterator[Callable[..., WebhookReceiver]]:
    """``make(answer=None, port=0)``: a started ``WebhookReceiver``, stopped at teardown."""
    made: list[WebhookReceiver] = []

    def make(answer: Any = None, port: int = 0) -> WebhookReceiver:
        receiver = WebhookReceiver(answer, port).start()
        made.append(receiver)
        return receiver

    yield make
    for receiver in made:
        receiver.stop()


@pytest.fixture()
def publishers() -> Iterator[Callable[..., WebhookPublisher]]:
    """``make(*configs)``: a started WebhookPublisher, closed at teardown."""
    made: list[WebhookPublisher] = []

    def make(*configs: WebhookConfig) -> WebhookPublisher:
        publisher = WebhookPublisher(list(configs))
        publisher.start()
        made.append(publisher)
        return publisher

    yield make
    for publisher in made:
        publisher.close()


@pytest.fixture()
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(webhooks, "RETRY_MIN_S", 0.05)


def test_every_event_is_posted_once_in_order_as_its_events_file_line(
        receivers: Callable[..., WebhookReceiver],
        publishers: Callable[..., WebhookPublisher]) -> None:
    receiver = receivers()
    publisher = publishers(WebhookConfig(receiver.url, headers={"Authorization": "Bearer s3"}))
    sent = [event(frame) for frame in range(40)]
    for record in sent:
        publisher.publish_event("cam", record)
    assert receiver.wait_for(40) == sent
    requests = receiver.delivered
    assert [r.body for r in requests] == [line(record) for record in sent]
    assert {r.headers["content-type"] for r in requests} == {"application/json"}
    assert {r.headers["authorization"] for r in requests} == {"Bearer s3"}
    assert {r.path for r in requests} == {"/hook"}
    assert len({r.headers["idempotency-key"] for r in requests}) == 40
    with capture_logs() as logs:
        publisher.close()
    (stats,) = publisher.stats()
    assert (stats.delivered, stats.failed, stats.rejected, stats.dropped, stats.waiting) == \
        (40, 0, 0, 0, 0)
    (summary,) = [e for e in logs if e["event"] == "webhook summary"]
    assert (summary["url"], summary["delivered"], summary["unsent"]) == (receiver.url, 40, 0)
    assert publisher.reasons() == []


def test_the_summary_is_logged_only_where_a_source_came_and_names_its_sources(
        receivers: Callable[..., WebhookReceiver]) -> None:
    """Every source worker builds the publisher whether or not it runs a source with
    analytics (``runtime.workers: 2``: the other worker and the spare never do): one that had
    no source logs no ``webhook summary`` (its zeros read as the run's counts); one whose
    source had only its counts (its first frame, no event) logs its zeros, as real, naming
    it; one that sent events names their sources."""
    receiver = receivers()

    def summaries(publish: Callable[[WebhookPublisher], None]) -> list[dict[str, Any]]:
        publisher = WebhookPublisher([WebhookConfig(receiver.url)])
        publisher.start()
        publish(publisher)
        with capture_logs() as logs:
            publisher.close()
        return [e for e in logs if e["event"] == "webhook summary"]

    assert summaries(lambda publisher: None) == []
    (quiet,) = summaries(lambda publisher: publisher.publish_counts("cam", {}))
    assert (quiet["delivered"], quiet["unsent"], quiet["sources"]) == (0, 0, ["cam"])

    def two_sources(publisher: WebhookPublisher) -> None:
        publisher.publish_counts("yard", {})
        publisher.publish_event("yard", event(0, source="yard"))
        publisher.publish_event("cam", event(1))

    (busy,) = summaries(two_sources)
    assert (busy["url"], busy["delivered"], busy["unsent"], busy["sources"]) == \
        (receiver.url, 2, 0, ["cam", "yard"])


def test_each_endpoint_gets_only_the_kinds_it_asks_for(
        receivers: Callable[..., WebhookReceiver],
        publishers: Callable[..., WebhookPublisher]) -> None:
    lines, zones = receivers(), receivers()
    publisher = publishers(WebhookConfig(lines.url, events=["cross_in", "cross_out"]),
                           WebhookConfig(zones.url, events=["enter"]))
    sent = [event(frame) for frame in range(20)]
    for record in sent:
        publisher.publish_event("cam", record)
    publisher.close()
    assert lines.events() == [e for e in sent if e["kind"] in ("cross_in", "cross_out")]
    assert zones.events() == [e for e in sent if e["kind"] == "enter"]
    # One event, one key: the same event has the same Idempotency-Key at every endpoint.
    assert not {r.headers["idempotency-key"] for r in lines.delivered} & \
        {r.headers["idempotency-key"] for r in zones.delivered}


def test_every_event_arrives_once_in_order_across_a_3_s_outage(
        receivers: Callable[..., WebhookReceiver],
        publishers: Callable[..., WebhookPublisher]) -> None:
    """The receiver is stopped for 3 s while events keep coming, then started again on the
    same port: it gets every event exactly once, in order; while it is down the endpoint is
    a health reason and its failures are counted."""
    receiver = receivers()
    publisher = publishers(WebhookConfig(receiver.url, timeout_s=1.0))
    sent = [event(frame) for frame in range(60)]
    for record in sent[:10]:
        publisher.publish_event("cam", record)
    assert len(receiver.wait_for(10)) == 10
    receiver.stop()
    stopped = time.monotonic()
    for record in sent[10:40]:  # during the outage, every 0.1 s
        publisher.publish_event("cam", record)
        time.sleep(0.1)
    (reason,) = publisher.reasons()
    assert reason.startswith(f"webhook {receiver.url} failing for ") and \
        "connection refused" in reason and "events waiting, 0 dropped" in reason, reason
    (down,) = publisher.stats()
    assert down.failed >= 2 and down.delivered == 10 and down.waiting >= 30
    time.sleep(max(0.0, 3.0 - (time.monotonic() - stopped)))
    receiver.start()
    for record in sent[40:]:
        publisher.publish_event("cam", record)
    received = receiver.wait_for(60)
    assert [e["frame"] for e in received] == list(range(60))
    assert received == sent
    assert [r.status for r in receiver.requests] == [200] * 60  # none taken twice
    publisher.close()  # the last answer counted
    (up,) = publisher.stats()
    assert (up.delivered, up.dropped, up.rejected, up.waiting, up.failing_for_s) == \
        (60, 0, 0, 0, None)
    assert publisher.reasons() == []


def test_a_dead_endpoint_never_blocks_and_keeps_the_newest_events(
        receivers: Callable[..., WebhookReceiver],
        publishers: Callable[..., WebhookPublisher]) -> None:
    """Nothing listens: publishing stays O(1); beyond queue_size the oldest waiting events are
    dropped and counted; once the endpoint is up, the newest arrive."""
    port = free_port()
    publisher = publishers(WebhookConfig(f"http://127.0.0.1:{port}/hook", queue_size=5))
    sent = [event(frame) for frame in range(2000)]
    with capture_logs() as logs:
        started = time.perf_counter()
        for record in sent:
            publisher.publish_event("cam", record)
        took = time.perf_counter() - started
    assert took < 0.5, f"publishing 2000 events took {took:.2f} s"
    (stats,) = publisher.stats()
    assert stats.waiting in (5, 6) and stats.dropped == 2000 - stats.waiting
    assert [e["event"] for e in logs].count(
        "webhook queue full: dropping the oldest events until the endpoint takes them again") == 1
    receiver = receivers(port=port)
    publisher.close()  # the flush tries again at once
    received = receiver.events()
    assert received[-5:] == sent[-5:] and len(received) == stats.waiting
    (stats,) = publisher.stats()
    assert stats.delivered == len(received) and stats.dropped == 2000 - len(received)


def test_close_returns_in_bounded_time_when_the_endpoint_is_down(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(webhooks, "FLUSH_S", 1.0)
    publisher = WebhookPublisher([WebhookConfig(f"http://127.0.0.1:{free_port()}/hook")])
    publisher.start()
    for frame in range(3):
        publisher.publish_event("cam", event(frame))
    with capture_logs() as logs:
        started = time.monotonic()
        publisher.close()
        took = time.monotonic() - started
    assert took < 1.0 + webhooks.JOIN_MARGIN_S + 0.5, took
    (summary,) = [e for e in logs if e["event"] == "webhook summary"]
    assert (summary["delivered"], summary["dropped"], summary["unsent"]) == (0, 0, 3)
    assert summary["failed"] >= 1
    failing = [e for e in logs if e["event"].startswith("webhook failing")]
    assert len(failing) <= 1  # once per reason, never once per attempt


def test_a_5xx_is_sent_again_and_a_4xx_is_not(
        receivers: Callable[..., WebhookReceiver], publishers: Callable[..., WebhookPublisher],
        quick_retries: None) -> None:
    """Frame 3 is answered 503 twice, then 200: it arrives once, after two failed attempts
    with the same Idempotency-Key; frame 5 is answered 400: refused, logged, not sent again,
    and the events behind it go on."""

    def answer(body: bytes, headers: dict[str, str], attempt: int) -> tuple[int, float]:
        frame = json.loads(body)["frame"]
        if frame == 3 and attempt <= 2:
            return 503, 0.0
        return (400 if frame == 5 else 200), 0.0

    receiver = receivers(answer)
    publisher = publishers(WebhookConfig(receiver.url))
    with capture_logs() as logs:
        for frame in range(8):
            publisher.publish_event("cam", event(frame))
        received = receiver.wait_for(7)
        publisher.close()
    assert [e["frame"] for e in received] == [0, 1, 2, 3, 4, 6, 7]
    third = [r for r in receiver.requests if r.event["frame"] == 3]
    assert [r.status for r in third] == [503, 503, 200]
    assert len({r.headers["idempotency-key"] for r in third}) == 1
    assert [r.status for r in receiver.requests if r.event["frame"] == 5] == [400]
    (stats,) = publisher.stats()
    assert (stats.delivered, stats.failed, stats.rejected) == (7, 2, 1)
    refused = [e for e in logs if e["event"].startswith("webhook refused")]
    assert [e["reason"] for e in refused] == ["HTTP 400 Bad Request"]


def test_a_request_that_times_out_is_sent_again_with_the_same_key(
        receivers: Callable[..., WebhookReceiver], publishers: Callable[..., WebhookPublisher],
        quick_retries: None) -> None:
    """The first answer comes after timeout_s: the request counts as failed and goes again.
    The receiver did take the first one: the one case of a repeat, which it can drop by its
    Idempotency-Key."""
    receiver = receivers(lambda body, headers, attempt: (
        200, 0.6 if attempt == 1 and json.loads(body)["frame"] == 0 else 0.0))
    publisher = publishers(WebhookConfig(receiver.url, timeout_s=0.2))
    with capture_logs() as logs:
        publisher.publish_event("cam", event(0))
        publisher.publish_event("cam", event(1))
        publisher.close()
    received = receiver.wait_for(3)
    assert sorted(e["frame"] for e in received) == [0, 0, 1]
    keys = {r.event["frame"]: set() for r in receiver.delivered}
    for request in receiver.delivered:
        keys[request.event["frame"]].add(request.headers["idempotency-key"])
    assert len(keys[0]) == 1 and keys[0] != keys[1]
    (stats,) = publisher.stats()
    assert stats.failed == 1 and stats.delivered == 2
    (failing,) = [e for e in logs if e["event"].startswith("webhook failing")]
    assert failing["reason"] == "no answer in time (ReadTimeout)"


def test_publishing_after_close_is_ignored(receivers: Callable[..., WebhookReceiver]) -> None:
    receiver = receivers()
    publisher = WebhookPublisher([WebhookConfig(receiver.url)])
    publisher.start()
    publisher.publish_event("cam", event(0))
    publisher.close()
    publisher.publish_event("cam", event(1))
    publisher.close()  # a second close does nothing
    assert [e["frame"] for e in receiver.events()] == [0]


def test_a_failing_endpoint_is_a_health_reason_and_in_the_metrics_until_it_delivers(
        samples, tmp_path, receivers: Callable[..., WebhookReceiver],
        publishers: Callable[..., WebhookPublisher], quick_retries: None) -> None:
    """The publisher as a graph's analytics stage holds it: the live view's health
    (``SourceMonitor``) and the Prometheus metrics (``GraphCollector``) show the endpoint
    failing while it answers 503, and ok once it takes the event."""
    from tests.pipeline.app.test_prometheus import FakeGraph as MetricsGraph
    from tests.pipeline.app.test_view import FakeGraph as ViewGraph

    status = {"now": 503}
    receiver = receivers(lambda body, headers, attempt: (status["now"], 0.0))
    publisher = publishers(WebhookConfig(receiver.url))
    stage = AnalyticsStage("analytics", {}, None, {}, [publisher])
    view_graph, metrics_graph = ViewGraph(["cam"]), MetricsGraph(["analytics"], ["cam"])
    view_graph.chain = [*view_graph.chain, stage]
    metrics_graph.chain = [stage]
    config = parse_config(pipeline_config(samples, tmp_path, [
        {"name": "cam", "uri": str(samples.bikes)}]))
    monitor = SourceMonitor(view_graph, PreviewHub(), config)
    url = receiver.url
    with HostMetrics(metrics_graph) as served:
        assert monitor.health()["status"] == "ok"
        assert value(served.scrape(), "pipeline_webhook_failing", url=url) == 0
        publisher.publish_event("cam", event(0))
        wait_for(lambda: publisher.stats()[0].failed >= 2, "two failed attempts", 10)
        health = monitor.health()
        (reason,) = health["reasons"]
        assert health["status"] == "degraded" and reason.startswith(f"webhook {url} failing for ")
        assert reason.endswith("s (HTTP 503 Service Unavailable); 1 events waiting, 0 dropped")
        scraped = served.scrape()
        assert value(scraped, "pipeline_webhook_failing", url=url) == 1
        assert value(scraped, "pipeline_webhook_waiting", url=url) == 1
        assert value(scraped, "pipeline_webhook_failed_total", url=url) >= 2
        assert value(scraped, "pipeline_webhook_delivered_total", url=url) == 0
        status["now"] = 200
        wait_for(lambda: publisher.stats()[0].delivered == 1, "the delivery", 10)
        assert monitor.health()["status"] == "ok"
        scraped = served.scrape()
        assert [value(scraped, f"pipeline_webhook_{name}", url=url)
                for name in ("failing", "waiting", "delivered_total", "dropped_total")] == \
            [0, 0, 1, 0]
