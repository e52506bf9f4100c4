"""A paced run measured from outside, as a user's Prometheus would see it: start ``run.py`` as a
child process, scrape its ``/metrics`` (``runtime.metrics_port``), take a window's numbers
and decide whether the run held. ``capacity`` and ``benchmarks.live_control`` measure with it.

    launch(run.py) ──> MetricsPoller (a thread, /metrics every SCRAPE_PERIOD_S, per host the
    │                  snapshots that changed, each with when the host sent it: ``sent_at``)
    │   wait_delivering: every camera counted a frame
    │   warm-up, then the window [t0, t1]
    │   once in the window: query_compute_apps (nvidia-smi), process_tree(child);
    │   at its ends: cpu_ticks (/proc/stat) -> the machine's cores busy over it
    └── window_numbers(poller, t0, t1, cameras) ──> Window: delivered, dropped, p50/p99,
        stages' work and blocked seconds, the busiest stage, held
    stop(child): SIGINT, its exit status
    Window.add_engines(run_log.engine_windows(run.log, t0, t1)): the engine's stages, which
        it logs and does not export; gpu_memory(...): what the run's processes hold

Over the window, for the cameras asked about (others, e.g. one added through the API, are
left out): delivered frames/s (``pipeline_source_frames_total``), dropped
(``pipeline_source_dropped_frames_total``), p50 and p99 capture-to-sink latency from the
deltas of ``pipeline_frame_latency_seconds_bucket`` summed over the cameras, and the p99 of
each host. Hosts send their metrics to the supervisor once a second, so a host's numbers are
its counters' change from the snapshot it had sent by the window's start to the one it had
sent by its end, and each rate or share divides that change by the time between those two
sendings (``Window.spans``): about the window, either end earlier by up to a report period.
When a snapshot was sent is known from the scrapes around it: after the last scrape that
still showed the one before began, by the first that showed it answered (``sent_at``: the
middle, so within half a scrape period; its first sighting alone is up to a scrape period
late, by a different amount at each end). What remains is noise: a counter moves a batch at
a time (its frames reach the sinks together, its work is counted as it ends), so either end
can count one batch more or less. A percentile is the bucket it falls in: ``<= 100 ms``
means in (50, 100] ms (the bounds are ``pipeline.app.prometheus.LATENCY_BUCKETS_S``: 5, 10,
20, 50, 100, 200, 500 ms, 1 s, ...); 100 ms is a bound, so "p99 <= 100 ms" is decided
exactly. Each stage's work and blocked seconds (``pipeline_stage_work_seconds_total``,
``pipeline_stage_blocked_seconds_total``; the per-camera sinks summed as ``sinks``) are
summed over the hosts, and the busiest stage of any host or engine (work in % of the time
its counts cover; an engine's over the span of its log lines around the window,
``pipeline.app.run_log``) is named: the bottleneck. Held: 0 dropped, p99 <= 100 ms and
delivered >= 95% of offered. Cameras that ended by the window's end
(``pipeline_source_state``) are counted: a clip too short for the window.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.app.run_log import EngineWindow

P99_LIMIT_S = 0.1
DELIVERED_SHARE = 0.95
SCRAPE_PERIOD_S = 0.2
EXIT_WAIT_S = 120.0  # SIGINT until the child exits (then it is killed)


class MeasurementError(RuntimeError):
    """A step of a measurement failed; the message is one line for the user."""


# ---- metrics ---------------------------------------------------------------------------


@dataclass
class HostSample:
    """One host's counters as one scrape showed them.

    Attributes:
        frames: source -> ``pipeline_source_frames_total`` (summed over its series).
        dropped: source -> ``pipeline_source_dropped_frames_total``.
        buckets: source -> {upper bound in s (inf for +Inf): cumulative count}.
        work: stage -> ``pipeline_stage_work_seconds_total`` (sinks summed as ``sinks``).
        blocked: stage -> ``pipeline_stage_blocked_seconds_total`` (likewise).
        ended: sources whose ``pipeline_source_state`` is ``ended`` or ``failed``.
    """

    frames: dict[str, float] = field(default_factory=dict)
    dropped: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)
    work: dict[str, float] = field(default_factory=dict)
    blocked: dict[str, float] = field(default_factory=dict)
    ended: set[str] = field(default_factory=set)


def parse_metrics(text: str) -> dict[str, HostSample]:
    """The counters a measurement reads from a ``/metrics`` page, per host (label
    ``pipeline``; ``-`` when a sample has none)."""
    from prometheus_client.parser import text_string_to_metric_families

    hosts: dict[str, HostSample] = {}

    def add(table: dict[str, float], key: str, value: float) -> None:
        table[key] = table.get(key, 0.0) + value

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            host = hosts.setdefault(labels.get("pipeline", "-"), HostSample())
            source = labels.get("source", "")
            stage = labels.get("stage", "")
            stage = "sinks" if stage.startswith("sink:") else stage
            if sample.name == "pipeline_source_frames_total":
                add(host.frames, source, sample.value)
            elif sample.name == "pipeline_source_dropped_frames_total":
                add(host.dropped, source, sample.value)
            elif sample.name == "pipeline_frame_latency_seconds_bucket":
                add(host.buckets.setdefault(source, {}), float(labels["le"]), sample.value)
            elif sample.name == "pipeline_stage_work_seconds_total":
                add(host.work, stage, sample.value)
            elif sample.name == "pipeline_stage_blocked_seconds_total":
                add(host.blocked, stage, sample.value)
            elif (sample.name == "pipeline_source_state" and sample.value == 1
                  and labels.get("state") in ("ended", "failed")):
                host.ended.add(source)
    return hosts


def percentile_bucket(buckets: dict[float, float], share: float) -> tuple[float, float] | None:
    """The latency bucket ``(lower, upper]`` in seconds that holds the ``share`` quantile of a
    cumulative histogram ``{upper bound: count}`` (upper ``inf``: beyond the last bound);
    None when it counts nothing."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    lower = 0.0
    for bound in bounds:
        if buckets[bound] >= share * total:
            return lower, bound
        lower = bound
    return lower, math.inf


