"""The supervisor: the one top of every run, whatever its size. It places the sources on
pipeline hosts and keeps them running; the live view, the Prometheus endpoint and the Python
API read it.

```
run.py / Python API / --ray  ──>  Supervisor (this process)           hosts: one long-lived graph each
                                    places sources by load  ──add/remove──>  in this process (the
  HTTP API + live view  ───────>    (pipeline.app.placement)                whole pipeline), source
  Prometheus ──────────────────>    watches every host      <──HostReport─  worker processes with
                                    restarts what dies                      one engine per GPU
                                                                            (runtime.workers), or
                                                                            the same per GPU unit,
                                                                            a Ray actor (--ray)
```

Each host builds its graph once and keeps it for its life; the supervisor adds sources to it
and removes them one at a time (``pipeline.app.host``), so placing, moving or removing one
source never cuts another. When a host dies (a crash, an OOM kill, ``kill -9``, its Ray unit
or node lost; a local worker's death is seen at once: ``LocalExecutor``), its unfinished sources
go at once to a live spare of its group (``runtime.spare_workers``: an idle worker of the same
engine, started with the others), which is from then on a host like the others; the dead
host is restarted after a backoff (``runtime.max_restarts`` times; once Ray has restarted its
unit) as the group's new spare. Without a spare, its sources are placed on the live
hosts (at once the first time a source moves, after a backoff the next times), and once it
is restarted the load is evened out onto it with files only: those that move are cut short
where they were (their records stay) and resume on it; a running camera is never moved (a
cut loses its frames), so the restarted host takes cameras added later. A file source
resumes after its last written record (``pipeline.resume``), so its records end up
complete, in order, each frame once. ``add_source`` and ``remove_source``
change the set of sources while the run goes on (the live view's ``POST`` and ``DELETE``).

A source ends when its stream ends (its outputs are final) or fails (it is not restarted: a
bad file stays bad; a camera reconnects by itself within its pipeline). When the run ends is
``runtime.stop_when``: ``all_ended`` once every source ended, ``files_ended`` once every file
source ended (the cameras are stopped then), ``never`` only on ``request_stop``.
``request_stop`` (first Ctrl-C) stops every source gracefully, ``abort`` (second) at once.

Executors start and reach the hosts: ``InProcessExecutor`` (one pipeline, in this process:
nothing to spawn, and the Python API's callbacks see the batches), ``LocalExecutor``
(spawned processes) and ``pipeline.app.ray_cluster.RayExecutor`` (a ``LocalExecutor`` per GPU
unit, each in a Ray actor). Nothing of Ray is imported unless ``--ray`` is used.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol

import structlog

from pipeline.app.host import HostReport, PipelineHost, Reply, SourceEnded, SourceRequest, host_main
from pipeline.app.placement import SourceLoad, rebalance, source_loads
from pipeline.app.workers import exit_text, start_shielded
from pipeline.config import (
    UNPACED_FILES,
    ConfigError,
    PipelineConfig,
    SourceConfig,
    build_section,
    check_config,
    is_stream_url,
)
from pipeline.graph import SourceConflict

log = structlog.get_logger("supervisor")

POLL_S = 0.05
RESTART_INITIAL_S, RESTART_MAX_S = 0.5, 10.0  # backoff of restarts and of moved sources
JOIN_TIMEOUT_S = 10.0
EXIT_WAIT_S = 0.02  # a worker seen dying: its exit status is waited for this long (on the
# H200 a killed worker's comes only once the driver has torn its CUDA work down, ~0.8 s:
# its sources move at once, its status is logged when it comes)
MAX_RESTART_ATTEMPTS = 8  # a host not back after this many attempts in a row is given up
REPLY_TIMEOUT_S = 120.0  # add_source waits this long for its host's answer
SLOW_TURN_S = 0.25  # a turn of the loop this long is logged, with where its time went
VIEW_EVERY_S = 0.1  # how often the hosts are told which sources a viewer watches


class Executor(Protocol):
    """Starts and reaches the hosts (one per GPU, process or actor), numbered 0..count-1."""

    names: list[str]
    groups: list[Any]  # per host, the engine it feeds: hosts of a group can take each other's
    spares: set[int]  # hosts started idle, to take every source of a host of their group that dies

    def start(self, host: int) -> None:
        """Start host ``host`` (its process or actor): it builds its graph at once."""

    def call(self, host: int, method: str, *args: Any) -> None:
        """Call a ``PipelineHost`` method there without waiting (errors surface in poll)."""

    def poll(self, host: int) -> tuple[list[HostReport], str | None]:
        """The reports of ``host`` since the last call, and why it is gone (None: alive).
        What a host reported before it died counts (a source that ended)."""

    def restart(self, host: int) -> bool | None:
        """Bring a dead host back (empty): True when it is back, False when not yet (ask
        again later), None when it never will."""

    def engine_states(self) -> dict[str, dict[str, Any]]:
        """Each engine process's state by name (``EngineProcess.state``); empty where the
        model runs in the hosts."""

    def close(self) -> None:
        """End every host (after ``stop``: once their graphs finished) and release them;
        again, nothing more (``run`` closes it whether or not the supervisor ran)."""


@dataclass
class _HostState:
    alive: bool = True
    restarts: int = 0
    restart_at: float | None = None
    gone: bool = False  # given up: no more restarts
    attempts: int = 0  # restart attempts in a row that found it not back yet
    finished: bool = False  # its graph's run returned
    ready: bool = False  # its graph has started (the model is warm)
    failed: bool = False  # its graph failed: nothing more is placed on it
    rebalance: bool = False  # restarted: even the loads onto it once it is ready
    spare: bool = False  # idle, nothing placed on it, until a host of its group dies
    restart_as_spare: bool = False  # dead: restarted, it is the spare of its group


@dataclass
class _Pending:
    """A request waiting for its host's reply (``add_source``)."""

    request: SourceRequest
    host: int
    done: threading.Event = field(default_factory=threading.Event)
    reply: Reply | None = None


