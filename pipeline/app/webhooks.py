"""The analytics events as HTTP POSTs (httpx): one request per event, in order, never stalling
the run.

```
AnalyticsStage ─publish_event(source, event)─> WebhookPublisher
  (any thread; O(1), no I/O)                     │ one WebhookEndpoint per output.webhooks[i]
                                                 ├─> Backlog (queue_size; full: drop the oldest)
                                                 │     └─> thread "webhook:0" ─POST─> url 0
                                                 └─> Backlog ─> thread "webhook:1" ─POST─> url 1
```

Each request carries one event: the body is the event's JSON, byte for byte its line of the
events file (``output.events``) without the newline, with ``Content-Type:
application/json``, an ``Idempotency-Key`` (a UUID per event, the same on every attempt) and
the configured ``headers``. An endpoint gets only the kinds of event in its ``events``.

Delivery, per endpoint, one request at a time in publish order:

- a 2xx answer: delivered (``delivered``), the next event goes;
- no answer (refused, reset, timed out after ``timeout_s``), 5xx, 408 or 429: the attempt
  failed (``failed``, each attempt); the same request goes again after a backoff of
  ``RETRY_MIN_S`` doubling up to ``RETRY_MAX_S`` (50-100 % jitter; a ``Retry-After`` in
  seconds is waited for, up to ``RETRY_MAX_S``), for as long as it takes. The events behind
  it wait, so the order is kept across an outage;
- any other answer (3xx, 4xx): the receiver refuses this very request, and the same bytes
  would be refused again: ``rejected``, logged, and the next event goes.

So an event is sent again only when no 2xx came back for it: after an outage every event
arrives once, in order. The one way it may arrive twice is a request the receiver took whose
answer never came (a timeout): the repeat carries the same ``Idempotency-Key``.

Bounded: at most ``queue_size`` events wait per endpoint; when full, the oldest waiting is
dropped and counted (``dropped``), so a dead endpoint costs the pipeline nothing but that
memory. ``close()`` delivers what waits for up to ``FLUSH_S`` seconds (retrying while the
endpoint is down), then gives up on the rest (``unsent`` in the summary line).

Visible: ``stats()`` (read by ``pipeline.app.prometheus``: the ``pipeline_webhook_*``
metrics), ``reasons()`` (read by ``pipeline.app.view``: a health reason while an endpoint
fails) and, at close, one ``webhook summary`` log line per endpoint, naming the publisher's
sources (those whose frames reached its analytics stage), and only from a publisher that had
a source: every source worker builds one, and with ``runtime.workers: 2`` the other worker
and the spare, which run no source of it, logged lines of zeros read as the run's counts.
Logs: one line per change of failure reason, per recovery and per first overflow of an
outage, never one per event.
URLs are shown with credentials hidden (``redact_url``); headers are never shown.

httpx is imported by the endpoint threads only: the metrics and the view import this module
for its types, and need no httpx where no webhook is configured.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from pipeline.config import WebhookConfig, redact_url
from pipeline.queues import Backlog

if TYPE_CHECKING:
    import httpx

log = structlog.get_logger("webhooks")

RETRY_MIN_S = 0.5  # first wait before sending a failed request again; doubles per failure
RETRY_MAX_S = 5.0  # an endpoint back up gets the waiting events within this
RETRY_STATUSES = frozenset({408, 429})  # client errors that say "later" (and every 5xx)
FLUSH_S = 5.0  # close(): time to deliver what waits (retrying while the endpoint is down)
JOIN_MARGIN_S = 1.0  # close(): beyond FLUSH_S, for the request in flight to end


@dataclass(frozen=True)
class WebhookStats:
    """One endpoint's counters, read at one moment.

    Attributes:
        url: the endpoint's URL, credentials hidden.
        delivered: events answered with a 2xx.
        failed: attempts that got no 2xx and were tried again (no answer, 5xx, 408, 429).
        rejected: events given up because the endpoint refused them (3xx, other 4xx).
        dropped: events dropped unsent because ``queue_size`` events were waiting.
        waiting: events not delivered yet (queued, and the one being sent).
        failing_for_s: seconds since the first of the failures in a row (or the rejection)
            that the last attempt ended, None when the last attempt was delivered.
        last_error: why the last attempt failed, None when it was delivered.
    """

    url: str
    delivered: int
    failed: int
    rejected: int
    dropped: int
    waiting: int
    failing_for_s: float | None
    last_error: str | None


class WebhookEndpoint:
    """One ``output.webhooks`` entry: its queue, its thread and its counters.

    Args:
        config: the endpoint.
        key: its place in the configuration (``output.webhooks[0]``), for the thread's name.
    """

    def __init__(self, config: WebhookConfig, key: str) -> None:
        self.config = config
        self.url = redact_url(config.url)
        self.key = key
        self._kinds = None if config.events is None else frozenset(config.events)
        self.delivered = self.failed = self.rejected = 0

        # Shared with the callers (under _cond): the events waiting, and closing.
        self._cond = threading.Condition()
        self._waiting = Backlog(config.queue_size)  # (idempotency key, event)
        self._closing = False
        self._flush_deadline = 0.0

        # The thread's own state (read by stats() without a lock: plain assignments).
        self._sending: tuple[str, dict[str, Any]] | None = None
        self._failing_since: float | None = None
        self._last_error: str | None = None
        self._logged_error: str | None = None
        self._failures_in_row = 0
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"WebhookEndpoint(url={self.url!r}, events={self.config.events!r})"

    # -- the callers' side ------------------------------------------------------------------
    def start(self) -> None:
        """Start the sending thread; a second call does nothing."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"webhook:{self.key}",
                                        daemon=True)
        self._thread.start()

    def offer(self, event_id: str, event: dict[str, Any]) -> None:
        """Queue ``event`` when its kind is one this endpoint gets (O(1), no I/O); when
        ``queue_size`` events wait, the oldest waiting one is dropped and counted. Ignored
        once closing."""
        if self._kinds is not None and event.get("kind") not in self._kinds:
            return
        with self._cond:
            if self._closing:
                return
            first_overflow = self._waiting.append((event_id, event))
            self._cond.notify()
        if first_overflow:
            log.warning("webhook queue full: dropping the oldest events until the endpoint "
                        "takes them again", url=self.url, queue_size=self.config.queue_size)

    def begin_close(self, deadline: float) -> None:
        """Stop taking events; deliver what waits until ``deadline`` (``time.monotonic``)."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._flush_deadline = deadline
            self._cond.notify_all()

    def finish_close(self, sources: Sequence[str]) -> None:
        """Wait for the thread (until the flush deadline and ``JOIN_MARGIN_S``), then log the
        endpoint's summary line, naming ``sources`` (those of its publisher), when it had a
        source or counted anything: a line of zeros from a publisher that had none (a source
        worker that ran no source with analytics) read as the run's real count."""
        if self._thread is not None:
            self._thread.join(max(0.0, self._flush_deadline - time.monotonic()) + JOIN_MARGIN_S)
            if self._thread.is_alive():  # a request that ignores its timeout; a daemon thread
                log.warning("webhook still sending at close; left to time out", url=self.url)
        stats = self.stats()
        if not sources and not (stats.delivered or stats.failed or stats.rejected
                                or stats.dropped or stats.waiting):
            return
        log.info("webhook summary", url=self.url, delivered=stats.delivered,
                 failed=stats.failed, rejected=stats.rejected, dropped=stats.dropped,
                 unsent=stats.waiting, sources=list(sources))

    def stats(self) -> WebhookStats:
        """The counters now (any thread)."""
        with self._cond:
            waiting = len(self._waiting) + (self._sending is not None)
        since = self._failing_since
        return WebhookStats(self.url, self.delivered, self.failed, self.rejected,
                            self._waiting.dropped, waiting,
                            None if since is None else time.monotonic() - since,
                            self._last_error if since is not None else None)

    # -- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        import httpx

        client = None
        try:
            client = httpx.Client(headers={"User-Agent": "streamdet",
                                           **(self.config.headers or {})},
                                  follow_redirects=False, timeout=self.config.timeout_s)
            while (item := self._next()) is not None:
                if not self._deliver(client, *item):
                    return  # out of flush time: the event stays counted as unsent
        except Exception as error:  # noqa: BLE001 - a webhook never stops the run
            log.error("webhook thread failed; this endpoint gets no more events", url=self.url,
                      error=f"{type(error).__name__}: {error}")
        finally:
            if client is not None:
                client.close()

    def _next(self) -> tuple[str, dict[str, Any]] | None:
        """The next event to send (kept as ``_sending`` until ``_delivered`` or ``_rejected``
        counts it), or None when closing and nothing is left or the flush time is up."""
        with self._cond:
            while not self._waiting:
                if self._closing:
                    return None
                self._cond.wait()
            if self._closing and time.monotonic() >= self._flush_deadline:
                return None
            self._sending = self._waiting.popleft()
            return self._sending

    def _deliver(self, client: httpx.Client, event_id: str, event: dict[str, Any]) -> bool:
        """Send one event until a 2xx or a refusal (True), or until closing runs out of
        time (False)."""
        import httpx

        try:
            body = json.dumps(event, separators=(",", ":"), default=_json_value).encode()
        except (TypeError, ValueError) as error:
            self._rejected(f"not JSON-serialisable: {error}")
            return True
        headers = {"Content-Type": "application/json", "Idempotency-Key": event_id}
        while True:
            timeout = self.config.timeout_s
            if self._closing:
                left = self._flush_deadline - time.monotonic()
                if left <= 0:
                    return False
                timeout = min(timeout, max(left, 0.05))
            retry_after = None
            try:
                response = client.post(self.config.url, content=body, headers=headers,
                                       timeout=timeout)
            except httpx.HTTPError as error:
                reason = describe_error(error)
            else:
                status = response.status_code
                if 200 <= status < 300:
                    self._delivered()
                    return True
                reason = f"HTTP {status} {response.reason_phrase}".strip()
                if status < 500 and status not in RETRY_STATUSES:
                    self._rejected(reason)
                    return True
                retry_after = _seconds(response.headers.get("Retry-After"))
            self._failed(reason)
            self._wait(retry_after)

    def _delivered(self) -> None:
        with self._cond:
            self._sending = None  # no longer waiting
        since, self._failing_since = self._failing_since, None
        self._last_error = self._logged_error = None
        self._failures_in_row = 0
        self.delivered += 1  # last: whoever sees it counted sees it neither failing nor waiting
        if since is not None:
            with self._cond:
                waiting = self._waiting.caught_up()
            log.info("webhook delivering again", url=self.url,
                     failed_for_s=round(time.monotonic() - since, 1),
                     waiting=waiting, dropped=self._waiting.dropped)

    def _failed(self, reason: str) -> None:
        self.failed += 1
        self._failures_in_row += 1
        self._note(reason, "webhook failing; sending again with backoff")

    def _rejected(self, reason: str) -> None:
        with self._cond:
            self._sending = None  # as in _delivered: counted last, the rest already true
        self._failures_in_row = 0
        self._note(reason, "webhook refused an event; it is not sent again")
        self.rejected += 1

    def _note(self, reason: str, message: str) -> None:
        """Mark the endpoint failing; log ``message`` once per distinct reason in a row."""
        if self._failing_since is None:
            self._failing_since = time.monotonic()
        self._last_error = reason
        if reason != self._logged_error:
            self._logged_error = reason
            log.warning(message, url=self.url, reason=reason)

    def _wait(self, retry_after: float | None) -> None:
        """Back off before the next attempt; cut short by ``begin_close`` (the flush tries
        again at once) and never past the flush deadline."""
        nominal = min(RETRY_MAX_S, RETRY_MIN_S * 2 ** min(self._failures_in_row - 1, 16))
        delay = nominal * random.uniform(0.5, 1.0)
        if retry_after is not None:
            delay = max(delay, min(retry_after, RETRY_MAX_S))
        with self._cond:
            if not self._closing:
                self._cond.wait_for(lambda: self._closing, timeout=delay)
                return
        time.sleep(max(0.0, min(delay, self._flush_deadline - time.monotonic())))


