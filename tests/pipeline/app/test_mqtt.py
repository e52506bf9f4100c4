"""MqttPublisher against a real mosquitto broker (tests/support/mosquitto.py), no mocks.

A test subscriber (a paho client with a persistent session, QoS 1) records what arrives;
the broker keeps its sessions across stop() and start(), so what the publisher delivers
while the subscriber is still reconnecting waits for it at the broker. Every wait is on a
condition with a timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from structlog.testing import capture_logs

from pipeline.app.mqtt import FLUSH_S, GOODBYE_S, MqttPublisher
from pipeline.config import ConfigError, MqttConfig
from tests.support import MosquittoBroker, require_mosquitto
from tests.support.harness import wait_for
from tests.support.mosquitto import free_loopback_port, make_tls_files

TIMEOUT_S = 15.0  # for any one condition; the tests take far less when they pass
PUBLISHER_PASSWORD = "pub-Secret-7f3a"
SUBSCRIBER_PASSWORD = "sub-Secret-1c9e"


class Subscriber:
    """A paho client subscribed to ``streamdet/#`` at QoS 1 with a persistent session
    (clean_session off), recording every message; reconnects by itself."""

    def __init__(self, broker: MosquittoBroker, client_id: str = "test-subscriber",
                 username: str | None = None, password: str | None = None) -> None:
        self.messages: list[tuple[str, str]] = []  # (topic, payload)
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                             clean_session=False)
        client.reconnect_delay_set(min_delay=0.1, max_delay=0.5)  # type: ignore[arg-type]
        if username is not None:
            client.username_pw_set(username, password)
        client.on_connect = lambda c, *_: c.subscribe("streamdet/#", qos=1)
        client.on_subscribe = lambda *_: self._subscribed.set()
        client.on_message = self._on_message
        client.connect("127.0.0.1", broker.port, keepalive=5)
        client.loop_start()
        self.client = client
        if not self._subscribed.wait(TIMEOUT_S):
            pytest.fail(f"the test subscriber could not subscribe: {broker.log_tail()}")

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        with self._lock:
            self.messages.append((message.topic, message.payload.decode()))

    def payloads(self, topic: str) -> list[str]:
        """Every payload received on ``topic``, in arrival order."""
        with self._lock:
            return [payload for t, payload in self.messages if t == topic]

    def event_numbers(self, source: str = "cam") -> list[int]:
        """The ``n`` of every event of ``source`` received, in arrival order."""
        return [json.loads(p)["n"] for p in self.payloads(f"streamdet/{source}/events")]

    def last(self, topic: str) -> str | None:
        """The latest payload received on ``topic``, or None."""
        payloads = self.payloads(topic)
        return payloads[-1] if payloads else None

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def first_occurrences(numbers: list[int]) -> list[int]:
    """``numbers`` without repeats (QoS 1 may deliver a resent message twice), in order."""
    return list(dict.fromkeys(numbers))


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[MosquittoBroker]:
    """A running anonymous broker on a free loopback port."""
    require_mosquitto()
    broker = MosquittoBroker(tmp_path / "broker")
    broker.start()
    yield broker
    broker.kill()


@pytest.fixture
def subscribers() -> Iterator[list[Subscriber]]:
    """Subscribers a test makes go here and are closed after it."""
    made: list[Subscriber] = []
    yield made
    for subscriber in made:
        subscriber.close()


@pytest.fixture
def publishers() -> Iterator[Callable[..., MqttPublisher]]:
    """``make(port, **config)``: a started MqttPublisher for sources cam and door, closed
    after the test."""
    made: list[MqttPublisher] = []

    def make(port: int, sources: tuple[str, ...] = ("cam", "door"), start: bool = True,
             **config: Any) -> MqttPublisher:
        config.setdefault("client_id", f"test-publisher-{len(made)}")
        publisher = MqttPublisher(MqttConfig(host=config.pop("host", "127.0.0.1"), port=port,
                                             **config), list(sources))
        made.append(publisher)
        if start:
            publisher.start()
        return publisher

    yield make
    for publisher in made:
        publisher.close()


OUTAGE_S = 3.0  # how long the broker-restart test keeps the broker away


def publish_numbered(publisher: MqttPublisher, numbers: range, source: str = "cam") -> float:
    """Publish events ``{"n": i, ...}`` for ``numbers``; returns the slowest call's seconds."""
    slowest = 0.0
    for n in numbers:
        start = time.perf_counter()
        publisher.publish_event(source, {"n": n, "kind": "cross_in", "line": "middle",
                                         "xyxy": [1.5, 2.0, 30.25, 40.0]})
        slowest = max(slowest, time.perf_counter() - start)
    return slowest