def backoff_s(attempt: int) -> float:
    """Seconds before attempt ``attempt`` (0-based): doubling from ``RESTART_INITIAL_S`` up
    to ``RESTART_MAX_S`` (no jitter: one supervisor, few hosts)."""
    return min(RESTART_MAX_S, RESTART_INITIAL_S * 2 ** min(attempt, 30))


@dataclass
class SourceRun:
    """What the supervisor knows of one source of the run.

    Attributes:
        config: its configuration (a POSTed one as its host validated it).
        key: its name in messages (``sources[N]``).
        added: it was added while the run went on (not in the configuration file).
        host: the host it runs on now (an ``add`` sent and its end not reported), or None.
        resume: its next start resumes after its last record (it ran before).
        output_number: the number of its outputs (None: its own).
        renumber: its name was used before in this run: its first start takes new numbers.
        moving: it is being cut short to move to another host.
        removing: ``remove_source`` asked for it while it ran (it is stopped: ``removed`` in
            its summary).
        forgotten: ``remove_source`` asked for it once it had ended (only its card goes).
        ended: what its last host reported when it ended (the latest segment).
        frames: frames done, summed over the hosts it ran on.
        hosts: the hosts it ran on, in order.
        moves: times it was placed again because its host died.
        unended: why the run ended with its outputs maybe not final: its host was lost while
            the run was stopping, before it reported the source's end, or the run was stopping
            before its host started it (None: it ended).
        result: its result (``results``' value: an error, or None), kept here once its name
            was added again (``sources`` and ``results`` then hold the new source's).
    """

    config: SourceConfig
    key: str
    added: bool = False
    host: int | None = None
    resume: bool = False
    output_number: int | None = None
    renumber: bool = False
    moving: bool = False
    removing: bool = False
    forgotten: bool = False
    ended: SourceEnded | None = None
    frames: int = 0
    hosts: list[str] = field(default_factory=list)
    moves: int = 0
    not_before: float = 0.0
    running_frames: int = 0  # frames reported by its current host
    first_frame: int | None = None  # the frame its first host in this run started at
    request: int | None = None  # the id of its latest ``add``
    unended: str | None = None
    result: str | None = None