def bucket_text(found: tuple[float, float] | None) -> str:
    """``<= 100 ms (50-100)``; ``> 30000 ms`` past the last bound; ``-`` for none."""
    if found is None:
        return "-"
    lower, upper = found
    if math.isinf(upper):
        return f"> {1000 * lower:g} ms"
    return f"<= {1000 * upper:g} ms ({1000 * lower:g}-{1000 * upper:g})"


def sent_at(shown_before: float | None, first_seen: float) -> float:
    """When a host sent a snapshot (``time.monotonic()``), from the scrapes around it: it was
    not there when the last scrape that still showed the host's previous one began
    (``shown_before``; None: no such scrape), and was there when the first scrape that
    showed it answered (``first_seen``). The middle of the two; ``first_seen`` without the
    first."""
    return first_seen if shown_before is None else (shown_before + first_seen) / 2


class MetricsPoller:
    """Scrapes ``/metrics`` every ``SCRAPE_PERIOD_S`` in a thread and keeps, per host, each
    snapshot that differs from that host's previous one, with when the host sent it
    (``time.monotonic()``, ``sent_at``: to within half the time between the scrape before it
    and the one that first showed it). Scrapes, the poller's and those asked for (``scrape``
    at a window's ends), take turns, so each one's start and answer bound what it showed."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.lock = threading.Lock()
        self.history: dict[str, list[tuple[float, HostSample]]] = {}
        self.last_text = ""
        self.errors = 0
        self._turn = threading.Lock()  # one scrape at a time
        self._shown: dict[str, float] = {}  # host -> when the latest scrape showing it began
        self._last_began: float | None = None  # when the latest scrape that answered began
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-poller", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def scrape(self) -> str:
        """One scrape now (after any under way); records it and returns its text ("" when
        nothing answered)."""
        with self._turn:
            began = time.monotonic()
            try:
                with urllib.request.urlopen(self.url, timeout=5) as answer:
                    text = answer.read().decode()
            except OSError:
                with self.lock:
                    self.errors += 1
                return ""
            seen = time.monotonic()
            self.record(parse_metrics(text), began, seen, text)
        return text

    def record(self, hosts: dict[str, HostSample], began: float, seen: float,
               text: str = "") -> None:
        """Record a scrape that began at ``began`` and answered ``hosts`` at ``seen`` (scrapes
        in turn): a host's snapshot that changed is timed ``sent_at`` the start of the last
        scrape that showed the host before (for a host new to it, of the last scrape that
        answered) and ``seen``."""
        with self.lock:
            self.last_text = text
            for name, sample in hosts.items():
                history = self.history.setdefault(name, [])
                if not history or history[-1][1] != sample:
                    history.append((sent_at(self._shown.get(name, self._last_began), seen),
                                    sample))
                self._shown[name] = began
            self._last_began = began

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            self.scrape()
            self._stop.wait(max(0.0, SCRAPE_PERIOD_S - (time.monotonic() - began)))

    def ends(self, start: float, end: float) -> dict[str, tuple[float, HostSample, float,
                                                               HostSample]]:
        """Per host: (when it was sent, snapshot) of the snapshot it had sent by ``start`` and
        of the one it had sent by ``end``: its counters' change between them covers the time
        between those two times, which is what a rate divides by. A host that sent its
        first snapshot after ``start`` (one started in the window) counts from that one. A
        host that sent nothing new between them (an idle one: a worker without cameras): its
        snapshot at both ends, timed at the window's ends (its changes are all zero).

        Raises:
            MeasurementError: a host has fewer than two snapshots in the window and none
                before it.
        """
        with self.lock:
            histories = {name: list(items) for name, items in self.history.items()}
        found = {}
        for name, items in histories.items():
            by_start = [item for item in items if item[0] <= start]
            by_end = [item for item in items if item[0] <= end]
            first = by_start[-1] if by_start else by_end[0] if len(by_end) >= 2 else None
            if first is None:
                raise MeasurementError(f"host {name}: fewer than two metrics snapshots in the "
                                       f"window (a window of a few seconds at least is needed)")
            last = by_end[-1]
            if last[0] <= first[0]:  # nothing new sent in the window
                found[name] = (start, first[1], end, last[1])
            else:
                found[name] = (*first, *last)
        return found

    def host_of(self) -> dict[str, str]:
        """source -> the host whose latest snapshot has it."""
        with self.lock:
            latest = {name: items[-1][1] for name, items in self.history.items() if items}
        return {source: host for host, sample in latest.items() for source in sample.frames}

    def frames(self) -> dict[str, float]:
        """source -> its frames in the latest snapshots (summed over the hosts)."""
        with self.lock:
            latest = [items[-1][1] for items in self.history.values() if items]
        counted: dict[str, float] = {}
        for sample in latest:
            for source, frames in sample.frames.items():
                counted[source] = counted.get(source, 0.0) + frames
        return counted


# ---- the window ------------------------------------------------------------------------


@dataclass
class Window:
    """A window's numbers for the cameras asked about; None: not measured.

    Attributes:
        window_s: its length (from the scrapes at its ends).
        spans: host -> the seconds its counters' changes cover (``MetricsPoller.ends``:
            from the snapshot it had sent by the window's start to the one it had sent by
            its end; about ``window_s``), which its rates and stage shares divide by.
        offered: frames/s the cameras offered (their number x their pace).
        delivered: frames/s they delivered (``pipeline_source_frames_total``), each host's
            frames over its span, summed.
        dropped: frames they dropped in it (over the hosts' spans).
        p50, p99: the capture-to-sink latency buckets ``(lower, upper]`` in s, all cameras.
        host_p99: host -> the p99 bucket of its cameras.
        host_cameras: host -> how many of the cameras it ran.
        hosts: the hosts that ran some of them, in name order.
        stages: stage -> (work s, blocked s) summed over the hosts (each over its span).
        busiest: (host or engine, stage, work in % of the time it covers: the host's span,
            about the window) of the busiest stage of any process: a host's (the sinks, many
            threads, left out) or an engine's (``engines``; ``add_engines``).
        gpu_util: the mean GPU utilisation (%) over the window, when sampled.
        nvdec_util: the mean utilisation (%) of the GPU's video decoders over the window,
            when sampled.
        ended: how many of the cameras had ended (or failed) by the window's end.
        engines: engine name (``engine``; ``engine PID`` when there are several) -> its
            stages over the span of its log lines around the window
            (``pipeline.app.run_log``).
        gpu_memory: device memory held by processes, sampled once in the window.
        cpu_busy: how many of the machine's CPUs were busy, on average over the window (all
            its processes, not only the run's: ``cores_busy``).
        cpus: how many CPUs the machine has (``/proc/stat``).
        drop_reasons: frames dropped by why, from the processes' "live frames dropped" log
            lines around the window (``pipeline.app.run_log.drop_reasons``), when read.
    """

    window_s: float | None = None
    spans: dict[str, float] = field(default_factory=dict)
    offered: float | None = None
    delivered: float | None = None
    dropped: int | None = None
    p50: tuple[float, float] | None = None
    p99: tuple[float, float] | None = None
    host_p99: dict[str, tuple[float, float] | None] = field(default_factory=dict)
    host_cameras: dict[str, int] = field(default_factory=dict)
    hosts: list[str] = field(default_factory=list)
    stages: dict[str, tuple[float, float]] = field(default_factory=dict)
    busiest: tuple[str, str, float] | None = None
    gpu_util: float | None = None
    nvdec_util: float | None = None
    ended: int | None = None
    engines: dict[str, EngineWindow] = field(default_factory=dict)
    gpu_memory: GpuMemory | None = None
    cpu_busy: float | None = None
    cpus: int | None = None
    drop_reasons: dict[str, int] | None = None

    def add_engines(self, engines: dict[int | None, EngineWindow]) -> None:
        """Add the engines' stages (``run_log.engine_windows``) and name the busiest stage
        again among the hosts' and theirs."""
        several = len(engines) > 1
        for pid, engine in sorted(engines.items(), key=lambda item: str(item[0])):
            name = f"engine {pid}" if several else "engine"
            self.engines[name] = engine
            for stage in engine.stages:
                share = engine.share(stage)
                if self.busiest is None or share > self.busiest[2]:
                    self.busiest = (name, stage, share)

    def span_of(self, where: str) -> float | None:
        """The seconds the counts of ``where`` (an engine or a host) cover: its share's
        divisor; None when not known."""
        if where in self.engines:
            return self.engines[where].span_s
        return self.spans.get(where)

    def stage_numbers(self, where: str, stage: str) -> tuple[float, float]:
        """(work s, blocked s) of ``stage``: an engine's when ``where`` names one, else
        summed over the hosts."""
        if where in self.engines:
            work, blocked, _ = self.engines[where].stages.get(stage, (0.0, 0.0, 0))
            return work, blocked
        return self.stages.get(stage, (0.0, 0.0))

    @property
    def delivered_pct(self) -> float | None:
        if self.delivered is None or not self.offered:
            return None
        return 100 * self.delivered / self.offered

    @property
    def held(self) -> bool:
        """0 dropped, p99 <= ``P99_LIMIT_S`` and delivered >= ``DELIVERED_SHARE`` of offered."""
        return (self.dropped == 0 and self.p99 is not None and self.p99[1] <= P99_LIMIT_S
                and self.delivered is not None and self.offered is not None
                and self.delivered >= DELIVERED_SHARE * self.offered)

    def why_not_held(self) -> list[str]:
        """The conditions of ``held`` the window missed, in words (empty when it held)."""
        if self.delivered is None:
            return ["not measured"]
        reasons = []
        if self.dropped:
            why = ", ".join(f"{reason} {count}" for reason, count
                            in sorted((self.drop_reasons or {}).items(), key=lambda rc: -rc[1]))
            reasons.append(f"{self.dropped} dropped" + (f" (logged: {why})" if why else ""))
        if self.p99 is None:
            reasons.append("no latency counted")
        elif self.p99[1] > P99_LIMIT_S:
            reasons.append(f"p99 {bucket_text(self.p99).split(' (')[0]}")
        if self.offered is not None and self.delivered < DELIVERED_SHARE * self.offered:
            reasons.append(f"delivered {self.delivered_pct:.0f}% of offered")
        return reasons