@pytest.mark.slow  # a real MQTT broker
def test_a_subscriber_gets_every_event_in_order_and_the_retained_counts_and_availability(
        broker: MosquittoBroker, subscribers: list[Subscriber],
        publishers: Callable[..., MqttPublisher]) -> None:
    subscriber = Subscriber(broker)
    subscribers.append(subscriber)
    publisher = publishers(broker.port)
    publish_numbered(publisher, range(300))
    publisher.publish_event("door", {"n": 0, "kind": "enter", "zone": "kerb"})
    for total in range(1, 6):
        publisher.publish_counts("cam", {"lines": {"middle": {"in": {"person": total}}}})

    wait_for(lambda: publisher.published == 301, "301 acknowledged events")
    wait_for(lambda: len(subscriber.event_numbers()) == 300, "300 events at the subscriber")
    assert subscriber.event_numbers() == list(range(300))
    wait_for(lambda: subscriber.event_numbers("door") == [0], "the event of door")
    expected_counts = {"lines": {"middle": {"in": {"person": 5}}}}
    wait_for(lambda: subscriber.last("streamdet/cam/counts") is not None, "the counts")
    wait_for(lambda: json.loads(subscriber.last("streamdet/cam/counts")) == expected_counts,
             "the latest counts")
    wait_for(lambda: subscriber.last("streamdet/availability") == "online", "online")
    assert publisher.dropped == 0

    # Retained: a subscriber that comes later gets the latest counts and the availability.
    late = Subscriber(broker, client_id="late-subscriber")
    subscribers.append(late)
    wait_for(lambda: late.last("streamdet/availability") == "online", "retained availability")
    wait_for(lambda: late.last("streamdet/cam/counts") is not None, "retained counts")
    assert json.loads(late.last("streamdet/cam/counts")) == expected_counts
    assert late.event_numbers() == []  # events are not retained

    publisher.close()
    wait_for(lambda: subscriber.last("streamdet/availability") == "offline",
             "offline after close()")


@pytest.mark.slow  # a real MQTT broker
def test_events_published_while_the_broker_is_down_at_start_arrive_once_it_is_up(
        broker: MosquittoBroker, subscribers: list[Subscriber],
        publishers: Callable[..., MqttPublisher]) -> None:
    subscribers.append(subscriber := Subscriber(broker))  # its session outlives the stop
    broker.stop()
    publisher = publishers(broker.port)
    slowest = publish_numbered(publisher, range(50))
    publisher.publish_counts("cam", {"zones": {}, "lines": {}})
    assert slowest < 0.05, f"publish_event blocked {slowest:.3f} s with the broker down"
    assert publisher.published == 0

    broker.start()
    wait_for(lambda: publisher.published == 50, "50 acknowledged events after the broker came")
    wait_for(lambda: len(set(subscriber.event_numbers())) == 50, "the 50 events")
    assert first_occurrences(subscriber.event_numbers()) == list(range(50))
    wait_for(lambda: subscriber.last("streamdet/cam/counts") is not None, "the counts")
    assert publisher.dropped == 0