class Supervisor:
    """Places the sources on the hosts of ``executor`` and keeps them running (module
    docstring).

    Args:
        config: the validated configuration (every source).
        executor: starts and reaches the hosts.
        max_restarts: times a dead host is restarted.
        exporter: a ``ClusterExporter`` fed with the hosts' metrics, or None.
        loads: the sources' loads (default: probed from ``config``).
        resume: file sources an earlier run left cut short: they resume after their last
            record.
        board: the live view's ``SourceBoard`` fed with the hosts' view reports, or None.
        on_frames: called from the loop with the frames done since the last call (progress).
    """

    def __init__(self, config: PipelineConfig, executor: Executor, max_restarts: int = 3,
                 exporter: Any = None, loads: list[SourceLoad] | None = None,
                 resume: tuple[str, ...] = (), board: Any = None,
                 on_frames: Callable[[int], None] | None = None) -> None:
        self.config = config
        self.executor = executor
        self.max_restarts = max_restarts
        self.exporter = exporter
        self.board = board
        self._on_frames = on_frames
        self.loads = {item.name: item for item in (loads or source_loads(config))}
        self.hosts = {host: _HostState(spare=host in executor.spares)
                      for host in range(len(executor.names))}
        self.sources: dict[str, SourceRun] = {
            s.name: SourceRun(s, f"sources[{i}]", resume=s.name in resume)
            for i, s in enumerate(config.sources)}
        self._count = len(config.sources)  # sources the run has had (keys sources[N])
        # every one of them, in the order added: a name added again has one per source
        self._every: list[SourceRun] = list(self.sources.values())
        self.placement: dict[str, int] = {}
        self.history: list[tuple[str, int, int]] = []  # (source, host, request) per start
        self.results: dict[str, str | None] = {}  # ended sources: error or None
        self.failure: tuple[str, bool] | None = None  # a host's graph failed: (reason, usage)
        self._pending: dict[int, _Pending] = {}
        self._next_id = 0
        self._stop = threading.Event()
        self._abort = threading.Event()
        self._changed = threading.Event()
        self._lock = threading.RLock()  # add_source / remove_source vs the loop
        self._next_view = 0.0  # when the hosts are told next which sources are watched
        self._turn: dict[str, float] = {}  # the loop's turn: seconds of each part (``run``)
        self._answered: set[int] = set()  # hosts whose poll answered once (a first is slow)
        self._first_answer = False  # this turn had a host's first answer (``_poll_hosts``)

    @property
    def frames(self) -> dict[str, int]:
        """Frames done per source so far, over every host it ran on."""
        with self._lock:
            return {name: run.frames + run.running_frames for name, run in self.sources.items()}

    def every_source(self) -> list[tuple[SourceRun, str | None]]:
        """Every source the run had, in the order they were added, each with its result
        (``results``': an error, or None): a name added again once its source had ended is
        there once per source, where ``sources`` and ``results`` keep only the latest."""
        with self._lock:
            return [(run, self.results.get(run.config.name)
                     if self.sources.get(run.config.name) is run else run.result)
                    for run in self._every]

    @property
    def moves(self) -> dict[str, int]:
        """Times each source was placed again because its host died (those placed again)."""
        with self._lock:
            return {name: run.moves for name, run in self.sources.items() if run.moves}

    # -- control, from any thread ------------------------------------------------------------
    def request_stop(self) -> None:
        """Graceful: every source stops reading, drains and finalises its outputs."""
        self._stop.set()

    def abort(self) -> None:
        """Stop every pipeline at once (outputs stay ``.partial``)."""
        self._abort.set()

    def add_source(self, data: Any, load: SourceLoad | None = None) -> SourceConfig:
        """Add a source while the run goes on: ``data`` is a ``sources[]`` entry (a mapping,
        validated here as the file's entries are, against every source of the run) or a
        ``SourceConfig``. It is placed on the least loaded host, which checks it against its
        pipeline (the stages it needs, its frame size) and starts it; returns it as started
        (its host's answer).

        Raises:
            ConfigError: the entry is not valid (one line naming ``sources[N]``).
            SourceConflict: its name is in use, or the run is ending.
        """
        from pipeline.app.placement import probe_load

        with self._lock:
            key = f"sources[{self._count}]"
            if isinstance(data, SourceConfig):
                source = data
            elif isinstance(data, dict):
                source = build_section(SourceConfig, data, key)
            else:
                raise ConfigError(f"{key}: expected a mapping of a source's keys, got "
                                  f"{type(data).__name__}")
            if self._stop.is_set() or self._abort.is_set():
                raise SourceConflict("the run is ending: no source can be added")
            earlier = self.sources.get(source.name)
            if earlier is not None and not (source.name in self.results
                                            and earlier.host is None):
                raise SourceConflict(f"{key}.name: source name {source.name!r} is in use in "
                                     "this run (running, or its outputs are being finalised)")
            others = [run.config for name, run in self.sources.items()
                      if name != source.name and name not in self.results]
            check_config(dataclasses.replace(self.config, sources=[*others, source]),
                         added_key=key)
        if source.is_live and not source.pace_fps and not is_stream_url(source.uri):
            # as the run's own sources are at its start (``run.warn_unpaced_files``)
            log.warning(UNPACED_FILES, source=source.name, key=f"{key}.pace_fps")
        load = load or probe_load(source)  # outside the lock: it may open the file
        with self._lock:
            live = self._placeable_hosts()
            if not live:
                raise SourceConflict("no pipeline is running: no source can be added")
            self.loads[source.name] = load
            self.placement = rebalance(
                {n: h for n, h in self.placement.items() if n != source.name},
                [self.loads[n] for n in self._unfinished() if n != source.name and n in self.loads]
                + [load],
                live, 0)
            host = self.placement[source.name]
            # validated here, against every source of the run: the host takes it as it is
            request = SourceRequest(self._next_id, source, key, renumber=earlier is not None)
            self._next_id += 1
            pending = _Pending(request, host)
            self._pending[request.id] = pending
        self.executor.call(host, "add", request)
        if not pending.done.wait(REPLY_TIMEOUT_S):
            raise SourceConflict(f"{key}: its pipeline did not answer within "
                                 f"{REPLY_TIMEOUT_S:g} s")
        reply = pending.reply
        if reply.source is None:
            with self._lock:
                if self.placement.get(source.name) == host and source.name not in self.sources:
                    del self.placement[source.name]
            raise (SourceConflict if reply.conflict else ConfigError)(reply.error)
        return reply.source

    def remove_source(self, name: str) -> None:
        """Stop a source (its outputs are finalised; a file stopped before its end keeps its
        ``.partial`` names), or forget one that has ended.

        Raises:
            SourceConflict: no source of that name is running or has ended.
        """
        with self._lock:
            run = self.sources.get(name)
            if run is None or run.removing or run.forgotten:
                raise SourceConflict(f"no source named {name!r}")
            if name in self.results:  # it had ended: not removed, only forgotten
                run.forgotten = True
                return
            run.removing = True
            host = run.host
            self.placement.pop(name, None)
            self.loads.pop(name, None)
            if host is None:  # not started yet (waiting for its backoff)
                self.results[name] = None
                return
        self.executor.call(host, "remove", name)

    def source_done(self, name: str) -> bool:
        """Whether ``name`` has ended and its outputs are final."""
        with self._lock:
            return name in self.results and self.sources[name].host is None

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> dict[str, str | None]:
        """Start the hosts, place and run every source until the run ends (``stop_when``, or
        a stop); returns each source's error (None: it ended fine or was stopped).

        Raises:
            RuntimeError: no host could be started.
        """
        for host in self.hosts:
            self.executor.start(host)
        self._tell_spares()
        stopping = aborting = False
        try:
            while True:
                turn_started = time.monotonic()
                self._turn = dict.fromkeys(("poll", "reports", "want", "place"), 0.0)
                self._first_answer = False
                if self._abort.is_set() and not aborting:
                    aborting = stopping = True
                    for host in self._live_hosts():
                        self.executor.call(host, "abort_all")
                if (self._stop.is_set() or self._should_stop()) and not stopping:
                    stopping = True
                    log.info("stopping every source")
                    for host in self._live_hosts():
                        self.executor.call(host, "stop")
                self._poll_hosts()
                if not stopping:
                    placing = time.monotonic()
                    if self._changed.is_set():
                        self._changed.clear()
                        self._place(max_moves=len(self.loads))
                    self._restart_hosts()
                    self._place(max_moves=0)
                    self._start_placed()
                    self._turn["place"] = time.monotonic() - placing
                took = time.monotonic() - turn_started
                # A worker's death waits this long to be seen; a host's first answer may take
                # its start (a Ray unit's actor is made then), which is not the loop's delay.
                if took >= SLOW_TURN_S and not self._first_answer:
                    log.warning("supervisor turn slow", seconds=round(took, 2),
                                **{f"{part}_s": round(t, 2) for part, t in self._turn.items()})
                if stopping and all(state.finished or not state.alive
                                    for state in self.hosts.values()):
                    break
                if self.failure is not None and not self._live_unfinished_hosts():
                    break
                if not any(state.alive for state in self.hosts.values()) and all(
                        state.gone for state in self.hosts.values()):
                    for name in self._unfinished():
                        self.results[name] = "every pipeline died (runtime.max_restarts)"
                    break
                time.sleep(POLL_S)
        finally:
            with self._lock:
                for name in self._unfinished():
                    self.results.setdefault(name, None if stopping else "stopped")
                    if stopping:  # its host went before it could end it: outputs .partial
                        run = self.sources[name]
                        run.unended = f"stopped at frame {run.frames} (its worker was lost " \
                            "while the run was stopping)"
                for pending in self._pending.values():
                    pending.reply = Reply(pending.request.id, error="the run is ending",
                                          conflict=True)
                    pending.done.set()
            self.executor.close()
        return {name: self.results.get(name) for name in self.sources}

    def _should_stop(self) -> bool:
        """``runtime.stop_when`` says the run is over."""
        when = self.config.runtime.stop_when
        if when == "never":
            return False
        with self._lock:
            runs = list(self.sources.items())
        if when == "files_ended" and any(not run.config.is_live for _, run in runs):
            return all(name in self.results for name, run in runs if not run.config.is_live)
        return bool(runs) and all(name in self.results for name, _ in runs)

    def _live_hosts(self) -> list[int]:
        return [host for host, state in self.hosts.items() if state.alive]

    def _placeable_hosts(self) -> list[int]:
        """The hosts sources may go to: alive, not failed, and ready (the model warm) when
        any is: a restarting host takes sources once it can run them."""
        hosts = [h for h, state in self.hosts.items()
                 if state.alive and not state.failed and not state.spare]
        ready = [h for h in hosts if self.hosts[h].ready]
        return ready or hosts

    def _live_unfinished_hosts(self) -> list[int]:
        return [host for host, state in self.hosts.items() if state.alive and not state.finished]

    def _unfinished(self) -> list[str]:
        return [name for name in self.sources if name not in self.results]

    def _poll_hosts(self) -> None:
        now = time.monotonic()
        want_view = self.board is not None and now >= self._next_view
        if want_view:
            self._next_view = now + VIEW_EVERY_S
        done = 0
        turn = self._turn
        deaths = []
        for host in self._live_hosts():
            began = time.monotonic()
            reports, died = self.executor.poll(host)
            polled = time.monotonic()
            if host not in self._answered:
                self._answered.add(host)
                self._first_answer = True
            turn["poll"] += polled - began
            name = self.executor.names[host]
            for report in reports:
                done += self._report(host, report)
                if report.metrics is not None and self.exporter is not None:
                    self.exporter.update(name, list(report.metrics))
                if report.view is not None and self.board is not None:
                    self.board.update(report.view)
            reported = time.monotonic()
            turn["reports"] += reported - polled
            if died is not None:
                deaths.append((host, died))
            elif want_view:
                self.executor.call(host, "want", self.board.wanted(name))
                turn["want"] += time.monotonic() - reported
        # Every host seen dead this turn is marked so before any of their sources move: none
        # of them is taken as a spare (a Ray unit's workers, its spare among them, die together).
        for host, _ in deaths:
            self.hosts[host].alive = False
        for host, died in deaths:
            self._host_died(host, died)
        if want_view:
            self.board.set_engines(self.executor.engine_states())
        if done and self._on_frames is not None:
            self._on_frames(done)

    def _report(self, host: int, report: HostReport) -> int:
        """Take in one report; returns the frames done since the previous one."""
        state = self.hosts[host]
        state.ready, state.finished = report.ready, report.finished
        if state.ready and state.rebalance:
            state.rebalance = False
            self._changed.set()  # the next turn evens the loads, moving sources onto it
        done = 0
        with self._lock:
            for reply in report.replies:
                self._replied(host, reply)
            for name, frames in report.frames.items():
                run = self.sources.get(name)
                if run is not None and run.host == host:
                    done += max(0, frames - run.running_frames)
                    run.running_frames = frames
            for ended in report.ended:
                run = self.sources.get(ended.name)
                if run is not None and run.host == host:
                    done += max(0, ended.frames - run.running_frames)
                    self._ended(host, ended)
            if report.failure is not None and self.failure is None:
                self.failure = (report.failure, report.usage)
            if report.failure is not None:
                state.failed = True
                for name, run in self.sources.items():
                    if run.host == host and name not in self.results:
                        run.host = None
                        self.results[name] = f"pipeline failed: {report.failure}"
        return done

    def _replied(self, host: int, reply: Reply) -> None:
        if reply.source is not None and self.board is not None:
            self.board.added(reply.source, self.executor.names[host])
        pending = self._pending.pop(reply.id, None)
        request = pending.request if pending is not None else None
        if pending is not None:  # added by ``add_source``
            if reply.source is not None:
                source = reply.source
                earlier = self.sources.get(source.name)
                if earlier is not None:  # its name's ended source: kept for the run's summary
                    earlier.result = self.results.get(source.name)
                self.sources[source.name] = SourceRun(
                    source, request.key, added=True, host=host,
                    output_number=reply.output_number, hosts=[self.executor.names[host]],
                    first_frame=source.start_frame)
                self._every.append(self.sources[source.name])
                self.results.pop(source.name, None)
                self.placement[source.name] = host
                self._count += 1
                log.info("source added", source=source.name, host=self.executor.names[host])
            pending.reply = reply
            pending.done.set()
            return
        name = next((n for n, r in self.sources.items()
                     if r.host == host and r.request == reply.id), None)
        if name is None:
            return
        run = self.sources[name]
        if reply.source is None:
            run.host = None
            if run.moving:  # cut before it started there: it starts where it was placed
                run.moving = False
            elif reply.conflict and (self._stop.is_set() or self._abort.is_set() or run.removing):
                self.results.setdefault(name, None)
                if not run.removing and run.ended is None:  # nothing of it is final: a cut
                    run.unended = f"stopped at frame {run.frames} (the run was stopping " \
                        "before it started on its worker)"
            else:
                self.results[name] = reply.error
                log.error("source failed", source=name, host=self.executor.names[host],
                          reason=reply.error)
        else:
            run.output_number = reply.output_number
            if run.first_frame is None:
                run.first_frame = reply.source.start_frame
            elif not run.config.is_live:
                # A moved file resumes after its last record, and its records before that
                # are this run's frames, each once: more than its dead host had reported
                # (the frames it wrote after its last report, up to 0.1 s of them).
                run.frames = max(run.frames, reply.source.start_frame - run.first_frame)
        if pending is not None:
            pending.reply = reply
            pending.done.set()

    def _ended(self, host: int, ended: SourceEnded) -> None:
        """A source's sink finished on ``host``: done, failed, removed, or cut to move."""
        name = ended.name
        run = self.sources[name]
        run.host = None
        run.frames += ended.frames
        run.running_frames = 0
        run.ended = ended
        run.resume = True  # a later start continues its records
        if run.moving:
            run.moving = False
            if run.config.is_live or not ended.complete or ended.error is not None:
                return  # placed already: it starts on its new host
            # A file that reached its end before the cut: it is done, not moved (started
            # again on its new host it would find no partial records and start over).
            self.placement.pop(name, None)
        if ended.error is not None:
            self.results[name] = ended.error
            log.error("source failed", source=name, host=self.executor.names[host],
                      reason=ended.error)
        elif ended.complete or run.removing or self._stop.is_set() or self._abort.is_set():
            self.results[name] = None
        else:  # cut short by something else (its pipeline stopping): place it again
            self.placement.pop(name, None)

    def _host_died(self, host: int, reason: str) -> None:
        """``host`` is gone: its sources go to its group's spare, else to the live hosts
        (``_place``), at once the first time a source moves, after a backoff the next times
        (a source that kills its host is not passed on to kill the next one at once)."""
        state = self.hosts[host]
        spare = None if state.spare else self._take_spare(host)
        state.restart_as_spare = state.spare or spare is not None
        state.alive = state.ready = state.spare = False
        now = time.monotonic()
        moved = []
        with self._lock:
            for name, run in self.sources.items():
                if run.host == host:
                    run.host = None
                    run.frames += run.running_frames
                    run.running_frames = 0
                    run.moving = False
                    run.resume = True
                    if run.removing:
                        self.results.setdefault(name, None)
                        continue
                    moved.append(name)
                    run.not_before = now + (backoff_s(run.moves - 1) if run.moves else 0.0)
                    run.moves += 1
                    if spare is None:
                        self.placement.pop(name, None)
                    else:
                        self.placement[name] = spare
            for request_id, pending in list(self._pending.items()):
                if pending.host == host:
                    del self._pending[request_id]
                    pending.reply = Reply(request_id, error="its pipeline died", conflict=True)
                    pending.done.set()
        if self.board is not None:
            self.board.host_gone(self.executor.names[host])
        self._tell_spares()
        if state.restarts < self.max_restarts:
            state.restart_at = now + backoff_s(state.restarts)
        else:
            state.gone = True
        log.error("source worker died", host=self.executor.names[host], reason=reason,
                  sources=sorted(moved),
                  moved_to="its spare" if spare is not None else "the others",
                  spare=None if spare is None else self.executor.names[spare],
                  restart_in_s=None if state.gone else round(state.restart_at - now, 2))

    def _tell_spares(self) -> None:
        """The live view shows which hosts are idle spares now."""
        if self.board is not None:
            self.board.set_spares([self.executor.names[h] for h, state in self.hosts.items()
                                   if state.spare])

    def _take_spare(self, dead: int) -> int | None:
        """A live spare of ``dead``'s group, ready if any is, now a host like the others (it
        takes ``dead``'s sources), or None."""
        group = self.executor.groups[dead]
        spares = [h for h, state in self.hosts.items() if state.spare and state.alive
                  and not state.failed and self.executor.groups[h] == group]
        if not spares:
            return None
        spare = min(spares, key=lambda h: (not self.hosts[h].ready, h))
        self.hosts[spare].spare = False
        return spare

    def _restart_hosts(self) -> None:
        now = time.monotonic()
        for host, state in self.hosts.items():
            if state.alive or state.gone or state.restart_at is None or now < state.restart_at:
                continue
            back = self.executor.restart(host)
            if back:
                state.restarts += 1
                state.alive, state.restart_at, state.attempts = True, None, 0
                state.finished = state.ready = False
                state.spare, state.rebalance = state.restart_as_spare, not state.restart_as_spare
                self._tell_spares()
                if state.spare:
                    log.info("source worker restarted: it is its group's spare",
                             host=self.executor.names[host], restarts=state.restarts)
                else:
                    log.info("source worker restarted: files are evened onto it once it is "
                             "ready (running cameras stay where they are)",
                             host=self.executor.names[host], restarts=state.restarts)
            elif back is None or state.attempts >= MAX_RESTART_ATTEMPTS:
                state.gone = True
                log.error("source worker gone for good", host=self.executor.names[host])
            else:  # not back yet (Ray still restarting it): ask again
                state.attempts += 1
                state.restart_at = now + backoff_s(state.attempts)

    def _place(self, max_moves: int) -> None:
        """Place every unfinished source on a live host; cut short the sources that move
        (each resumes on its new host once its old one reported its end)."""
        live = [h for h, state in self.hosts.items()
                if state.alive and not state.failed and not state.spare]
        with self._lock:
            names = [n for n in self._unfinished() if not self.sources[n].removing]
            loads = [self.loads[name] for name in names if name in self.loads]
            if not live or not loads:
                return
            before = dict(self.placement)
            # A running camera is never moved to even the loads: the move cuts it and its
            # frames meanwhile are lost (a restarted worker takes files, and new cameras).
            running = {n for n in names if self.sources[n].host is not None
                       and self.sources[n].config.is_live}
            self.placement = rebalance(before, loads, live, max_moves, stay=running)
            for name, run in self.sources.items():
                if run.host is not None and not run.moving and \
                        self.placement.get(name, run.host) != run.host:
                    log.info("moving a source: cutting it short where it runs", source=name,
                             host=self.executor.names[run.host],
                             to=self.executor.names[self.placement[name]])
                    run.moving = True
                    self.executor.call(run.host, "remove", name)

    def _start_placed(self) -> None:
        """Start the placed sources that run nowhere and whose backoff is over."""
        now = time.monotonic()
        with self._lock:
            for name, host in list(self.placement.items()):
                run = self.sources.get(name)
                if (run is None or run.host is not None or run.moving or run.removing
                        or name in self.results or run.not_before > now
                        or not self.hosts[host].alive):
                    continue
                request = SourceRequest(self._next_id, run.config, run.key, resume=run.resume,
                                        output_number=run.output_number)
                self._next_id += 1
                run.request = request.id
                run.host = host
                self.history.append((name, host, request.id))
                run.hosts.append(self.executor.names[host])
                log.info("source placed", source=name, host=self.executor.names[host],
                         resumed=run.resume)
                if self.board is not None and len(run.hosts) == 1:
                    # listed at once (starting, on its host), not only once a host that may
                    # still be starting has taken it
                    self.board.added(run.config, self.executor.names[host])
                self.executor.call(host, "add", request)