def window_numbers(poller: MetricsPoller, start: float, end: float, cameras: set[str],
                   result: Window) -> None:
    """Fill ``result``'s rates, drops, latency and stages from each host's snapshots at the
    window's ends (``MetricsPoller.ends``): every rate and share is a counter's change over
    the time between the two snapshots it is read from (``spans``).

    Raises:
        MeasurementError: a host has fewer than two snapshots in the window.
    """
    total: dict[float, float] = {}
    frames_per_s = dropped = 0.0
    busiest = None
    for host, (t0, first, t1, last) in sorted(poller.ends(start, end).items()):
        mine = cameras & set(last.frames)
        if mine:
            result.hosts.append(host)
            result.host_cameras[host] = len(mine)
        span = result.spans[host] = t1 - t0
        frames_per_s += sum(last.frames[s] - first.frames.get(s, 0.0) for s in mine) / span
        dropped += sum(last.dropped.get(s, 0.0) - first.dropped.get(s, 0.0) for s in mine)
        buckets: dict[float, float] = {}
        for source in mine:
            for bound, count in last.buckets.get(source, {}).items():
                delta = count - first.buckets.get(source, {}).get(bound, 0.0)
                buckets[bound] = buckets.get(bound, 0.0) + delta
                total[bound] = total.get(bound, 0.0) + delta
        if mine:
            result.host_p99[host] = percentile_bucket(buckets, 0.99)
            result.ended = (result.ended or 0) + len(mine & last.ended)
        for stage in set(last.work) | set(last.blocked):
            work = last.work.get(stage, 0.0) - first.work.get(stage, 0.0)
            blocked = last.blocked.get(stage, 0.0) - first.blocked.get(stage, 0.0)
            had = result.stages.get(stage, (0.0, 0.0))
            result.stages[stage] = (had[0] + work, had[1] + blocked)
            share = 100 * work / span
            # the sinks are many threads: their sum is no one thread's load
            if stage != "sinks" and (busiest is None or share > busiest[2]):
                busiest = (host, stage, share)
    result.delivered, result.dropped = frames_per_s, int(round(dropped))
    result.p50, result.p99 = percentile_bucket(total, 0.5), percentile_bucket(total, 0.99)
    result.busiest = busiest