@pytest.mark.slow  # a real MQTT broker
def test_a_broker_restart_mid_stream_loses_no_event(
        broker: MosquittoBroker, subscribers: list[Subscriber],
        publishers: Callable[..., MqttPublisher]) -> None:
    subscribers.append(subscriber := Subscriber(broker))
    publisher = publishers(broker.port)
    wait_for(lambda: subscriber.last("streamdet/availability") == "online", "the publisher")

    publish_numbered(publisher, range(0, 100))  # some still in flight when the broker stops
    broker.stop()
    away = time.monotonic()
    slowest = 0.0
    for start in range(100, 200, 10):  # spread over the broker's absence
        slowest = max(slowest, publish_numbered(publisher, range(start, start + 10)))
        time.sleep(OUTAGE_S / 10)
    away = time.monotonic() - away
    broker.start()
    slowest = max(slowest, publish_numbered(publisher, range(200, 300)))  # after it is back

    # A call that waited for the broker would have waited about as long as it was away
    # (>= OUTAGE_S); the bound leaves room for a loaded machine's scheduling delays.
    assert away >= OUTAGE_S
    assert slowest < OUTAGE_S / 3, f"publish_event blocked {slowest:.3f} s around the restart"
    wait_for(lambda: publisher.published == 300, "300 acknowledged events")
    wait_for(lambda: set(subscriber.event_numbers()) == set(range(300)),
             "every event at the subscriber")
    assert first_occurrences(subscriber.event_numbers()) == list(range(300))
    assert publisher.dropped == 0


@pytest.mark.slow  # a real MQTT broker
def test_overflow_drops_the_oldest_and_counts_exactly_the_overflow(
        broker: MosquittoBroker, subscribers: list[Subscriber],
        publishers: Callable[..., MqttPublisher]) -> None:
    subscribers.append(subscriber := Subscriber(broker))
    broker.stop()
    publisher = publishers(broker.port, queue_size=10)
    publish_numbered(publisher, range(25))
    assert publisher.dropped == 15

    broker.start()
    wait_for(lambda: publisher.published == 10, "the 10 kept events acknowledged")
    wait_for(lambda: len(set(subscriber.event_numbers())) == 10, "the 10 kept events")
    assert first_occurrences(subscriber.event_numbers()) == list(range(15, 25))  # the newest
    assert publisher.dropped == 15


def test_close_with_the_broker_down_returns_within_a_few_seconds(
        publishers: Callable[..., MqttPublisher]) -> None:
    publisher = publishers(free_loopback_port())  # nothing listens there
    publish_numbered(publisher, range(5))
    with capture_logs() as logs:
        start = time.monotonic()
        publisher.close()
        elapsed = time.monotonic() - start
    assert elapsed < FLUSH_S + GOODBYE_S + 1.0, f"close() took {elapsed:.1f} s"
    closed = [entry for entry in logs if entry["event"] == "mqtt closed"]
    assert closed and closed[0]["unsent"] == 5 and closed[0]["published"] == 0


def test_close_without_anything_waiting_is_quick_even_with_the_broker_down(
        publishers: Callable[..., MqttPublisher]) -> None:
    publisher = publishers(free_loopback_port())
    start = time.monotonic()
    publisher.close()
    assert time.monotonic() - start < 1.0


WILL_SCRIPT = """
import sys, threading
from pipeline.config import MqttConfig
from pipeline.app.mqtt import MqttPublisher
publisher = MqttPublisher(MqttConfig(host="127.0.0.1", port=int(sys.argv[1]),
                                     client_id="will-test"), ["cam"])
publisher.start()
threading.Event().wait()
"""


@pytest.mark.slow  # a real MQTT broker
def test_the_last_will_says_offline_when_the_publisher_process_is_killed(
        broker: MosquittoBroker, subscribers: list[Subscriber], repo_root: Path) -> None:
    subscribers.append(subscriber := Subscriber(broker))
    process = subprocess.Popen([sys.executable, "-c", WILL_SCRIPT, str(broker.port)],
                               cwd=repo_root, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: subscriber.last("streamdet/availability") == "online",
                 "online from the publisher process")
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)
        wait_for(lambda: subscriber.last("streamdet/availability") == "offline",
                 "the last will")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    late = Subscriber(broker, client_id="late-subscriber")  # the will is retained
    subscribers.append(late)
    wait_for(lambda: late.last("streamdet/availability") == "offline", "retained offline")


