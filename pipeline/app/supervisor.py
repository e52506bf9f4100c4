"""The supervisor of several pipelines: one per GPU (``runtime.gpus``), a number of them
without GPUs (``runtime.pipelines``), or Ray actors across hosts (``--ray``).

```
supervisor (this process)                         hosts (pipeline.app.host: processes or actors)
  placement by load (pipeline.app.placement)  ──start(Assignment)──>  gpu0: pipeline, pipeline ...
  watches every host: poll()              <──HostReport────────  gpu1: pipeline ...
  a host died: its sources, placed again on the live hosts, resume (after a backoff)
  one Prometheus endpoint (pipeline.app.cluster_metrics)
```

The supervisor places the sources by load, starts each host's share as one assignment (an
ordinary pipeline on that host) and then only watches. When a host dies (a crash, an OOM
kill, ``kill -9``, a Ray actor or node lost), its unfinished sources are placed again on
the live hosts and started there as new assignments, beside the ones running there (which
go on untouched), after a backoff per source; a file source resumes after its last written
record (``pipeline.resume``), so its records end up complete, in order, each frame once. The
dead host is restarted after a backoff (``runtime.max_restarts`` times; a Ray actor is
restarted by Ray), and placement is rebalanced onto it. ``add_source`` and ``remove_source``
change the set of sources while it runs, and placement is rebalanced too: a source that
moves is cut short where it was (its records stay) and resumes on its new host, and so do
the other sources of the pipeline it was cut from, on their host.

A source ends when its stream ends (the outputs are final) or fails (it is not restarted:
a bad file stays bad; a camera reconnects by itself within its pipeline); the run ends when
every source ended. ``request_stop`` (first Ctrl-C) stops every pipeline gracefully,
``abort`` (second) at once.

Executors start and reach the hosts: ``LocalExecutor`` (spawned processes, here) and
``pipeline.app.ray_cluster.RayExecutor``. Nothing of Ray is imported unless ``--ray`` is used.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

import structlog

from pipeline.app.host import Assignment, AssignmentEnded, HostReport, host_main
from pipeline.app.placement import SourceLoad, rebalance, source_loads
from pipeline.config import PipelineConfig

log = structlog.get_logger("cluster")

POLL_S = 0.1
RESTART_INITIAL_S, RESTART_MAX_S = 0.5, 10.0  # backoff of restarts and of moved sources
JOIN_TIMEOUT_S = 10.0
MAX_RESTART_ATTEMPTS = 8  # a host not back after this many attempts in a row is given up


class Executor(Protocol):
    """Starts and reaches the hosts (one per GPU or actor), numbered 0..count-1."""

    names: list[str]

    def start(self, host: int) -> None:
        """Start host ``host`` (its process or actor)."""

    def call(self, host: int, method: str, *args: Any) -> None:
        """Call a ``PipelineHost`` method there without waiting (errors surface in poll)."""

    def poll(self, host: int) -> tuple[list[HostReport], str | None]:
        """The reports of ``host`` since the last call, and why it is gone (None: alive).
        What a host reported before it died counts (an assignment that ended)."""

    def restart(self, host: int) -> bool | None:
        """Bring a dead host back (empty): True when it is back, False when not yet (ask
        again later), None when it never will."""

    def close(self) -> None:
        """End every host (after ``stop``: once they are idle) and release them."""


@dataclass
class _HostState:
    alive: bool = True
    restarts: int = 0
    restart_at: float | None = None
    gone: bool = False  # given up: no more restarts
    attempts: int = 0  # restart attempts in a row that found it not back yet


def backoff_s(attempt: int) -> float:
    """Seconds before attempt ``attempt`` (0-based): doubling from ``RESTART_INITIAL_S`` up
    to ``RESTART_MAX_S`` (no jitter: one supervisor, few hosts)."""
    return min(RESTART_MAX_S, RESTART_INITIAL_S * 2 ** min(attempt, 30))


class Supervisor:
    """Places the sources on the hosts of ``executor`` and keeps them running (module
    docstring).

    Args:
        config: the validated configuration (every source).
        executor: starts and reaches the hosts.
        max_restarts: times a dead host is restarted.
        exporter: a ``ClusterExporter`` fed with the hosts' metrics, or None.
        loads: the sources' loads (default: probed from ``config``).
    """

    def __init__(self, config: PipelineConfig, executor: Executor, max_restarts: int = 3,
                 exporter: Any = None, loads: list[SourceLoad] | None = None,
                 resume: tuple[str, ...] = ()) -> None:
        self.config = config
        self.executor = executor
        self.max_restarts = max_restarts
        self.exporter = exporter
        self.loads = {item.name: item for item in (loads or source_loads(config))}
        self.hosts = {host: _HostState() for host in range(len(executor.names))}
        self.placement: dict[str, int] = {}
        self.results: dict[str, str | None] = {}  # ended sources: error or None
        self.frames: dict[str, int] = {}  # frames done, by pipelines that returned
        self.moves: dict[str, int] = {}  # times each source was moved (its backoff)
        self.history: list[tuple[str, int, int]] = []  # (source, host, assignment) started
        self._running: dict[int, tuple[int, Assignment]] = {}  # id -> (host, assignment)
        self._cutting: set[int] = set()  # assignments aborted to move their sources
        # sources started at least once (or cut short by an earlier run: ``resume``): their
        # assignments resume them after their last record
        self._ran: set[str] = set(resume)
        self._not_before: dict[str, float] = {}
        self._next_id = 0
        self._stop = threading.Event()
        self._abort = threading.Event()
        self._changed = threading.Event()
        self._lock = threading.Lock()  # add_source / remove_source vs the loop

    # -- control, from any thread ------------------------------------------------------------
    def request_stop(self) -> None:
        """Graceful: every pipeline stops reading, drains and finalises its outputs."""
        self._stop.set()

    def abort(self) -> None:
        """Stop every pipeline at once (outputs stay ``.partial``)."""
        self._abort.set()

    def add_source(self, source: Any, load: SourceLoad | None = None) -> None:
        """Add a source (a ``SourceConfig`` whose name is new) to the running cluster: it is
        placed on the least loaded host and started there."""
        from pipeline.app.placement import probe_load

        with self._lock:
            if any(s.name == source.name for s in self.config.sources):
                raise ValueError(f"source {source.name!r} exists already")
            self.config.sources.append(source)
            self.loads[source.name] = load or probe_load(source)
        self._changed.set()

    def remove_source(self, name: str) -> None:
        """Remove a source: its pipeline is stopped (its records stay ``.partial``)."""
        with self._lock:
            if name not in self.loads:
                raise ValueError(f"no source {name!r}")
            del self.loads[name]
            self.results.setdefault(name, None)
        self._changed.set()

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> dict[str, str | None]:
        """Start the hosts, place and run every source until each ended (or a stop); returns
        each source's error (None: it ended fine).

        Raises:
            RuntimeError: no host could be started.
        """
        for host in self.hosts:
            self.executor.start(host)
        self._place(max_moves=0)
        stopping = aborting = False
        try:
            while True:
                if self._abort.is_set() and not aborting:
                    aborting = True
                    for host in self._live_hosts():
                        self.executor.call(host, "abort_all")
                if self._stop.is_set() and not stopping:
                    stopping = True
                    log.info("stopping every pipeline")
                    for host in self._live_hosts():
                        self.executor.call(host, "stop")
                self._poll_hosts()
                if self._changed.is_set():
                    self._changed.clear()
                    self._place(max_moves=len(self.loads))
                if not stopping and not aborting:
                    self._restart_hosts()
                    self._place(max_moves=0)
                    self._start_placed()
                if not self._running and (stopping or aborting or self._all_ended()):
                    break
                if not any(state.alive for state in self.hosts.values()) and all(
                        state.gone for state in self.hosts.values()):
                    for name in self._unfinished():
                        self.results[name] = "every pipeline died (runtime.max_restarts)"
                    break
                time.sleep(POLL_S)
        finally:
            for name in self._unfinished():
                self.results.setdefault(name, None if stopping else "stopped")
            self.executor.close()
        return {name: self.results.get(name) for name in self.loads}

    def _live_hosts(self) -> list[int]:
        return [host for host, state in self.hosts.items() if state.alive]

    def _unfinished(self) -> list[str]:
        return [name for name in self.loads if name not in self.results]

    def _all_ended(self) -> bool:
        return not self._unfinished()

    def _poll_hosts(self) -> None:
        for host in self._live_hosts():
            reports, died = self.executor.poll(host)
            for report in reports:
                for ended in report.ended:
                    self._ended(host, ended)
                if report.metrics is not None and self.exporter is not None:
                    self.exporter.update(self.executor.names[host], list(report.metrics))
            if died is not None:
                self._host_died(host, died)

    def _ended(self, host: int, ended: AssignmentEnded) -> None:
        self._running.pop(ended.id, None)
        cut_by_us = ended.id in self._cutting
        self._cutting.discard(ended.id)
        for name, count in ended.frames.items():
            self.frames[name] = self.frames.get(name, 0) + count
        for name, error in ended.ended.items():
            if name in self.loads and name not in self.results:
                self.results[name] = error
                self.placement.pop(name, None)
                if error:
                    log.error("source failed", source=name, host=self.executor.names[host],
                              reason=error)
        for name in ended.cut:
            if not cut_by_us and name in self.placement:
                del self.placement[name]  # cut by something else: place again
        if ended.failure and not cut_by_us:
            log.error("pipeline failed", host=self.executor.names[host], run=ended.id,
                      reason=ended.failure)

    def _host_died(self, host: int, reason: str) -> None:
        state = self.hosts[host]
        state.alive = False
        lost = [assignment for h, assignment in self._running.values() if h == host]
        for assignment in lost:
            del self._running[assignment.id]
            self._cutting.discard(assignment.id)
        moved = [name for name, h in self.placement.items() if h == host]
        now = time.monotonic()
        for name in moved:
            del self.placement[name]
            self._not_before[name] = now + backoff_s(self.moves.get(name, 0))
            self.moves[name] = self.moves.get(name, 0) + 1
        if state.restarts < self.max_restarts:
            state.restart_at = now + backoff_s(state.restarts)
        else:
            state.gone = True
        log.error("pipeline host died: its sources move to the others",
                  host=self.executor.names[host], reason=reason, sources=sorted(moved),
                  restart_in_s=None if state.gone else round(state.restart_at - now, 2))

    def _restart_hosts(self) -> None:
        now = time.monotonic()
        for host, state in self.hosts.items():
            if state.alive or state.gone or state.restart_at is None or now < state.restart_at:
                continue
            back = self.executor.restart(host)
            if back:
                state.restarts += 1
                state.alive, state.restart_at, state.attempts = True, None, 0
                log.info("pipeline host restarted: rebalancing onto it",
                         host=self.executor.names[host], restarts=state.restarts)
                self._changed.set()  # the next turn evens the loads, moving sources to it
            elif back is None or state.attempts >= MAX_RESTART_ATTEMPTS:
                state.gone = True
                log.error("pipeline host gone for good", host=self.executor.names[host])
            else:  # not back yet (Ray still restarting it): ask again
                state.attempts += 1
                state.restart_at = now + backoff_s(state.attempts)

    def _place(self, max_moves: int) -> None:
        """Place every unfinished source on a live host; cut short the assignments whose
        sources move (they restart on their new host once cut), and those of removed
        sources."""
        live = self._live_hosts()
        with self._lock:
            loads = [self.loads[name] for name in self._unfinished()]
        if not live or not loads:
            return
        before = dict(self.placement)
        self.placement = rebalance(before, loads, live, max_moves)
        gone = {name for name in before if name not in self.placement}
        for assignment_id, (host, assignment) in list(self._running.items()):
            if assignment_id in self._cutting:
                continue
            if any(name in gone or self.placement.get(name) != host
                   for name in assignment.sources):
                log.info("moving sources: cutting their pipeline short", run=assignment_id,
                         host=self.executor.names[host], sources=list(assignment.sources))
                self._cutting.add(assignment_id)
                self.executor.call(host, "abort", assignment_id)

    def _start_placed(self) -> None:
        """Start, per host, the placed sources that no running assignment holds and whose
        backoff is over, as one new assignment."""
        busy = {name for _, assignment in self._running.values() for name in assignment.sources}
        now = time.monotonic()
        waiting: dict[int, list[str]] = {}
        for name, host in self.placement.items():
            if name not in busy and name not in self.results and \
                    self._not_before.get(name, 0.0) <= now:
                waiting.setdefault(host, []).append(name)
        for host, names in waiting.items():
            assignment = Assignment(self._next_id, tuple(names),
                                    tuple(n for n in names if n in self._ran))
            self._next_id += 1
            self._running[assignment.id] = (host, assignment)
            self._ran.update(names)
            self.history.extend((name, host, assignment.id) for name in names)
            log.info("sources placed", host=self.executor.names[host], run=assignment.id,
                     sources=names, resumed=list(assignment.resume))
            self.executor.call(host, "start", assignment)


class LocalExecutor:
    """Hosts as spawned processes on this machine (``pipeline.app.host.host_main``), one per GPU
    of ``devices`` (None: without a GPU, on ``inference.device`` as configured).

    Args:
        config: the configuration every host gets (all sources).
        devices: per host, its GPU, or None.
        metrics: the hosts send metrics snapshots.
    """

    def __init__(self, config: PipelineConfig, devices: list[int | None],
                 metrics: bool = False) -> None:
        self.config = config
        self.devices = devices
        self.metrics = metrics
        self.names = host_names(devices)
        self.cpus = share_cores(len(devices)) if all(d is None for d in devices) else None
        self.processes: dict[int, Any] = {}
        self.conns: dict[int, Connection] = {}
        self._context = multiprocessing.get_context("spawn")

    def start(self, host: int) -> None:
        ours, theirs = self._context.Pipe()
        process = self._context.Process(
            target=host_main, name=f"streamdet-{self.names[host]}", daemon=False,
            args=(self.names[host], self.devices[host], self.config, theirs, self.metrics,
                  self.cpus[host] if self.cpus else None))
        process.start()
        theirs.close()
        self.processes[host], self.conns[host] = process, ours
        log.info("pipeline host started", host=self.names[host], pid=process.pid,
                 device=self.devices[host])

    def call(self, host: int, method: str, *args: Any) -> None:
        try:
            self.conns[host].send((method, *args))
        except (BrokenPipeError, OSError):
            pass  # it died: the next poll says so

    def poll(self, host: int) -> tuple[list[HostReport], str | None]:
        conn, process = self.conns[host], self.processes[host]
        alive = process.is_alive()  # before reading: what it sent before dying is read
        reports = []
        try:
            while conn.poll():
                _, report = conn.recv()
                reports.append(report)
        except (EOFError, OSError):
            pass
        if alive:
            return reports, None
        process.join()
        code = process.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code and code < 0 else \
            f"exited with status {code}"
        return reports, f"process {process.pid} {how}"

    def restart(self, host: int) -> bool:
        self.conns[host].close()
        self.start(host)
        return True

    def kill(self, host: int) -> int:
        """SIGKILL a host process (tests: a crash). Returns its pid."""
        pid = self.processes[host].pid
        os.kill(pid, signal.SIGKILL)
        return pid

    def close(self) -> None:
        for host in self.processes:
            self.call(host, "exit")
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for host, process in self.processes.items():
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.warning("pipeline host did not stop: killing it", host=self.names[host])
                process.kill()
                process.join(1.0)
            self.conns[host].close()


def share_cores(hosts: int) -> list[list[int]] | None:
    """The cores this process may use, cut into ``hosts`` contiguous shares as even as they
    go (CPU-path pipelines: see ``host_main``), or None with fewer cores than hosts or where
    affinity is not supported."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < hosts or hosts < 2:
        return None
    return [cores[len(cores) * k // hosts:len(cores) * (k + 1) // hosts] for k in range(hosts)]


def host_names(devices: list[int | None]) -> list[str]:
    """A name per host: ``gpu1`` (``gpu1.0``, ``gpu1.1``, ... where GPU 1 has several),
    ``pipeline0`` without a GPU of its own."""
    names = []
    for i, device in enumerate(devices):
        if device is None:
            names.append(f"pipeline{i}")
        elif devices.count(device) == 1:
            names.append(f"gpu{device}")
        else:
            names.append(f"gpu{device}.{devices[:i].count(device)}")
    return names


def resolve_devices(config: PipelineConfig) -> list[int | None]:
    """One entry per pipeline of a local cluster: the GPUs of ``runtime.gpus`` (``all``: every
    GPU this machine has), each repeated in turn up to ``runtime.pipelines`` when that is set
    too, or ``runtime.pipelines`` times None (no GPU of its own).

    Raises:
        ConfigError: ``all`` and no GPU can be found, or fewer pipelines than GPUs.
    """
    from pipeline.config import ConfigError

    runtime = config.runtime
    if runtime.gpus is None:
        return [None] * (runtime.pipelines or 1)
    gpus: list[int] = list(runtime.gpus) if runtime.gpus != "all" else list(range(gpu_count()))
    if not gpus:
        raise ConfigError("runtime.gpus: 'all' found no GPU on this machine (set "
                          "runtime.pipelines without runtime.gpus to run several pipelines "
                          "without one)")
    count = runtime.pipelines or len(gpus)
    if count < len(gpus):
        raise ConfigError(f"runtime.pipelines: at least one per GPU of runtime.gpus "
                          f"({len(gpus)}), got {count}")
    return [gpus[i % len(gpus)] for i in range(count)]


def gpu_count() -> int:
    """GPUs of this machine (``CUDA_VISIBLE_DEVICES`` respected), 0 when CUDA is unusable.
    Asked in a child process: this one must not create a CUDA context before spawning."""
    import subprocess
    import sys

    try:
        out = subprocess.run([sys.executable, "-c", "import cupy; print(cupy.cuda.runtime."
                              "getDeviceCount())"], capture_output=True, text=True, timeout=60)
        return int(out.stdout.strip() or 0) if out.returncode == 0 else 0
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


def absolute_paths(config: PipelineConfig, base: str | None = None) -> PipelineConfig:
    """``config`` with every relative file path made absolute against ``base`` (default: the
    working directory): hosts (Ray actors) may run in another folder."""
    import copy

    base = base or os.getcwd()
    from pipeline.config import is_stream_url

    def absolute(path: str | None) -> str | None:
        return path if path is None or os.path.isabs(path) else os.path.join(base, path)

    config = copy.deepcopy(config)
    config.model.path = absolute(config.model.path)
    config.model.class_names = absolute(config.model.class_names)
    config.output.dir = absolute(config.output.dir)
    config.inference.engine_cache = absolute(config.inference.engine_cache)
    config.inference.calibration_video = absolute(config.inference.calibration_video)
    for source in config.sources:
        if not is_stream_url(source.uri):
            source.uri = absolute(source.uri)
    return config


def run_cluster(config: PipelineConfig, ray_address: str | None = None,
                restart: bool = False) -> int:
    """Run ``config`` over several pipelines (``runtime.gpus``, ``runtime.pipelines``) or
    Ray actors (``ray_address``: ``--ray``), with signals, the summary and the exit status as
    ``run.py`` (``pipeline.app.cli``'s table): a file source an earlier run left cut short
    resumes after its last record unless ``restart``; one stopped before its end keeps its
    ``.partial`` outputs and makes the status EXIT_STOPPED."""
    from pipeline.app.build import check_extras, probe_file_sources
    from pipeline.app.cli import (
        EXIT_FAILED,
        EXIT_INTERRUPTED,
        EXIT_OK,
        EXIT_STOPPED,
        EXIT_USAGE,
    )
    from pipeline.config import ConfigError
    from pipeline.resume import cut_files
    from stages.backends.base import read_model_info

    try:  # what a host would find only when building: stop here, once, with exit 2
        check_extras(config)
        read_model_info(config.model.path, config.model.layout)
        probe_file_sources(config)  # every file's first frame decodes
        resume = () if restart else tuple(cut_files(config))
        if config.runtime.http is not None:
            raise ConfigError("runtime.http: the live view serves one pipeline; it is not "
                              "available with runtime.gpus, runtime.pipelines or --ray")
        config = absolute_paths(config)
        exporter = None
        if config.runtime.metrics_port is not None:
            from pipeline.app.cluster_metrics import ClusterExporter

            runtime = config.runtime
            exporter = ClusterExporter(runtime.metrics_port, runtime.metrics_host,
                                       runtime.metrics_token)
        metrics = exporter is not None
        if ray_address is not None:
            from pipeline.app.ray_cluster import RayExecutor, connect

            connect(ray_address)
            executor: Any = RayExecutor(config, metrics=metrics)
        else:
            executor = LocalExecutor(config, resolve_devices(config), metrics)
    except (ConfigError, ValueError) as error:
        print(f"error: {error}" if isinstance(error, ConfigError) else
              f"error: model.path: {error}", file=sys.stderr)
        return EXIT_USAGE
    supervisor = Supervisor(config, executor, config.runtime.max_restarts, exporter,
                            resume=resume)
    if exporter is not None:
        try:
            port = exporter.start()
        except OSError as error:
            print(f"error: failed to start: {error}", file=sys.stderr)
            return EXIT_FAILED
        log.info("serving Prometheus metrics",
                 url=f"http://{config.runtime.metrics_host}:{port}/metrics")
    log.info("sources placed by load", pipelines=executor.names, sources=len(config.sources))
    from pipeline.app.cli import install_signal_handlers  # cli imports this module lazily

    interrupts, previous = install_signal_handlers(supervisor)
    started = time.monotonic()
    try:
        results = supervisor.run()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if exporter is not None:
            exporter.stop()
    frames = supervisor.frames  # a pipeline that died took its count with it
    for name, error in results.items():
        hosts = sorted({supervisor.executor.names[h] for n, h, _ in supervisor.history if n == name})
        log.info("source summary", source=name, pipelines=hosts, frames=frames.get(name),
                 moves=supervisor.moves.get(name, 0), error=error)
    log.info("run finished", seconds=round(time.monotonic() - started, 2))
    if interrupts["count"] >= 2:
        return EXIT_INTERRUPTED
    failed = {name: error for name, error in results.items() if error}
    for name, reason in failed.items():
        print(f"error: source {name}: {reason}", file=sys.stderr)
    if failed:
        return EXIT_FAILED
    cut = cut_short_files(config)
    for name in cut:
        log.warning("stopped early: outputs kept as .partial; run the same command again to "
                    "resume (--restart: start over)", source=name)
    return EXIT_STOPPED if cut else EXIT_OK


def cut_short_files(config: PipelineConfig) -> list[str]:
    """The file sources whose outputs a run left under their ``.partial`` names (a source
    stopped before its end keeps them; one that finished renamed them)."""
    from pipeline.config import is_stream_url, partial_path

    return [source.name for source in config.sources
            if not source.is_live and not is_stream_url(source.uri)
            and any(partial_path(path).exists() for path in config.output_paths(source))]
