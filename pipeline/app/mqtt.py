"""The analytics on MQTT (paho-mqtt): events, counts and availability, never stalling the run.

Topics (``prefix`` is ``output.mqtt.topic_prefix``):

- ``<prefix>/<source>/events``: one JSON message per event, QoS 1, in publish order;
- ``<prefix>/<source>/counts``: the source's latest counts, JSON, QoS 1, retained;
- ``<prefix>/<source>/<zone or line>/snapshot``: the JPEG bytes of the latest event's
  snapshot there (``output.event_media``), QoS 1, retained (as Frigate does); only the latest
  of each topic waits;
- ``<prefix>/availability``: ``online`` (retained) once connected, ``offline`` (retained)
  on ``close()``, and the same ``offline`` as the last will, which the broker publishes
  when the process dies or the connection is lost without a goodbye.

How it keeps the pipeline going: ``publish_event`` and ``publish_counts`` only append to a
queue under a lock (O(1), no I/O). One thread, ``mqtt-publisher``, owns the paho client: it
connects, reconnects with backoff while the broker is away (a wrong host name, a refused
login or an untrusted certificate is logged once, with its reason, and retried), encodes
the messages and hands them to paho.

Delivery is at least once, within a bound:

- Waiting events: at most ``queue_size``; when full, the oldest waiting one is dropped and
  counted (``dropped``), so the newest are kept.
- Handed to paho and not yet acknowledged: at most ``MAX_IN_FLIGHT`` messages. Paho keeps
  every QoS 1 message until its PUBACK and resends it (with DUP set) right after each
  reconnect, so a message written just before the broker went away is not lost; a message
  the broker did get but whose PUBACK was lost arrives twice. The client connects with a
  clean session: it subscribes to nothing and its unacknowledged messages live in the
  client, so the broker has no session state to keep for it (and a broker restarted
  without its database loses nothing of ours). At most ``queue_size + MAX_IN_FLIGHT``
  events are held in memory.
- Counts: only the latest of each source waits (a newer one replaces it); retained, so a
  subscriber that comes later gets the latest.
- Order: events reach the broker in publish order. New messages are handed to paho only
  between its network loop calls, and paho resends the unacknowledged ones inside the call
  that reads the broker's CONNACK, so after a reconnect the resent ones go first.

Logs: one line per connect, disconnect, change of connection failure, first overflow of an
outage and close; never one per message. The password is never logged, nor shown by
``repr``.
"""

from __future__ import annotations

import json
import random
import socket
import ssl
import threading
import time
from typing import Any

import paho.mqtt.client as mqtt
import structlog

from pipeline.config import ConfigError, MqttConfig
from pipeline.queues import Backlog

log = structlog.get_logger("mqtt")

MAX_IN_FLIGHT = 20  # messages handed to paho and not yet acknowledged by the broker
RECONNECT_MIN_S = 0.5  # first wait before reconnecting; doubles per failure (50-100% jitter)
RECONNECT_MAX_S = 10.0
CONNECT_TIMEOUT_S = 5.0  # TCP connect and TLS handshake of one attempt
POLL_S = 0.05  # network loop timeout: how long a new message may wait to be handed to paho
FLUSH_S = 2.0  # close(): time to deliver what waits (and to reconnect for it)
GOODBYE_S = 1.0  # close(): time for "offline" to be acknowledged before disconnecting
AVAILABILITY_ONLINE = "online"
AVAILABILITY_OFFLINE = "offline"

_EVENT, _COUNTS, _AVAILABILITY, _SNAPSHOT = "event", "counts", "availability", "snapshot"