@pytest.mark.slow  # a real MQTT broker
def test_a_login_works_and_the_password_is_never_logged(
        tmp_path: Path, subscribers: list[Subscriber],
        publishers: Callable[..., MqttPublisher]) -> None:
    require_mosquitto()
    users = {"pipeline": PUBLISHER_PASSWORD, "viewer": SUBSCRIBER_PASSWORD}
    with MosquittoBroker(tmp_path / "broker", users=users) as broker:
        subscribers.append(subscriber := Subscriber(broker, username="viewer",
                                                    password=SUBSCRIBER_PASSWORD))
        with capture_logs() as logs:
            refused = publishers(broker.port, username="pipeline", password="wrong-" +
                                 PUBLISHER_PASSWORD, client_id="refused")
            wait_for(lambda: any("refused by the broker" in str(e.get("reason")) for e in logs),
                     "a log line saying the broker refused the login")
            refused.publish_event("cam", {"n": -1})  # queued, never an exception
            refused.close()

            publisher = publishers(broker.port, username="pipeline",
                                   password=PUBLISHER_PASSWORD)
            publish_numbered(publisher, range(3))
            wait_for(lambda: subscriber.event_numbers() == [0, 1, 2], "the events")
            publisher.close()

    assert any(entry["event"] == "mqtt connected" for entry in logs)
    assert refused.published == 0
    shown = repr(logs) + repr(publisher) + repr(refused)
    assert PUBLISHER_PASSWORD not in shown
    assert "pipeline" in repr(publisher)  # the user name is shown, only the password is not


def test_a_wrong_host_name_is_logged_clearly_and_never_raises(
        publishers: Callable[..., MqttPublisher]) -> None:
    with capture_logs() as logs:
        publisher = publishers(1883, host="no-such-broker.invalid")
        publish_numbered(publisher, range(3))
        wait_for(lambda: any("cannot resolve host name 'no-such-broker.invalid'"
                             in str(e.get("reason")) for e in logs),
                 "a log line naming the host that does not resolve")
    failures = [e for e in logs if e["event"].startswith("mqtt connection failed")]
    assert len(failures) == 1 and failures[0]["log_level"] == "warning"


@pytest.mark.slow  # a real MQTT broker
def test_tls_with_the_brokers_ca_and_a_clear_line_for_an_untrusted_certificate(
        tmp_path: Path, subscribers: list[Subscriber],
        publishers: Callable[..., MqttPublisher]) -> None:
    require_mosquitto(tls=True)
    tls_dir = make_tls_files(tmp_path / "tls")
    with MosquittoBroker(tmp_path / "broker", tls_dir=tls_dir) as broker:
        subscribers.append(subscriber := Subscriber(broker))  # on the plain listener
        publisher = publishers(broker.tls_port, tls=True, ca_file=str(tls_dir / "ca.crt"))
        publish_numbered(publisher, range(3))
        wait_for(lambda: subscriber.event_numbers() == [0, 1, 2], "the events over TLS")

        with capture_logs() as logs:  # the system's CAs do not know the test CA
            publishers(broker.tls_port, tls=True, client_id="untrusted")
            wait_for(lambda: any("certificate is not trusted" in str(e.get("reason"))
                                 for e in logs), "a log line about the untrusted certificate")


@pytest.mark.parametrize(("config", "sources", "message"), [
    ({"host": ""}, ["cam"], "output.mqtt.host: expected a host name or address, got ''"),
    ({"password": "x"}, ["cam"], "output.mqtt.password: set output.mqtt.username too"),
    ({"topic_prefix": "site/+/cams"}, ["cam"], "output.mqtt.topic_prefix: expected topic"),
    ({"topic_prefix": "site//cams"}, ["cam"], "output.mqtt.topic_prefix: expected topic"),
    ({}, ["a/b"], "sources: 'a/b' cannot be an MQTT topic level"),
    ({"tls": True, "ca_file": "/nonexistent/ca.crt"}, ["cam"],
     "output.mqtt.ca_file: cannot load '/nonexistent/ca.crt' as CA certificates"),
])
def test_settings_that_cannot_work_are_refused_before_the_run(
        config: dict[str, Any], sources: list[str], message: str) -> None:
    config = {"host": "127.0.0.1", **config}
    with pytest.raises(ConfigError) as caught:
        MqttPublisher(MqttConfig(**config), sources)
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)