class InProcessExecutor:
    """One host in this process (one pipeline: nothing to spawn). ``on_batch_done`` sees
    every batch part (the Python API), with its frames' pictures in ``frames``' format when
    set (``build_graph``)."""

    def __init__(self, config: PipelineConfig, metrics: bool = False,
                 on_batch_done: Callable[..., None] | None = None,
                 frames: str | None = None) -> None:
        self.config = config
        self.names = ["pipeline0"]
        self.groups: list[Any] = [None]
        self.spares: set[int] = set()
        self.host: PipelineHost | None = None
        self._metrics = metrics
        self._on_batch_done = on_batch_done
        self._frames = frames

    def start(self, host: int) -> None:
        self.host = PipelineHost(self.config, self.names[host], on_batch_done=self._on_batch_done,
                                 metrics=self._metrics, frames=self._frames)
        self.host.start()

    def call(self, host: int, method: str, *args: Any) -> None:
        getattr(self.host, method)(*args)

    def poll(self, host: int) -> tuple[list[HostReport], str | None]:
        return [self.host.due_report()], None

    def restart(self, host: int) -> bool | None:
        return None  # it is this process

    def engine_states(self) -> dict[str, dict[str, Any]]:
        return {}  # the model runs in the host

    def close(self) -> None:
        if self.host is not None:
            self.host.stop()
            self.host.join(JOIN_TIMEOUT_S)