class MqttPublisher:
    """Publishes each source's analytics events and counts to an MQTT broker.

    Safe to call from any thread; nothing here blocks on the network or raises because of
    it. ``start()`` before publishing (messages published earlier wait in the queue),
    ``close()`` at the end.

    Args:
        config: the broker and topics (``output.mqtt``).
        sources: names of the sources whose analytics are published; events and counts of
            other sources are ignored (logged once per source).

    Raises:
        ConfigError: a topic prefix, host or credential combination that cannot work, or a
            TLS CA file that cannot be loaded (one line naming the key).

    Attributes:
        dropped: events dropped because the queue was full (the oldest waiting ones).
        published: events the broker acknowledged (PUBACK).
    """

    def __init__(self, config: MqttConfig, sources: list[str]) -> None:
        _check_config(config)
        if bad := [source for source in sources if not _is_topic_level(source)]:
            raise ConfigError(f"sources: {bad[0]!r} cannot be an MQTT topic level (empty, or "
                              "with '/', '+', '#' or NUL)")
        self._config = config
        prefix = config.topic_prefix
        self.availability_topic = f"{prefix}/availability"
        self._event_topics = {source: f"{prefix}/{source}/events" for source in sources}
        self._counts_topics = {source: f"{prefix}/{source}/counts" for source in sources}
        self.published = 0

        # Shared with the callers (under _lock): what waits to be handed to paho.
        self._lock = threading.Lock()
        self._waiting_events = Backlog(config.queue_size)  # (topic, event dict)
        self._waiting_counts: dict[str, Any] = {}  # topic -> the latest counts dict
        self._waiting_snapshots: dict[str, bytes] = {}  # topic -> the latest JPEG
        self._prefix = prefix
        self._unknown_sources: set[str] = set()

        # The publisher thread's own state.
        self._in_flight: dict[int, str] = {}  # message id -> _EVENT, _COUNTS or _AVAILABILITY
        self._connected = False  # CONNACK received, not disconnected since
        self._failed_attempts = 0
        self._last_failure: str | None = None
        self._encode_errors = 0

        self._closing = threading.Event()
        self._flush_deadline = 0.0
        self._thread: threading.Thread | None = None
        self._client = self._make_client(config)

    def __repr__(self) -> str:
        config = self._config
        return (f"MqttPublisher(host={config.host!r}, port={config.port}, tls={config.tls}, "
                f"username={config.username!r}, client_id={config.client_id!r})")

    # -- the callers' side ------------------------------------------------------------------
    def start(self) -> None:
        """Start connecting in the background; returns at once, whether or not the broker
        is up. A second call does nothing."""
        if self._thread is not None or self._closing.is_set():
            return
        config = self._config
        self._client.connect_async(config.host, config.port, keepalive=config.keepalive_s)
        self._thread = threading.Thread(target=self._run, name="mqtt-publisher", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        """Events dropped because ``queue_size`` were waiting (the oldest waiting ones)."""
        return self._waiting_events.dropped

    def publish_event(self, source: str, event: dict) -> None:
        """Queue one event of ``source`` for ``<prefix>/<source>/events`` (JSON, QoS 1).

        Non-blocking and O(1): the dict is encoded later, in the publisher's thread, so it
        must not be changed after this call. When ``queue_size`` events already wait, the
        oldest waiting one is dropped and counted in ``dropped``. Ignored after ``close()``.
        """
        topic = self._event_topics.get(source)
        if topic is None:
            self._unknown_source(source)
            return
        if self._closing.is_set():
            return
        with self._lock:
            first_overflow = self._waiting_events.append((topic, event))
        if first_overflow:
            log.warning("mqtt queue full: dropping the oldest events until the broker is back",
                        queue_size=self._config.queue_size)

    def publish_counts(self, source: str, counts: dict) -> None:
        """Queue the counts of ``source`` for ``<prefix>/<source>/counts`` (JSON, QoS 1,
        retained), replacing counts of that source that still wait. Non-blocking; the dict
        must not be changed after this call. Ignored after ``close()``."""
        topic = self._counts_topics.get(source)
        if topic is None:
            self._unknown_source(source)
            return
        if self._closing.is_set():
            return
        with self._lock:
            self._waiting_counts[topic] = counts

    def publish_snapshot(self, source: str, region: str, jpeg: bytes) -> None:
        """Queue an event's snapshot for ``<prefix>/<source>/<region>/snapshot`` (the JPEG
        bytes, QoS 1, retained), replacing one of that topic that still waits. Non-blocking;
        ignored after ``close()``."""
        if source not in self._counts_topics:
            self._unknown_source(source)
            return
        if self._closing.is_set():
            return
        with self._lock:
            self._waiting_snapshots[f"{self._prefix}/{source}/{region}/snapshot"] = jpeg

    def close(self) -> None:
        """Deliver what waits for up to ``FLUSH_S`` seconds, publish ``offline`` to the
        availability topic and disconnect cleanly (no last will). Returns within about
        ``FLUSH_S + GOODBYE_S`` seconds, also when the broker is down; events still
        undelivered then are logged as a count."""
        if self._closing.is_set():
            return
        self._flush_deadline = time.monotonic() + FLUSH_S
        self._closing.set()
        if self._thread is not None:
            self._thread.join(FLUSH_S + GOODBYE_S + 0.5)
            if self._thread.is_alive():  # stuck in one connection attempt; a daemon thread
                log.warning("mqtt publisher still connecting at close; left to time out",
                            host=self._config.host, port=self._config.port)
        with self._lock:
            unsent = len(self._waiting_events)
        unsent += sum(kind == _EVENT for kind in list(self._in_flight.values()))
        log.info("mqtt closed", published=self.published, dropped=self.dropped, unsent=unsent)

    def _unknown_source(self, source: str) -> None:
        if source not in self._unknown_sources:
            self._unknown_sources.add(source)
            log.error("mqtt: not one of the publisher's sources; its messages are ignored",
                      source=source, sources=sorted(self._event_topics))

    # -- the publisher thread -----------------------------------------------------------------
    def _make_client(self, config: MqttConfig) -> mqtt.Client:
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=config.client_id,
                             clean_session=True, protocol=mqtt.MQTTv311)
        client.connect_timeout = CONNECT_TIMEOUT_S
        # Unlimited in paho: our own window (MAX_IN_FLIGHT) bounds it, and paho's limit would
        # hold messages back in a state that its resend after a reconnect stops at.
        client.max_inflight_messages_set(0)
        client.will_set(self.availability_topic, AVAILABILITY_OFFLINE, qos=1, retain=True)
        if config.username is not None:
            client.username_pw_set(config.username, config.password)
        if config.tls:
            try:
                client.tls_set(ca_certs=config.ca_file)
            except (OSError, ValueError) as error:
                reason = getattr(error, "strerror", None) or error
                raise ConfigError(f"output.mqtt.ca_file: cannot load {config.ca_file!r} as CA "
                                  f"certificates: {reason}") from None
        elif config.ca_file is not None:
            log.warning("output.mqtt.ca_file is set but tls is false: connecting without TLS")
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_publish = self._on_publish
        return client

    def _run(self) -> None:
        """The thread: connect, serve the connection until it ends, wait, again; until
        closed and flushed (or out of flush time)."""
        while not self._done():
            try:
                self._client.reconnect()  # blocking TCP connect (+ TLS), then sends CONNECT
                if self._serve_connection():
                    return
            except OSError as error:
                self._connection_broken(str(error) if self._connected
                                        else describe_connect_error(error, self._config))
            except Exception as error:  # an error paho did not turn into a code: never fatal
                self._connection_broken(f"{type(error).__name__}: {error}")
            if self._done():
                return
            self._wait_before_reconnect()

    def _serve_connection(self) -> bool:
        """Run paho's network loop and hand waiting messages over until the connection ends
        (False) or close() is done with it (True)."""
        while True:
            if self._client.loop(timeout=POLL_S) != mqtt.MQTT_ERR_SUCCESS:
                return False  # connection ended or refused; the callbacks have logged it
            self._hand_over()
            if self._done():
                if self._connected:
                    self._say_goodbye()
                else:
                    self._client.disconnect()
                return True

    def _hand_over(self) -> None:
        """Give paho the waiting counts, then events, while connected and the window has
        room."""
        while self._connected and len(self._in_flight) < MAX_IN_FLIGHT:
            with self._lock:
                if self._waiting_counts:
                    topic = next(iter(self._waiting_counts))
                    body, kind = self._waiting_counts.pop(topic), _COUNTS
                elif self._waiting_events:
                    (topic, body), kind = self._waiting_events.popleft(), _EVENT
                elif self._waiting_snapshots:
                    topic = next(iter(self._waiting_snapshots))
                    body, kind = self._waiting_snapshots.pop(topic), _SNAPSHOT
                else:
                    return
            if kind == _SNAPSHOT:
                info = self._client.publish(topic, body, qos=1, retain=True)
                self._in_flight[info.mid] = kind
                continue
            try:
                payload = json.dumps(body, separators=(",", ":"), default=_json_value)
            except (TypeError, ValueError) as error:
                self._encode_errors += 1
                if self._encode_errors == 1:
                    log.error("mqtt: a message is not JSON-serialisable; such messages are "
                              "skipped", topic=topic, error=str(error))
                continue
            info = self._client.publish(topic, payload, qos=1, retain=kind == _COUNTS)
            self._in_flight[info.mid] = kind  # rc NO_CONN: paho keeps it and sends it later

    def _say_goodbye(self) -> None:
        """Publish ``offline`` (retained), wait briefly for its PUBACK, disconnect."""
        info = self._client.publish(self.availability_topic, AVAILABILITY_OFFLINE, qos=1,
                                    retain=True)
        deadline = time.monotonic() + GOODBYE_S
        while not info.is_published() and time.monotonic() < deadline:
            if self._client.loop(timeout=POLL_S) != mqtt.MQTT_ERR_SUCCESS:
                return
        self._client.disconnect()

    def _done(self) -> bool:
        """Closing, and nothing is left to deliver or the flush time is up."""
        if not self._closing.is_set():
            return False
        if time.monotonic() >= self._flush_deadline:
            return True
        with self._lock:
            waiting = bool(self._waiting_events or self._waiting_counts
                           or self._waiting_snapshots)
        return not waiting and not self._in_flight

    def _wait_before_reconnect(self) -> None:
        nominal = min(RECONNECT_MAX_S, RECONNECT_MIN_S * 2 ** min(self._failed_attempts, 16))
        delay = nominal * random.uniform(0.5, 1.0)
        self._failed_attempts += 1
        if self._closing.is_set():  # flushing: try again until the flush time is up
            time.sleep(max(0.0, min(delay, self._flush_deadline - time.monotonic())))
        else:
            self._closing.wait(delay)

    def _note_failure(self, reason: str) -> None:
        """Log a failed connection attempt, once per distinct reason."""
        if reason != self._last_failure:
            self._last_failure = reason
            log.warning("mqtt connection failed; retrying with backoff", host=self._config.host,
                        port=self._config.port, reason=reason, max_wait_s=RECONNECT_MAX_S)

    def _connection_broken(self, reason: str) -> None:
        if self._connected:
            self._connected = False
            log.warning("mqtt disconnected", reason=reason)
        else:
            self._note_failure(reason)

    # -- paho callbacks (run in the publisher thread, inside client.loop) ---------------------
    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: mqtt.ConnectFlags,
                    reason_code: Any, properties: Any) -> None:
        if reason_code.is_failure:
            self._note_failure(f"refused by the broker: {reason_code}")
            return
        self._connected = True
        self._failed_attempts = 0
        self._last_failure = None
        with self._lock:
            waiting = self._waiting_events.caught_up()
        log.info("mqtt connected", host=self._config.host, port=self._config.port,
                 tls=self._config.tls, waiting=waiting, resending=len(self._in_flight),
                 dropped=self.dropped)
        if _AVAILABILITY not in self._in_flight.values():  # else paho resends the earlier one
            info = client.publish(self.availability_topic, AVAILABILITY_ONLINE, qos=1,
                                  retain=True)
            self._in_flight[info.mid] = _AVAILABILITY

    def _on_disconnect(self, client: mqtt.Client, userdata: Any,
                       flags: mqtt.DisconnectFlags, reason_code: Any, properties: Any) -> None:
        if not self._connected:
            return  # a refused or unfinished connect: already logged as a failure
        self._connected = False
        with self._lock:
            waiting = len(self._waiting_events)
        if self._closing.is_set():
            log.info("mqtt disconnected", host=self._config.host, port=self._config.port)
        else:
            # MQTT 3.1.1 brokers send no reason: any end we did not ask for is a lost link.
            log.warning("mqtt connection lost; queueing until the broker is back",
                        host=self._config.host, port=self._config.port, waiting=waiting,
                        unacknowledged=len(self._in_flight))

    def _on_publish(self, client: mqtt.Client, userdata: Any, mid: int, reason_code: Any,
                    properties: Any) -> None:
        if self._in_flight.pop(mid, None) == _EVENT:
            self.published += 1