def dropped_between(poller: MetricsPoller, start: float, end: float, cameras: set[str]) -> int:
    """Frames ``cameras`` dropped between ``start`` and ``end`` (``time.monotonic()``), summed
    over every host they ran on: per host, its last snapshot seen by ``end`` less its last
    one seen by ``start`` (a host, or a camera on it, first seen after ``start`` counts from
    0; a fall, a host restarted under its name, counts as 0). Hosts report once a second, so
    a drop up to about a second before ``start`` can count too: never one too few."""
    with poller.lock:
        histories = {name: list(items) for name, items in poller.history.items()}
    dropped = 0.0
    for items in histories.values():
        before = [sample for seen, sample in items if seen <= start]
        after = [sample for seen, sample in items if seen <= end]
        if not after:
            continue
        first = before[-1].dropped if before else {}
        last = after[-1].dropped
        dropped += sum(max(0.0, last.get(c, 0.0) - first.get(c, 0.0)) for c in cameras)
    return int(round(dropped))


# ---- the child process -------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def child_env() -> dict[str, str]:
    """This process's environment for a child that imports ``pipeline``: unbuffered output,
    and the folder ``pipeline`` is imported from first on ``PYTHONPATH`` (a checkout run as
    ``python run.py`` from elsewhere finds itself)."""
    import pipeline

    root = str(Path(pipeline.__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": root if not path else f"{root}{os.pathsep}{path}"}


def launch(command: list[str], log: Path, cwd: Path | None = None
           ) -> tuple[subprocess.Popen[str], threading.Thread]:
    """Start ``command`` in its own process group (a Ctrl-C at the terminal reaches this
    process only, which then stops the child with one SIGINT: ``stop``); its stdout and
    stderr go to ``log``, each line prefixed with its second since the launch. The last
    line that starts with ``error:`` is kept as ``process.last_error``."""
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                               env=child_env(), start_new_session=True)

    def read() -> None:
        with open(log, "w") as sink:
            for line in process.stdout:  # type: ignore[union-attr]
                sink.write(f"{time.monotonic() - started:8.2f} {line}")
                sink.flush()
                if line.startswith("error:"):
                    process.last_error = line.strip()  # type: ignore[attr-defined]

    reader = threading.Thread(target=read, name="child-log", daemon=True)
    reader.start()
    return process, reader


def stop(process: subprocess.Popen[Any], wait_s: float = EXIT_WAIT_S) -> tuple[int, str | None]:
    """SIGINT (a graceful stop), then the exit status; killed after ``wait_s``. Returns the
    status and a note when it had to be killed. Interrupted while it waits, it sends a second
    SIGINT (run.py then aborts) and re-raises."""
    note = None
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(wait_s)
        except subprocess.TimeoutExpired:
            note = f"the child did not exit within {wait_s:g} s of SIGINT: killed"
            process.kill()
        except KeyboardInterrupt:  # asked again while it stops: a second SIGINT aborts it
            process.send_signal(signal.SIGINT)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
            raise
    return process.wait(), note


def said(process: subprocess.Popen[Any]) -> str:
    """``: its last error line`` (``launch`` keeps it), or a pointer to its log."""
    time.sleep(0.5)  # the log reader's last lines
    last = getattr(process, "last_error", None)
    return f": {last}" if last else "; see its log"


def wait_delivering(poller: MetricsPoller, process: subprocess.Popen[Any], cameras: set[str],
                    limit_s: float, started: float) -> float:
    """Seconds from ``started`` until every one of ``cameras`` counted a frame in the metrics
    ``poller`` scrapes (it must be running).

    Raises:
        MeasurementError: the child ended first, or it took longer than ``limit_s``.
    """
    waiting = sorted(cameras)
    while time.monotonic() - started < limit_s:
        if process.poll() is not None:
            raise MeasurementError(f"run.py exited with {process.returncode} before every "
                                   f"camera delivered{said(process)}")
        counted = poller.frames()
        waiting = sorted(name for name in cameras if not counted.get(name))
        if not waiting:
            return time.monotonic() - started
        time.sleep(0.25)
    raise MeasurementError(f"{len(waiting)} of {len(cameras)} cameras had delivered no frame "
                           f"{limit_s:g} s after the launch (first: {waiting[:3]})")


class UtilisationSampler:
    """Utilisation (%) of GPU ``index``'s SMs and of its video decoders (NVDEC) every
    ``interval_s`` in a thread: NVML, else ``nvidia-smi`` (neither creates a CUDA context).
    A run whose cameras' decoding is the wall shows NVDEC near 100% with the GPU not."""

    def __init__(self, enabled: bool, interval_s: float = 0.2, index: int = 0) -> None:
        # (perf_counter, GPU %, NVDEC % or None where the device does not say)
        self.samples: list[tuple[float, float, float | None]] = []
        self.interval_s = interval_s
        self._read = self._reader(index) if enabled else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _reader(index: int) -> Callable[[], tuple[float, float | None]] | None:
        """A function that reads (GPU %, NVDEC % or None) now, or None when neither NVML
        nor ``nvidia-smi`` is there. A device that gives no decoder figure (``[N/A]``, a
        MIG instance) still gives the GPU's."""
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)

            def read_nvml() -> tuple[float, float | None]:
                gpu = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                try:
                    return gpu, float(pynvml.nvmlDeviceGetDecoderUtilization(handle)[0])
                except pynvml.NVMLError:
                    return gpu, None

            return read_nvml
        except Exception:  # noqa: BLE001 - not installed or no driver: try the CLI
            if shutil.which("nvidia-smi") is None:
                return None
            command = ["nvidia-smi", "--query-gpu=utilization.gpu,utilization.decoder",
                       "--format=csv,noheader,nounits", "-i", str(index)]

            def read_cli() -> tuple[float, float | None]:
                answer = subprocess.run(command, capture_output=True, text=True, timeout=5)
                gpu, _, nvdec = answer.stdout.strip().partition(",")
                try:
                    return float(gpu), float(nvdec)
                except ValueError:  # [N/A]
                    return float(gpu), None

            return read_cli

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.samples.append((time.perf_counter(), *self._read()))
            except Exception:  # noqa: BLE001 - one failed read leaves a gap, no more
                pass

    def __enter__(self) -> UtilisationSampler:
        if self._read is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def mean(self, start: float, end: float) -> tuple[float, float | None] | None:
        """(GPU %, NVDEC % or None) averaged over the samples taken from ``start`` to
        ``end`` (``time.perf_counter()``), or None when none was."""
        inside = [(gpu, nvdec) for t, gpu, nvdec in self.samples if start <= t <= end]
        if not inside:
            return None
        nvdec = [value for _, value in inside if value is not None]
        return (statistics.fmean(gpu for gpu, _ in inside),
                statistics.fmean(nvdec) if nvdec else None)