class LocalExecutor:
    """Source workers as spawned processes on this machine (``pipeline.app.host.host_main``),
    each fed by its GPU's engine process (``pipeline.app.engine``): one engine per device of
    ``devices`` (None: ``inference.gpu_id``, or the CPU path, as configured).

    An engine that dies is restarted (``runtime.max_restarts`` times): its standby
    (``runtime.standby_engine``) takes over at once, else a new one starts after a backoff;
    its workers keep their sources meanwhile (cameras drop, files wait) and reconnect. An
    engine that cannot start (the backend cannot run here, say) fails its workers: the run
    ends with its reason.

    A worker's death shows at once (``poll``): its engine telling that its connection closed
    without a bye, its end of the pipe closing, or Linux marking it exiting (``exiting``);
    its exit status can come most of a second later (the driver tearing down its CUDA work),
    so it is polled, never waited for (``exit_status``). Each worker's reports are read by a
    thread of its own (``_read_reports``), so a report half sent by a worker killed mid-send
    holds up nothing.

    Args:
        config: the configuration every worker gets (all sources).
        devices: per worker, its GPU, or None; the spares' too.
        metrics: the workers send metrics snapshots.
        on_gpu: the GPU path is in use (NVDEC-decoded sources take device-ring slots).
        spares: the workers (indices into ``devices``) started as spares
            (``runtime.spare_workers``).
        units: the run's sources are shared over this many executors (``--ray``: one per
            GPU of the cluster), so its rings and workers are sized for that share.
    """

    def __init__(self, config: PipelineConfig, devices: list[int | None],
                 metrics: bool = False, on_gpu: bool = False,
                 spares: Collection[int] = (), units: int = 1) -> None:
        from pipeline.app.engine import EngineProcess

        self.config = config
        self.devices = self.groups = devices
        self.spares = set(spares)
        self.metrics = metrics
        self.names = host_names(devices)
        self.cores = max(1, usable_cores() // (len(devices) - len(self.spares)))
        self.sources_per_worker = -(-len(config.sources) //
                                    (units * (len(devices) - len(self.spares))))
        self.processes: dict[int, Any] = {}
        self.conns: dict[int, Connection] = {}
        self.inboxes: dict[int, queue.SimpleQueue[HostReport | None]] = {}
        self._send_lock = threading.Lock()
        self._context = multiprocessing.get_context("spawn")
        from pipeline.app.mps import start_for_run

        # runtime.cuda_mps: the run's CUDA MPS daemon, before any process of it is spawned
        self.mps = start_for_run(config.runtime.cuda_mps, on_gpu)
        self.engines = {device: EngineProcess(
            config, device, devices.count(device), on_gpu, self._context,
            spares=sum(1 for h in self.spares if devices[h] == device),
            standby=config.runtime.standby_engine, units=units)
            for device in dict.fromkeys(devices)}
        self._engine_restart_at: dict[int | None, float] = {}
        self._told_failed: set[int] = set()
        self._dying: list[Any] = []  # dead workers whose exit status was not in yet

    def worker_number(self, host: int) -> int:
        """``host``'s number among its engine's workers (its ring shares)."""
        return self.devices[:host].count(self.devices[host])

    def start(self, host: int) -> None:
        device = self.devices[host]
        engine = self.engines[device]
        if engine.process is None:
            engine.start()
        ours, theirs = self._context.Pipe()
        process = self._context.Process(
            target=host_main, name=f"streamdet-{self.names[host]}", daemon=False,
            args=(self.names[host], device, self.config, theirs, self.metrics, None,
                  self.sources_per_worker,
                  self.cores,
                  (engine.link, self.worker_number(host))))
        start_shielded(process)
        theirs.close()
        self._attach(host, process, ours)
        log.info("source worker started", worker=self.names[host], pid=process.pid,
                 device=device)

    def _attach(self, host: int, process: Any, conn: Connection) -> None:
        """``process`` is ``host`` now, reached through ``conn``, whose reports a thread of
        its own reads as they come (``_read_reports``)."""
        inbox: queue.SimpleQueue[HostReport | None] = queue.SimpleQueue()
        self.processes[host], self.conns[host], self.inboxes[host] = process, conn, inbox
        threading.Thread(target=self._read_reports, args=(conn, inbox), daemon=True,
                         name=f"reports:{self.names[host]}").start()

    def _read_reports(self, conn: Connection, inbox: queue.SimpleQueue) -> None:
        """A host's reports into ``inbox`` until its pipe ends (then None; the pipe is
        closed here). A thread per host: the loop never waits on one host's pipe, where a
        host killed in the middle of sending a report leaves half of it, and reading it
        would wait for the pipe's end (on the H200 that was 0.7 s after the kill: the
        supervisor saw nothing else meanwhile, its engine's word of it neither)."""
        try:
            while True:
                inbox.put(conn.recv()[1])
        except (EOFError, OSError):
            inbox.put(None)
        finally:
            with self._send_lock:  # no ``call`` sends on it as it closes
                conn.close()

    def call(self, host: int, method: str, *args: Any) -> None:
        if method == "stop":  # the run is stopping: its engine needs no standby any more
            self.engines[self.devices[host]].standby_enabled = False
        try:
            with self._send_lock:  # the loop and the live view's threads both call
                self.conns[host].send((method, *args))
        except (BrokenPipeError, OSError):
            pass  # it died: the next poll says so

    def poll(self, host: int) -> tuple[list[HostReport], str | None]:
        for process in [p for p in self._dying if p.exitcode is not None]:
            self._dying.remove(process)
            log.info("source worker exited", pid=process.pid, how=exit_text(process.exitcode))
        engine = self.engines[self.devices[host]]
        self._watch_engine(engine)
        process, inbox = self.processes[host], self.inboxes[host]
        told = process.pid in engine.gone  # its engine saw it go
        engine.gone.discard(process.pid)
        alive = process.is_alive() and not told and not exiting(process.pid)
        reports = []  # what it sent before dying too (read as it came)
        while not inbox.empty():
            report = inbox.get()
            if report is None:  # its end closed: gone, though its exit may take a second
                alive = False
                break
            reports.append(report)
        if engine.failure is not None and host not in self._told_failed:
            self._told_failed.add(host)
            self.call(host, "abort_all")
            reason, usage = engine.failure
            reports.append(HostReport(failure=reason, usage=usage))
        if alive:
            return reports, None
        code = exit_status(process, EXIT_WAIT_S)
        if code is None:  # still exiting: made sure of (it cannot serve any more)
            process.kill()
            self._dying.append(process)  # reaped once it has exited (in ``poll``)
            return reports, f"process {process.pid} ended (its exit status not in yet)"
        return reports, f"process {process.pid} {exit_text(code)}"

    def _watch_engine(self, engine: Any) -> None:
        """Restart ``engine`` when it died (after a backoff), up to runtime.max_restarts."""
        if engine.failure is not None or engine.process is None:
            return
        restart_at = self._engine_restart_at.get(engine.device)
        if restart_at is None:
            died = engine.poll()
            if died is None or engine.failure is not None:
                return
            if engine.restarts >= self.config.runtime.max_restarts:
                engine.failure = (f"the engine died {engine.restarts + 1} times; last: {died}",
                                  False)
                log.error("engine gone for good", reason=died)
                return
            if engine.take_over():  # its standby goes on at once
                engine.restarts += 1
                log.error("engine died: its standby takes over; its workers hold their "
                          "sources until it is ready", reason=died)
                return
            delay = backoff_s(engine.restarts)
            self._engine_restart_at[engine.device] = time.monotonic() + delay
            log.error("engine died: its workers hold their sources until it is back",
                      reason=died, restart_in_s=round(delay, 2))
        elif time.monotonic() >= restart_at:
            del self._engine_restart_at[engine.device]
            engine.restarts += 1
            engine.start()

    def restart(self, host: int) -> bool:
        self.start(host)  # (the old pipe is closed by its reader, at its end)
        return True

    def engine_states(self) -> dict[str, dict[str, Any]]:
        return {engine.name: engine.state() for engine in self.engines.values()}

    def kill(self, host: int) -> int:
        """SIGKILL a source worker process (tests: a crash). Returns its pid."""
        pid = self.processes[host].pid
        os.kill(pid, signal.SIGKILL)
        return pid

    def close(self) -> None:
        servers = self.mps.server_pids() if self.mps is not None else None  # all alive yet
        for host in self.processes:
            self.call(host, "stop")  # (a no-op after the supervisor's own stop)
            self.call(host, "exit")
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for host, process in self.processes.items():
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.warning("source worker did not stop: killing it", worker=self.names[host])
                process.kill()
                process.join(1.0)
        for process in self._dying:
            process.join(1.0)
        for engine in self.engines.values():
            engine.close()
        if self.mps is not None:  # (close may come twice: the daemon is quit once)
            self.mps, mps = None, self.mps
            mps.quit(servers)


def exit_status(process: Any, wait_s: float) -> int | None:
    """``process``'s exit status, waited for ``wait_s`` at most; None if not in by then.

    Never ``join``: a killed worker's end of the sentinel pipe closes as soon as its files
    do, before the driver has torn its CUDA work down, and ``join`` then blocks in
    ``waitpid`` until it has (0.86 s on the H200, the supervisor's whole loop with it)."""
    deadline = time.monotonic() + wait_s
    while (code := process.exitcode) is None and time.monotonic() < deadline:  # (WNOHANG)
        time.sleep(0.01)
    return code


PF_EXITING = 0x4  # include/linux/sched.h: the task is exiting


def exiting(pid: int) -> bool:
    """Whether Linux says process ``pid``'s main thread is exiting (``PF_EXITING`` in
    ``/proc/PID/stat``'s flags): set as a kill takes effect, long before its exit status
    can be had. False where there is no such process or no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return bool(int(fields[6]) & PF_EXITING)  # after ")": state, ..., flags (the 7th)
    except (OSError, IndexError, ValueError):
        return False


def usable_cores() -> int:
    """The cores this process may use (``stages.decode.usable_cores``: its CPU affinity)."""
    from stages.decode import usable_cores as cores

    return cores()


def host_names(devices: list[int | None]) -> list[str]:
    """A name per source worker: ``worker0`` without a GPU of its own, ``gpu1.worker2`` (the
    third worker of GPU 1) with one."""
    return [f"worker{i}" if device is None else f"gpu{device}.worker{devices[:i].count(device)}"
            for i, device in enumerate(devices)]


MAX_DEFAULT_WORKERS = 5  # per GPU (measured on the H200: results-h200.md, issue 25)


def default_workers(sources: int, gpus: int = 1, cores: int | None = None) -> int:
    """Source workers per GPU when ``runtime.workers`` is null: one per source, at most
    ``MAX_DEFAULT_WORKERS`` and at most half the cores (the engine's threads and FFmpeg's
    need the rest); at least one. Each worker is one interpreter, and a CUDA context of its
    own that the GPU time-slices with the others. On the H200 (results-h200.md), 100 paced
    cameras held with 3, 5 and 6 workers and not with 8; with a tracker and a line each
    (event snapshots on) they held with 5 and 6 but not with 3 (the workers' interpreters
    were the wall), and a killed worker's cameras, shared out among the others, cost them
    556-2,696 dropped frames with 5, 3,497 with 3 (``spare_hosts`` adds a spare to take
    them instead)."""
    cores = cores or usable_cores()
    return max(1, min(-(-sources // gpus), MAX_DEFAULT_WORKERS, cores // (2 * gpus)))


def resolve_devices(config: PipelineConfig) -> list[int | None]:
    """One entry per source worker: its GPU, each GPU of ``runtime.gpus`` (``all``: every GPU
    this machine has) ``runtime.workers`` times, or ``runtime.workers`` times None (no GPU
    list: ``inference.gpu_id``, or the CPU path). One entry in all: the whole pipeline runs
    in this process.

    Raises:
        ConfigError: ``all`` and no GPU can be found.
    """
    from pipeline.config import ConfigError

    runtime = config.runtime
    if runtime.gpus is None:
        count = runtime.workers or default_workers(len(config.sources))
        if runtime.workers is None:
            log.info("source workers", workers=count, setting="auto")
        return [None] * count
    gpus: list[int] = list(runtime.gpus) if runtime.gpus != "all" else list(range(gpu_count()))
    if not gpus:
        raise ConfigError("runtime.gpus: 'all' found no GPU on this machine (leave "
                          "runtime.gpus out to run on the CPU)")
    per_gpu = runtime.workers or default_workers(len(config.sources), len(gpus))
    return [gpu for gpu in gpus for _ in range(per_gpu)]


def spare_hosts(config: PipelineConfig, devices: list[int | None]) -> list[int | None]:
    """The spare source workers to start beside ``devices`` (``resolve_devices``): per GPU
    (or in all, on the CPU path), ``runtime.spare_workers``, or when null one where it has
    two or more workers; none when the whole pipeline runs in this process (one entry)."""
    if len(devices) < 2:
        return []
    spares = config.runtime.spare_workers
    return [device for device in dict.fromkeys(devices)
            for _ in range(spares if spares is not None else int(devices.count(device) >= 2))]


GPU_PROBE = """
import ctypes, json
reasons = []
try:
    ctypes.CDLL("libcuda.so.1")
except OSError:
    reasons.append("no NVIDIA driver: libcuda.so.1 not found")
try:
    import cupy
    count = cupy.cuda.runtime.getDeviceCount()
except ImportError:
    count = 0
    reasons.append("CuPy is not installed")
except Exception as error:
    count = 0
    reasons.append(str(error) or type(error).__name__)
print(json.dumps([count, "; ".join(reasons) if count < 1 else None]))
"""


def gpu_probe() -> tuple[int, str | None]:
    """(GPUs of this machine, ``CUDA_VISIBLE_DEVICES`` respected; why there is none, or None
    when there are). Asked in a child process: this one must not create a CUDA context
    before spawning."""
    import json
    import subprocess
    import sys

    try:
        out = subprocess.run([sys.executable, "-c", GPU_PROBE], capture_output=True, text=True,
                             timeout=60)
        count, reason = json.loads(out.stdout.strip().splitlines()[-1])
        return int(count), reason
    except subprocess.TimeoutExpired:
        return 0, "asking CUDA for the GPUs took over 60 s"
    except (OSError, ValueError, IndexError, TypeError):
        return 0, "asking CUDA for the GPUs failed"


def gpu_count() -> int:
    """GPUs of this machine (``gpu_probe``), 0 when CUDA is unusable."""
    return gpu_probe()[0]


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