def describe_connect_error(error: OSError, config: MqttConfig) -> str:
    """One line saying why connecting to the broker of ``config`` failed (no credentials)."""
    where = f"{config.host}:{config.port}"
    if isinstance(error, socket.gaierror):
        return f"cannot resolve host name {config.host!r} ({error.strerror})"
    if isinstance(error, ConnectionRefusedError):
        return f"connection to {where} refused (no broker listening there)"
    if isinstance(error, TimeoutError):
        return f"no answer from {where} within {CONNECT_TIMEOUT_S:g} s"
    if isinstance(error, ssl.SSLCertVerificationError):
        return f"TLS: the broker's certificate is not trusted ({error.verify_message})"
    if isinstance(error, ssl.SSLError):
        return f"TLS handshake with {where} failed ({error.reason or error})"
    return f"cannot connect to {where} ({error.strerror or error})"


def _check_config(config: MqttConfig) -> None:
    """Raise ConfigError for settings that could never connect or publish."""
    if not config.host or any(c.isspace() for c in config.host):
        raise ConfigError(f"output.mqtt.host: expected a host name or address, got "
                          f"{config.host!r}")
    if config.password is not None and config.username is None:
        raise ConfigError("output.mqtt.password: set output.mqtt.username too (MQTT sends a "
                          "password only with a user name)")
    if not all(_is_topic_level(level) for level in config.topic_prefix.split("/")):
        raise ConfigError(f"output.mqtt.topic_prefix: expected topic levels separated by '/', "
                          f"none empty or with '+', '#' or NUL, got {config.topic_prefix!r}")


def _is_topic_level(level: str) -> bool:
    """Whether ``level`` can be one level of a topic published to (no wildcard, no '/')."""
    return bool(level) and not any(c in level for c in "+#/\0")


def _json_value(value: Any) -> Any:
    """JSON for what json does not know: NumPy arrays and scalars (``tolist``)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")