# ---- the machine's CPUs ---------------------------------------------------------------------


@dataclass(frozen=True)
class CpuTicks:
    """The machine's CPU time since boot from ``/proc/stat`` (clock ticks, all CPUs)."""

    busy: float  # all but idle and iowait
    total: float
    cpus: int  # its ``cpuN`` lines


def cpu_ticks(stat_text: str | None = None) -> CpuTicks | None:
    """``/proc/stat`` now (or ``stat_text``, its contents) as ``CpuTicks``; None where it
    cannot be read (not Linux)."""
    try:
        if stat_text is None:
            with open("/proc/stat") as stat:
                stat_text = stat.read()
        lines = stat_text.splitlines()
        # cpu user nice system idle iowait irq softirq steal (guest time is inside user)
        ticks = [float(value) for value in lines[0].split()[1:9]]
        cpus = sum(1 for line in lines[1:] if line.startswith("cpu"))
    except (OSError, ValueError, IndexError):
        return None
    if not lines[0].startswith("cpu ") or len(ticks) < 5 or cpus == 0:
        return None
    total = sum(ticks)
    return CpuTicks(total - ticks[3] - ticks[4], total, cpus)


def cores_busy(before: CpuTicks | None, after: CpuTicks | None) -> float | None:
    """How many of the machine's CPUs were busy on average between two ``cpu_ticks`` (8.4:
    as if 8.4 of them worked all the time); None without both or with no time between."""
    if before is None or after is None or after.total <= before.total:
        return None
    return after.cpus * (after.busy - before.busy) / (after.total - before.total)