class WebhookPublisher:
    """POSTs the analytics events to every endpoint of ``output.webhooks`` (module docstring).

    Has the ``EventPublisher`` interface of ``stages.analytics``: safe to call from any
    thread, nothing blocks on the network or raises because of it. ``start()`` before
    publishing (events published earlier wait in the queues), ``close()`` at the end.

    Args:
        configs: the endpoints (``output.webhooks``), each checked (``WebhookConfig.check``).
    """

    def __init__(self, configs: list[WebhookConfig]) -> None:
        for i, config in enumerate(configs):
            config.check(f"output.webhooks[{i}]")
        self.endpoints = [WebhookEndpoint(config, str(i)) for i, config in enumerate(configs)]
        self._closed = False
        # The sources seen (their first counts or an event): replaced, never changed in place,
        # under _lock, so a caller's test of membership needs no lock.
        self._sources: frozenset[str] = frozenset()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"WebhookPublisher({[endpoint.url for endpoint in self.endpoints]!r})"

    def start(self) -> None:
        """Start every endpoint's thread; returns at once, whether or not they are up."""
        for endpoint in self.endpoints:
            endpoint.start()

    def publish_event(self, source: str, event: dict) -> None:
        """Queue ``event`` (``AnalyticsEvent.to_json()`` of ``source``) for every endpoint that
        gets its kind. Non-blocking and O(1); encoded later, in the endpoints' threads, so
        the dict must not be changed after this call. Ignored after ``close()``."""
        self._joined(source)
        event_id = str(uuid.uuid4())
        for endpoint in self.endpoints:
            endpoint.offer(event_id, event)

    def publish_counts(self, source: str, counts: dict) -> None:
        """Counts are not sent to webhooks (the events are; counts are in the metrics); the
        first ones of a source (its first frame, ``AnalyticsStage``) say it runs here: the
        summary names it."""
        self._joined(source)

    def sources(self) -> list[str]:
        """The sources this publisher had (their counts or events came), sorted."""
        return sorted(self._sources)

    def _joined(self, source: str) -> None:
        if source not in self._sources:
            with self._lock:
                self._sources = self._sources | {source}

    def close(self) -> None:
        """Deliver what waits for up to ``FLUSH_S`` seconds (every endpoint at once), then
        log each endpoint's summary when a source came (``WebhookEndpoint.finish_close``).
        Returns within about ``FLUSH_S + JOIN_MARGIN_S`` seconds, also when an endpoint is
        down. A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + FLUSH_S
        for endpoint in self.endpoints:
            endpoint.begin_close(deadline)
        sources = self.sources()
        for endpoint in self.endpoints:
            endpoint.finish_close(sources)

    def stats(self) -> list[WebhookStats]:
        """Every endpoint's counters now, in configuration order (any thread)."""
        return [endpoint.stats() for endpoint in self.endpoints]

    def reasons(self) -> list[str]:
        """A health reason for each endpoint whose last attempt got no 2xx, one line each."""
        return [f"webhook {s.url} failing for {s.failing_for_s:.0f} s ({s.last_error}); "
                f"{s.waiting} events waiting, {s.dropped} dropped"
                for s in self.stats() if s.failing_for_s is not None]


def describe_error(error: Exception) -> str:
    """One line saying why a request got no answer (no URL: it may hold credentials)."""
    import httpx

    if isinstance(error, httpx.ConnectError):
        text = str(error)
        if "refused" in text.lower():
            return "connection refused (nothing listening there)"
        return f"cannot connect ({text or type(error).__name__})"
    if isinstance(error, httpx.TimeoutException):
        return f"no answer in time ({type(error).__name__})"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _seconds(value: str | None) -> float | None:
    """A ``Retry-After`` header in seconds (the HTTP-date form is ignored), or None."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _json_value(value: Any) -> Any:
    """JSON for what json does not know: NumPy arrays and scalars (``tolist``)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")