# ---- device memory -------------------------------------------------------------------------


@dataclass
class GpuMemory:
    """Device memory held by compute processes at one moment (``nvidia-smi
    --query-compute-apps``; one model copy per GPU: the engine should be the big one).

    Attributes:
        by_pid: pid -> MiB, for the run's processes (``scope`` "run"), or for every process
            listed when none of them is the run's (``scope`` "all": nvidia-smi shows pids of
            another pid namespace, in a container).
        scope: "run" or "all".
        engine_pids: the engines' pids (from the log), once known.
    """

    by_pid: dict[int, float]
    scope: str
    engine_pids: list[int] = field(default_factory=list)

    @property
    def total_mib(self) -> float:
        return sum(self.by_pid.values())

    @property
    def engine_mib(self) -> float | None:
        held = [mib for pid, mib in self.by_pid.items() if pid in self.engine_pids]
        return sum(held) if held else None


def parse_compute_apps(text: str) -> dict[int, float]:
    """pid -> MiB from ``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,
    noheader,nounits`` (lines without a number, ``[N/A]``, are left out)."""
    found: dict[int, float] = {}
    for line in text.splitlines():
        parts = [part.strip() for part in line.split(",")]
        try:
            found[int(parts[0])] = found.get(int(parts[0]), 0.0) + float(parts[1])
        except (ValueError, IndexError):
            continue
    return found


def query_compute_apps() -> dict[int, float] | None:
    """``parse_compute_apps`` of nvidia-smi now; None without nvidia-smi or when it fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        answer = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                 "--format=csv,noheader,nounits"], capture_output=True,
                                text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_compute_apps(answer.stdout) if answer.returncode == 0 else None


def process_tree(root: int) -> set[int]:
    """``root`` and every process descended from it now (Linux ``/proc``; elsewhere {root})."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name, in parentheses, may hold spaces
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return found


def gpu_memory(apps: dict[int, float] | None, tree: set[int]) -> GpuMemory | None:
    """The device memory of the processes in ``tree`` among ``apps`` (``query_compute_apps``),
    or of all of them when none is in it; None when nothing was queried."""
    if apps is None:
        return None
    ours = {pid: mib for pid, mib in apps.items() if pid in tree}
    return GpuMemory(ours, "run") if ours or not apps else GpuMemory(dict(apps), "all")
