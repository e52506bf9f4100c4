"""Failure and recovery through the run path users take, checked against targets: N paced
cameras and two file sources through ``python run.py``; a source worker killed with SIGKILL,
then the engine. Do the cameras deliver again in time, do the others drop, are the files'
records complete?

    python -m benchmarks.failover [--small] [--cameras 100] [--workers N] [--pace-fps 30]
        [--warmup-s S] [--budget-s S] [--out DIR] [--engine-cache DIR]

Needs the live view's packages (``pip install -e '.[live]'``: ``runtime.http`` is on).

The targets: kill -9 of a worker at 100 cameras: its cameras deliver again within 3 s, the
others drop nothing; kill -9 of the engine: every camera delivers again within 20 s; file
records complete, in order, each frame once.

It writes ``OUT/config.yaml``: the cameras (``cam000``, ...: ``benchmarks.live_control``'s
looped clip as ``{live: true, pace_fps, reconnect: false}``), two file sources (``file0``,
``file1``: a short clip, ``live: false``, paced so that each plays for about ``FILE_S`` and
is still running at both kills; a file frame waits, it is never dropped), ``runtime.http``
and ``runtime.metrics_port`` on free loopback ports and ``runtime.log_format: json`` (the
supervisor's log lines ``source worker started`` and ``engine started`` name each process's
pid), no other runtime key but ``runtime.workers`` and ``runtime.standby_engine`` when
asked for. It starts run.py as a new process (``pipeline.app.measurement.launch``; its
output in ``OUT/run.log``), then:

1. waits for ``/api/health`` ok and every source's first frame, scrapes ``/metrics`` from
   then on (``MetricsPoller``), waits ``--warmup-s`` and reads the device memory of each
   process of the run (``nvidia-smi``, where there is one): one model copy per GPU shows
   as one large engine process;
2. kills source worker 1 (``worker1``: its pid from the supervisor's log, checked to be a
   process of this run) with SIGKILL. Its cameras are the ones ``/api/sources`` showed on
   it just before. ``/api/sources`` is polled every ``POLL_S``: a camera delivers again
   when its entry shows that a frame captured after the kill reached its sink (its
   ``last_frame_age_s``, on the host it moved to or on worker1 restarted); the seconds are
   the kill until the poll that showed it (the hosts report every 0.1 s). The others'
   drops: ``pipeline_source_dropped_frames_total`` of every other camera, summed over the
   hosts it ran on (``measurement.dropped_between``), from the kill until ``watch_s`` after
   it (or the last of its cameras' return, if later);
3. waits until every camera delivers (a frame captured after the wait began), waits
   ``--warmup-s``, kills the engine (``sd.engine``: its pid from the log) and
   measures the same way the seconds until each camera delivers again (a frame captured
   after the kill went through the new engine);
4. waits for both files to end (their final JSONL), stops run.py with SIGINT and reads its
   exit status (0 expected), and checks each file's JSONL: frames 0..n-1 in order, each
   once, n the clip's frame count.

Writes ``OUT/results.md`` (the table, also printed) and ``OUT/results.json`` (every number,
each camera's seconds). The pids come from the log (the process names, ``sd.engine``,
``sd.worker1``, are shown in the table).

Full mode (the H200): YOLOv8s-fall 640, torch FP16, batch 64, compile cache
``--engine-cache``; 100 cameras of the 1080p clip at 30 fps, decode auto, the default count
of source workers (``runtime.workers`` not set); the files play the 1080p clip (250 frames).
``--small`` (CI, no GPU): ``runtime.workers: 2``, 4 cameras of bikes.mp4 at 3 fps, the files
play carphone (120 frames), YOLOv3-tiny on the CPU, shorter waits.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from benchmarks.live_control import (
    EXIT_MEANING,
    BenchmarkError,
    camera_clip,
    get_json,
    make_clip,
    num,
    wait_delivering,
    wait_healthy,
)
from pipeline.app.measurement import (
    MeasurementError,
    MetricsPoller,
    dropped_between,
    free_port,
    launch,
    process_tree,
    query_compute_apps,
    stop,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
VICTIM = "worker1"  # the source worker killed
WORKER_TARGET_S, ENGINE_TARGET_S = 3.0, 20.0  # issue 25's bounds
POLL_S = 0.1  # /api/sources while waiting for the cameras
METRICS_LAG_S = 1.5  # hosts send metrics once a second: wait this long for a time's counters
STOP_RESERVE_S = 45.0  # --budget-s: left for stopping run.py and writing the results
FILES = ("file0", "file1")


@dataclass(frozen=True)
class Mode:
    """The settings of ``--small`` or full mode (the flags override the first four)."""

    cameras: int
    pace_fps: float
    workers: int | None  # runtime.workers; None: not set (the default config)
    warmup_s: float
    watch_s: float  # after killing the worker, the others' drops are counted this long
    worker_limit_s: float  # longest wait for the killed worker's cameras
    fresh_limit_s: float  # before the engine kill, longest wait for every camera's fresh frame
    engine_limit_s: float  # longest wait for every camera after killing the engine
    file_s: float  # each file plays about this long (its pace: its frames / this)
    health_s: float  # longest wait from the launch until /api/health says ok
    run_s: float  # a camera's clip lasts this long (the looped clip is cached by length)


# Small: a camera with no fresh frame (a CI machine busy with a second test file starves the
# CPU engine) delays the engine kill 10 s at most, so the files (40 s) still run at the kill.
SMALL = Mode(cameras=4, pace_fps=3.0, workers=2, warmup_s=2.0, watch_s=6.0,
             worker_limit_s=30.0, fresh_limit_s=10.0, engine_limit_s=60.0, file_s=40.0,
             health_s=120.0, run_s=120.0)
FULL = Mode(cameras=100, pace_fps=30.0, workers=None, warmup_s=10.0, watch_s=10.0,
            worker_limit_s=30.0, fresh_limit_s=30.0, engine_limit_s=120.0, file_s=90.0,
            health_s=420.0, run_s=160.0)


@dataclass
class Plan:
    """What one run measures."""

    small: bool
    cameras: int
    workers: int | None
    pace_fps: float
    file_fps: float
    file_frames: int
    warmup_s: float
    watch_s: float
    clip: Path
    file_clip: Path
    model: Path
    names: Path
    engine_cache: Path
    out: Path
    records: Path  # output.dir
    http_port: int
    metrics_port: int
    standby_engine: bool = True  # runtime.standby_engine (false: written in the config)

    @property
    def camera_names(self) -> list[str]:
        return [f"cam{i:03d}" for i in range(self.cameras)]

    def config(self) -> dict[str, Any]:
        inference = ({"device": "cpu", "backend": "onnxruntime", "batch_size": 4}
                     if self.small else
                     {"device": "cuda", "backend": "torch", "precision": "fp16",
                      "batch_size": 64, "engine_cache": str(self.engine_cache)})
        cameras = [{"name": name, "uri": str(self.clip), "live": True, "pace_fps": self.pace_fps,
                    "reconnect": False, "decode": "auto"} for name in self.camera_names]
        files = [{"name": name, "uri": str(self.file_clip), "live": False,
                  "pace_fps": self.file_fps, "decode": "auto"} for name in FILES]
        runtime: dict[str, Any] = {"http": {"port": self.http_port},
                                   "metrics_port": self.metrics_port, "progress": False,
                                   "stop_when": "never", "log_format": "json"}
        if self.workers is not None:
            runtime["workers"] = self.workers
        if not self.standby_engine:
            runtime["standby_engine"] = False
        return {
            "sources": cameras + files,
            "model": {"path": str(self.model), "class_names": str(self.names)},
            "inference": inference,
            "output": {"dir": str(self.records), "video": None, "jsonl": "{source}.jsonl"},
            "runtime": runtime,
        }


@dataclass
class Kill:
    """One SIGKILL and what followed; None: not measured (the notes say why).

    Attributes:
        target: ``worker1`` or ``engine``.
        pid: the process killed; comm: its name in /proc.
        cameras: the cameras waited for (the worker's, or all).
        recovered_s: camera -> seconds from the kill until it delivered again.
        limit_s: the longest wait.
        replaced_s: the kill until the supervisor logged the new process; new_pid its pid.
        seen_s: the worker: the kill until the supervisor logged its death;
            engine_seen_s: until its engine logged its connection gone without a bye.
        ready_s: the engine: the kill until the supervisor logged it ready.
        from_standby: the engine: its standby took over (``runtime.standby_engine``).
        phases_s: the engine: where the new engine's start went (its ``engine ready`` line).
        steps_s: the worker: where its cameras' time to deliver again went, step ->
            (median, slowest) over its cameras of the seconds from the kill until the log
            said it of the camera (``MOVE_STEPS``), ``decoding`` (when its first packet went
            to the decoder: its first frame's line less that line's ``phases_s.decode``) and
            ``delivered`` (``recovered_s``).
        others: the cameras not waited for (the worker kill: all others).
        others_dropped: their drops from the kill over ``watched_s``.
        own_dropped: the waited-for cameras' drops over the same span.
        files: file source -> {"host", "frames", "state"} just before the kill.
    """

    target: str
    pid: int | None = None
    comm: str | None = None
    cameras: list[str] = field(default_factory=list)
    recovered_s: dict[str, float] = field(default_factory=dict)
    limit_s: float = 0.0
    replaced_s: float | None = None
    new_pid: int | None = None
    seen_s: float | None = None
    engine_seen_s: float | None = None
    ready_s: float | None = None
    from_standby: bool | None = None
    phases_s: dict[str, float] | None = None
    steps_s: dict[str, tuple[float, float]] | None = None
    others: list[str] = field(default_factory=list)
    others_dropped: int | None = None
    own_dropped: int | None = None
    watched_s: float | None = None
    files: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def missing(self) -> list[str]:
        """The cameras that did not deliver again within the limit."""
        return [name for name in self.cameras if name not in self.recovered_s]

    @property
    def max_s(self) -> float | None:
        """The slowest camera's seconds; None when one never came back (or none measured)."""
        if not self.cameras or self.missing:
            return None
        return max(self.recovered_s.values())


@dataclass
class FileCheck:
    """A file source's JSONL against its clip."""

    name: str
    expected: int  # the clip's frames
    path: str = ""
    lines: int = 0
    final: bool = False  # under its final name (not .partial): it ended complete
    problem: str | None = "no records"

    @property
    def complete(self) -> bool:
        return self.final and self.problem is None


@dataclass
class Result:
    """Everything measured; None: not measured (the notes say why)."""

    start_s: float | None = None  # launch until /api/health said ok
    all_s: float | None = None  # launch until every source had delivered a frame
    memory: list[tuple[str, int, float]] | None = None  # (process, pid, MiB) before the kills
    memory_other: dict[int, float] = field(default_factory=dict)  # listed, not of this run
    worker: Kill | None = None
    engine: Kill | None = None
    files: list[FileCheck] = field(default_factory=list)
    exit_code: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def files_complete(self) -> bool:
        return len(self.files) == len(FILES) and all(check.complete for check in self.files)

    @property
    def measured(self) -> bool:
        """Both kills measured, the exit status read and the files checked."""
        return (self.worker is not None and bool(self.worker.cameras)
                and self.worker.others_dropped is not None and self.engine is not None
                and bool(self.engine.cameras) and self.exit_code is not None
                and len(self.files) == len(FILES))


# ---- the run's processes -----------------------------------------------------------------


def logged(log: Path, *events: str) -> list[tuple[float, dict[str, Any]]]:
    """The JSON log records of any of ``events`` in run.log, in order, each with its second
    since the launch (the prefix ``measurement.launch`` writes)."""
    found = []
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return found
    quoted = [f'"{event}"' for event in events]
    for line in text.splitlines():
        at, _, rest = line.strip().partition(" ")
        if not rest.startswith("{") or not any(q in rest for q in quoted):
            continue
        try:
            record, seconds = json.loads(rest), float(at)
        except ValueError:
            continue
        if record.get("event") in events:
            found.append((seconds, record))
    return found


def comm(pid: int) -> str | None:
    """The process's name (``/proc/PID/comm``), or None when it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def worker_pids(log: Path) -> dict[str, int]:
    """Source worker name -> the pid of its latest start (the supervisor's log)."""
    return {record["worker"]: int(record["pid"])
            for _, record in logged(log, "source worker started")}


def engine_pid(log: Path) -> int | None:
    """The pid of the latest engine start (the supervisor's log), or None."""
    started = logged(log, "engine started")
    return int(started[-1][1]["pid"]) if started else None


def ours(pid: int | None, run_pid: int) -> int:
    """``pid``, checked to be a live process of the run.

    Raises:
        BenchmarkError: it is not.
    """
    if pid is None or pid not in process_tree(run_pid) or comm(pid) is None:
        raise BenchmarkError(f"process {pid} is not a running process of run.py ({run_pid})")
    return pid


def memory_by_process(run_pid: int, log: Path, result: Result) -> None:
    """Device memory of each process of the run (``nvidia-smi``), largest first."""
    used = query_compute_apps()
    if used is None:
        result.notes.append("no nvidia-smi: device memory not read")
        return
    names = {pid: name for name, pid in worker_pids(log).items()}
    engine = engine_pid(log)
    if engine is not None:
        names[engine] = "engine"
    names[run_pid] = "run.py"
    tree = set(process_tree(run_pid))
    result.memory = sorted(((names.get(pid, comm(pid) or "?"), pid, mib)
                            for pid, mib in used.items() if pid in tree), key=lambda r: -r[2])
    result.memory_other = {pid: mib for pid, mib in used.items() if pid not in tree}
    if result.memory_other and not result.memory:
        result.notes.append(f"nvidia-smi listed {len(result.memory_other)} processes, none of "
                            f"this run's pids (a container's pid namespace?): "
                            f"{result.memory_other}")


# ---- /api/sources --------------------------------------------------------------------------


def sources_now(base: str) -> tuple[float, dict[str, dict[str, Any]]]:
    """(``time.time()`` just before the request, name -> entry of ``/api/sources``)."""
    asked = time.time()
    return asked, {entry["name"]: entry for entry in get_json(f"{base}/api/sources")["sources"]}


def captured_after(entry: dict[str, Any] | None, asked: float, since: float) -> bool:
    """The entry (read at ``asked``, wall clock) shows that a frame captured after ``since``
    reached the source's sink. A source being placed again (``starting``, ``reconnecting``)
    shows its last host's counters: not yet."""
    if entry is None or entry.get("state") in ("starting", "reconnecting"):
        return False
    age = entry.get("last_frame_age_s")
    return age is not None and asked - age > since


def check_running(process: subprocess.Popen[Any]) -> None:
    if process.poll() is not None:
        raise BenchmarkError(f"run.py exited with {process.returncode} during the measurement; "
                             f"see run.log")


def wait_recovered(base: str, process: subprocess.Popen[Any], cameras: list[str],
                   since: float, since_wall: float, until: float) -> dict[str, float]:
    """Camera -> seconds from ``since`` (``time.monotonic()``; ``since_wall`` the same moment
    by ``time.time()``) until ``/api/sources`` showed a frame of it captured after it; polls
    until all did or ``until``."""
    recovered: dict[str, float] = {}
    while len(recovered) < len(cameras) and time.monotonic() < until:
        check_running(process)
        try:
            asked, entries = sources_now(base)
        except (OSError, ValueError, BenchmarkError):
            time.sleep(POLL_S)
            continue
        seen = time.monotonic() - since
        for name in cameras:
            if name not in recovered and captured_after(entries.get(name), asked, since_wall):
                recovered[name] = seen
        time.sleep(POLL_S)
    return recovered


def wait_fresh(base: str, process: subprocess.Popen[Any], cameras: list[str],
               until: float) -> list[str]:
    """Wait until every camera delivered a frame captured after this wait began (so on a
    slow machine too, whatever the pipeline's latency); returns the ones that still had not
    at ``until``."""
    began, stale = time.time(), list(cameras)
    while time.monotonic() < until:
        check_running(process)
        try:
            asked, entries = sources_now(base)
        except (OSError, ValueError, BenchmarkError):
            time.sleep(POLL_S)
            continue
        stale = [name for name in cameras
                 if not captured_after(entries.get(name), asked, began)]
        if not stale:
            break
        time.sleep(POLL_S)
    return stale


def files_at(entries: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """File source -> its host, frames and state in ``/api/sources`` (the frames are its
    current host's: a file moved there counts from where it resumed)."""
    return {name: {key: entries[name].get(key) for key in ("host", "frames", "state")}
            for name in FILES if name in entries}


# ---- the steps ---------------------------------------------------------------------------


@dataclass
class Run:
    """The running child and what measures it."""

    plan: Plan
    process: subprocess.Popen[Any]
    poller: MetricsPoller
    log: Path
    started: float  # time.monotonic() at the launch
    deadline: float  # time.monotonic() by which the steps must end (--budget-s)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.plan.http_port}"

    def until(self, seconds: float) -> float:
        return min(time.monotonic() + seconds, self.deadline)

    def since_kill(self, records: list[tuple[float, dict[str, Any]]], killed: float,
                   old_pid: int) -> tuple[float | None, dict[str, Any] | None]:
        """The first of ``records`` logged after the kill by a process other than
        ``old_pid``: (seconds from the kill, record)."""
        for at, record in records:
            seconds = self.started + at - killed
            if seconds >= 0 and record.get("pid") != old_pid:
                return seconds, record
        return None, None


def kill_worker(run: Run, mode: Mode, result: Result) -> None:
    """Step 2 (module docstring)."""
    plan = run.plan
    kill = result.worker = Kill(VICTIM, limit_s=mode.worker_limit_s)
    _, entries = sources_now(run.base)
    kill.cameras = [n for n in plan.camera_names if entries.get(n, {}).get("host") == VICTIM]
    kill.others = [n for n in plan.camera_names if n not in kill.cameras]
    kill.files = files_at(entries)
    if not kill.cameras:
        hosts = sorted({str(entries.get(n, {}).get("host")) for n in plan.camera_names})
        raise BenchmarkError(f"no camera runs on {VICTIM} (hosts: {', '.join(hosts)})")
    pid = kill.pid = ours(worker_pids(run.log).get(VICTIM), run.process.pid)
    kill.comm = comm(pid)
    killed, killed_wall = time.monotonic(), time.time()
    os.kill(pid, signal.SIGKILL)
    print(f"killed {VICTIM} (pid {pid}, {len(kill.cameras)} cameras)", flush=True)
    kill.recovered_s = wait_recovered(run.base, run.process, kill.cameras, killed, killed_wall,
                                      run.until(mode.worker_limit_s))
    watched_s = max([plan.watch_s, *kill.recovered_s.values()])
    time.sleep(max(0.0, killed + watched_s + METRICS_LAG_S - time.monotonic()))
    end = killed + watched_s + METRICS_LAG_S
    kill.watched_s = watched_s
    kill.others_dropped = dropped_between(run.poller, killed, end, set(kill.others))
    kill.own_dropped = dropped_between(run.poller, killed, end, set(kill.cameras))
    starts = [(at, {**record, "pid": int(record["pid"])})
              for at, record in logged(run.log, "source worker started")
              if record.get("worker") == VICTIM]
    kill.replaced_s, record = run.since_kill(starts, killed, pid)
    kill.new_pid = None if record is None else record["pid"]
    died = [(at, {**record, "pid": None}) for at, record in logged(run.log, "source worker died")
            if record.get("host") == VICTIM]
    kill.seen_s, _ = run.since_kill(died, killed, pid)
    gone = [(at, {**record, "pid": None}) for at, record in logged(run.log, "worker gone")
            if not record.get("said_bye") and record.get("pid") in (pid, None)]
    kill.engine_seen_s, _ = run.since_kill(gone, killed, pid)
    kill.steps_s = move_steps(run, killed, kill)


MOVE_STEPS = {"placed": "source placed", "added": "source added", "opened": "source opened",
              "first frame": "source first frame"}  # a moved camera's log lines, in order


def move_steps(run: Run, killed: float, kill: Kill) -> dict[str, tuple[float, float]]:
    """``Kill.steps_s`` of the worker kill: per step of ``MOVE_STEPS``, the seconds from the
    kill until each of its cameras' first such line after the kill (the log's seconds since
    the launch, as read by ``measurement.launch``), as (median, slowest)."""
    lines = logged(run.log, *MOVE_STEPS.values())  # the log read once
    steps: dict[str, tuple[float, float]] = {}
    for step, event in MOVE_STEPS.items():
        seconds: dict[str, float] = {}
        decoding: dict[str, float] = {}  # when its first packet went to the decoder
        for at, record in lines:
            after = run.started + at - killed
            if record["event"] == event and after >= 0 and record.get("source") in kill.cameras:
                seconds.setdefault(record["source"], after)
                if step == "first frame" and "phases_s" in record:
                    decoding.setdefault(record["source"], after - record["phases_s"]["decode"])
        if decoding:
            steps["decoding"] = (statistics.median(decoding.values()), max(decoding.values()))
        if seconds:
            steps[step] = (statistics.median(seconds.values()), max(seconds.values()))
    if kill.recovered_s:
        steps["delivered"] = (statistics.median(kill.recovered_s.values()),
                              max(kill.recovered_s.values()))
    return steps


def kill_engine(run: Run, mode: Mode, result: Result) -> None:
    """Step 3 (module docstring)."""
    plan = run.plan
    stale = wait_fresh(run.base, run.process, plan.camera_names, run.until(mode.fresh_limit_s))
    if stale:
        result.notes.append(f"before the engine kill, {len(stale)} cameras had no fresh frame "
                            f"(first: {stale[:3]}); killed it all the same")
    time.sleep(max(0.0, min(plan.warmup_s, run.deadline - time.monotonic())))
    if not stale:
        wait_fresh(run.base, run.process, plan.camera_names, run.until(mode.fresh_limit_s))
    kill = result.engine = Kill("engine", limit_s=mode.engine_limit_s)
    kill.cameras = list(plan.camera_names)
    _, entries = sources_now(run.base)
    kill.files = files_at(entries)
    pid = kill.pid = ours(engine_pid(run.log), run.process.pid)
    kill.comm = comm(pid)
    killed, killed_wall = time.monotonic(), time.time()
    os.kill(pid, signal.SIGKILL)
    print(f"killed the engine (pid {pid})", flush=True)
    kill.recovered_s = wait_recovered(run.base, run.process, kill.cameras, killed, killed_wall,
                                      run.until(mode.engine_limit_s))
    watched_s = max([0.0, *kill.recovered_s.values()])
    time.sleep(max(0.0, killed + watched_s + METRICS_LAG_S - time.monotonic()))
    kill.watched_s = watched_s
    kill.own_dropped = dropped_between(run.poller, killed, killed + watched_s + METRICS_LAG_S,
                                       set(kill.cameras))
    starts = [(at, {**record, "pid": int(record["pid"])})
              for at, record in logged(run.log, "engine started")]
    kill.replaced_s, record = run.since_kill(starts, killed, pid)
    kill.new_pid = None if record is None else record["pid"]
    kill.from_standby = None if record is None else bool(record.get("from_standby"))
    ready = [(at, record) for at, record in logged(run.log, "engine ready")]
    kill.ready_s, _ = run.since_kill(ready, killed, pid)
    _, own = run.since_kill([(at, r) for at, r in ready if "phases_s" in r], killed, pid)
    kill.phases_s = None if own is None else own["phases_s"]


def wait_files(run: Run, mode: Mode, result: Result) -> None:
    """Until both files' JSONL has its final name (they ended), or the wait is over."""
    until = run.until(mode.file_s + mode.engine_limit_s)
    waiting = list(FILES)
    while waiting and time.monotonic() < until:
        check_running(run.process)
        waiting = [n for n in FILES if not (run.plan.records / f"{n}.jsonl").exists()]
        time.sleep(0.25)
    if waiting:
        result.notes.append(f"{', '.join(waiting)} had not ended when run.py was stopped")


def phases_text(phases: dict[str, float]) -> str:
    """An engine's ``phases_s`` as ``gpu 1.2, backend 0.4, ...``."""
    return ", ".join(f"{name} {seconds:g}" for name, seconds in phases.items())


def check_file(records: Path, name: str, expected: int) -> FileCheck:
    """``name``'s JSONL (its final name, else its .partial one): frames 0..expected-1, in
    order, each once."""
    check = FileCheck(name, expected)
    final = records / f"{name}.jsonl"
    path = final if final.exists() else records / f"{name}.partial.jsonl"
    if not path.exists():
        return check
    check.path, check.final = str(path), path == final
    frames = [json.loads(line)["frame"] for line in path.read_text().splitlines() if line]
    check.lines = len(frames)
    if frames == list(range(expected)):
        check.problem = None
        return check
    seen = set(frames)
    problems = []
    if len(seen) < len(frames):
        problems.append(f"{len(frames) - len(seen)} frames twice or more")
    missing = [i for i in range(expected) if i not in seen]
    if missing:
        problems.append(f"{len(missing)} missing (first: {missing[:5]})")
    extra = sorted(i for i in seen if not 0 <= i < expected)
    if extra:
        problems.append(f"{len(extra)} beyond the clip (first: {extra[:5]})")
    if any(b < a for a, b in zip(frames, frames[1:])):
        problems.append("out of order")
    check.problem = "; ".join(problems) or "differs"
    return check


def measure(plan: Plan, mode: Mode, command: list[str], result: Result, health_s: float,
            deadline: float) -> None:
    """Launch run.py, measure (module docstring), stop it, check the files."""
    base = f"http://127.0.0.1:{plan.http_port}"
    poller = MetricsPoller(f"http://127.0.0.1:{plan.metrics_port}/metrics")
    log = plan.out / "run.log"
    started = time.monotonic()
    process, reader = launch(command, log, cwd=REPO_ROOT)
    run = Run(plan, process, poller, log, started, deadline)
    try:
        result.start_s = wait_healthy(base, process, health_s, started)
        result.all_s = wait_delivering(base, process, health_s, started)
        poller.start()
        time.sleep(plan.warmup_s)
        memory_by_process(process.pid, log, result)
        kill_worker(run, mode, result)
        kill_engine(run, mode, result)
        wait_files(run, mode, result)
    finally:
        poller.stop()
        wait_s = max(15.0, min(120.0, deadline + STOP_RESERVE_S - 10 - time.monotonic()))
        result.exit_code, note = stop(process, wait_s)
        if note is not None:
            result.notes.append(note)
        reader.join(10)
        result.files = [check_file(plan.records, name, plan.file_frames) for name in FILES]
        for check in result.files:
            if check.path:
                shutil.copy(check.path, plan.out / Path(check.path).name)


# ---- the report --------------------------------------------------------------------------


def spread_text(kill: Kill) -> str:
    """Median and slowest of the cameras' seconds, and the cameras that never came back."""
    if not kill.recovered_s:
        return "none delivered again"
    values = sorted(kill.recovered_s.items(), key=lambda item: -item[1])
    text = (f"{len(kill.recovered_s)} of {len(kill.cameras)} cameras; median "
            f"{statistics.median(kill.recovered_s.values()):.2f} s; slowest "
            + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in values[:3]))
    if kill.missing:
        text += (f"; NOT within {kill.limit_s:g} s: {len(kill.missing)} "
                 f"(first: {', '.join(kill.missing[:3])})")
    return text


def yes(value: bool) -> str:
    return "yes" if value else "NO"


def verdict(result: Result) -> str:
    worker, engine = result.worker, result.engine
    parts = []
    if worker is not None and worker.cameras:
        parts.append(f"worker kill: its cameras again within {WORKER_TARGET_S:g} s "
                     f"{yes(worker.max_s is not None and worker.max_s <= WORKER_TARGET_S)}, "
                     f"the others dropped nothing {yes(worker.others_dropped == 0)}")
    else:
        parts.append("worker kill: not measured")
    if engine is not None and engine.cameras:
        parts.append(f"engine kill: every camera again within {ENGINE_TARGET_S:g} s "
                     f"{yes(engine.max_s is not None and engine.max_s <= ENGINE_TARGET_S)}")
    else:
        parts.append("engine kill: not measured")
    parts.append(f"files complete, each frame once {yes(result.files_complete)}")
    parts.append(f"exit 0 after SIGINT {yes(result.exit_code == 0)}")
    return "Targets: " + "; ".join(parts)


def markdown(plan: Plan, result: Result, header: str) -> str:
    rows: list[tuple[str, str, str]] = [
        ("start: launch until /api/health ok", f"{num(result.start_s, 1)} s", ""),
        ("start: launch until every source delivered", f"{num(result.all_s, 1)} s", ""),
    ]
    if result.memory is not None:
        holders = [row for row in result.memory if row[2] > 0]
        rows.append(("device memory: processes holding some", str(len(holders)),
                     "one model copy per GPU: one large engine process"))
        rows += [(f"device memory: {name}", f"{mib:,.0f} MiB", f"pid {pid}")
                 for name, pid, mib in result.memory]
    for kill in (result.worker, result.engine):
        if kill is None:
            continue
        what = f"kill -9 {kill.target}"
        target = WORKER_TARGET_S if kill.target == VICTIM else ENGINE_TARGET_S
        rows.append((f"{what}: max seconds to deliver again",
                     f"{num(kill.max_s, 2)} s" if kill.max_s is not None else
                     f"> {kill.limit_s:g} s" if kill.missing else "-",
                     f"target <= {target:g} s; {spread_text(kill)}; pid {kill.pid} "
                     f"({kill.comm}); until /api/sources showed a frame captured after the "
                     f"kill"))
        if kill.target == VICTIM:
            rows.append((f"{what}: the others' drops", num(kill.others_dropped),
                         f"target 0; {len(kill.others)} other cameras, from the kill over "
                         f"{num(kill.watched_s, 1)} s (+/- a metrics second); its own cameras "
                         f"dropped {num(kill.own_dropped)}"))
        else:
            rows.append((f"{what}: dropped meanwhile", num(kill.own_dropped),
                         f"every camera, from the kill over {num(kill.watched_s, 1)} s (live "
                         f"frames drop while it is away)"))
        engine = kill.target == "engine"
        rows.append((f"{what}: replaced", f"{num(kill.replaced_s, 2)} s",
                     f"new pid {kill.new_pid or '-'}"
                     + (" (its standby)" if engine and kill.from_standby else "")
                     + (f"; ready after {num(kill.ready_s, 2)} s" if engine else "")
                     + " (the supervisor's log)"
                     + (f"; the supervisor saw it die after {num(kill.seen_s, 2)} s, its "
                        f"engine after {num(kill.engine_seen_s, 2)} s" if not engine else "")
                     + (f"; its start's phases (s): {phases_text(kill.phases_s)}"
                        if engine and kill.phases_s else "")))
        if kill.steps_s:
            rows.append((f"{what}: its cameras' steps", "seconds after the kill", "; ".join(
                f"{step} {median:.2f} / {slowest:.2f}"
                for step, (median, slowest) in kill.steps_s.items())
                + " (median / slowest over its cameras, when run.log said it of each: "
                + ", ".join(f"{step}: '{event}'" for step, event in MOVE_STEPS.items())
                + "; decoding: its first packet handed to the decoder, the first frame's "
                "time less the 'decode' of that line's phases_s; delivered: as above; run.log's "
                "times are when each line reached this benchmark, to 10 ms: lines a process "
                "wrote together arrive together, so 'decoding' can read before 'opened', and "
                "a new host may log 'source opened' before 'source added')"))
        rows.append((f"{what}: files at the kill", "", "; ".join(
            f"{n}: on {at['host']}, {at['frames']} frames there, {at['state']}"
            for n, at in kill.files.items()) or "-"))
    for check in result.files:
        rows.append((f"file {check.name}: complete, each frame once", yes(check.complete),
                     f"{check.lines} records of {check.expected} frames"
                     + (" (still .partial)" if check.path and not check.final else "")
                     + (f"; {check.problem}" if check.problem else "")))
    rows.append(("exit status after SIGINT", num(result.exit_code),
                 EXIT_MEANING.get(result.exit_code, "killed by a signal")
                 if result.exit_code is not None else ""))
    lines = [header, "", "| measurement | value | notes |", "|---|---|---|"]
    lines += [f"| {name} | {value} | {notes} |" for name, value, notes in rows]
    lines.append("")
    lines += [f"Note: {note}" for note in result.notes]
    lines.append(verdict(result))
    return "\n".join(lines) + "\n"


def as_json(plan: Plan, result: Result) -> dict[str, Any]:
    data = asdict(result)
    for key, kill in (("worker", result.worker), ("engine", result.engine)):
        if kill is not None:
            data[key].update(max_s=kill.max_s, missing=kill.missing)
    data["files_complete"] = result.files_complete
    data["verdict"] = verdict(result)
    data["plan"] = {key: str(value) if isinstance(value, Path) else value
                    for key, value in asdict(plan).items()}
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.failover",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="CPU-only mode for CI")
    parser.add_argument("--cameras", type=int, default=None, help="default 100; small: 4")
    parser.add_argument("--workers", type=int, default=None,
                        help="runtime.workers, at least 2 (default: not set, the automatic "
                             "count; small: 2)")
    parser.add_argument("--pace-fps", type=float, default=None, help="default 30; small: 3")
    parser.add_argument("--warmup-s", type=float, default=None,
                        help="before the first kill and between the kills (default 10; small: 2)")
    parser.add_argument("--no-standby-engine", action="store_true",
                        help="runtime.standby_engine: false (a dead engine is started anew)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="passed on to run.py (--set runtime.cuda_mps=false)")
    parser.add_argument("--engine-cache", type=Path, default=REPO_ROOT / "assets" / "engines")
    parser.add_argument("--assets", type=Path, default=REPO_ROOT / "assets")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="end within about this many seconds (each wait is cut to fit)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/failover"),
                        help="folder for the config, run.log, the files' JSONL and the results")
    began = time.monotonic()
    args = parser.parse_args(argv)
    small = args.small
    mode = SMALL if small else FULL
    cameras = args.cameras or mode.cameras
    workers = args.workers if args.workers is not None else mode.workers
    pace_fps = args.pace_fps or mode.pace_fps
    warmup_s = args.warmup_s if args.warmup_s is not None else mode.warmup_s
    if cameras < 2 or (workers is not None and workers < 2):
        parser.error("--cameras and --workers: at least 2 (a worker is killed, "
                     "the others go on)")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in ("results.md", "results.json", *(f"{n}.jsonl" for n in FILES),
                *(f"{n}.partial.jsonl" for n in FILES)):
        (out / old).unlink(missing_ok=True)
    assets = args.assets.resolve()
    deadline = (began + args.budget_s - STOP_RESERVE_S if args.budget_s is not None
                else float("inf"))
    try:
        import starlette  # noqa: F401 - runtime.http needs it (and uvicorn): said before the run
        import uvicorn  # noqa: F401

        from pipeline.app.clips import clip_frames
        from samples.fetch import SamplePaths

        clip, clip_text = make_clip(small, assets, mode.run_s, pace_fps)
        file_clip = SamplePaths.under(assets).carphone if small else camera_clip(False, assets)
        if not file_clip.exists():
            raise BenchmarkError(f"{file_clip} is missing: run python -m samples.fetch")
        file_frames = clip_frames(file_clip)
        if small:
            model, names = assets / "models" / "yolov3-tiny.onnx", assets / "models" / "coco.names"
            what = "YOLOv3-tiny 416, onnxruntime on the CPU"
        else:
            from samples.yolov8 import ensure_yolov8

            model, names = ensure_yolov8(assets, log=print)
            what = f"YOLOv8s-fall 640, torch FP16, batch 64, compile cache {args.engine_cache}"
        # what must follow the start: warm-ups, the worker's watch, the engine's return
        rest_s = 2 * warmup_s + mode.watch_s + 2 * METRICS_LAG_S + 30
        health_s = min(mode.health_s, deadline - time.monotonic() - rest_s)
        if health_s < 30:
            raise BenchmarkError(f"--budget-s {args.budget_s:g}: no time left to start (the "
                                 f"steps after it take {rest_s:g} s at least, and "
                                 f"{STOP_RESERVE_S:g} s to stop)")
        records = Path(tempfile.mkdtemp(prefix="failover-records-"))
        plan = Plan(small, cameras, workers, pace_fps, round(file_frames / mode.file_s, 2),
                    file_frames, warmup_s, mode.watch_s, clip, file_clip, model, names,
                    args.engine_cache.resolve(), out, records, free_port(), free_port(),
                    not args.no_standby_engine)
        config_path = out / "config.yaml"
        config_path.write_text(yaml.safe_dump(plan.config(), sort_keys=False))
        command = [sys.executable, "run.py", "--config", str(config_path),
                   *(word for item in args.set for word in ("--set", item))]
        me = "python -m benchmarks.failover " + shlex.join(argv if argv is not None
                                                          else sys.argv[1:])
        layout = (f"runtime.workers {workers}" if workers is not None
                  else "default workers (runtime.workers not set)")
        header = (f"Failover ({me.strip()}): `{shlex.join(['python', *command[1:]])}`; "
                  f"{cameras} paced cameras (live, {pace_fps:g} fps, reconnect off, decode "
                  f"auto; clip {clip_text}) and 2 files ({file_clip.name}, {file_frames} "
                  f"frames, paced at {plan.file_fps:g} fps), {layout}, runtime.http on; "
                  f"{what}. Seconds to deliver again: from the SIGKILL until /api/sources "
                  f"showed a frame captured after it (polled every {POLL_S:g} s); a moved "
                  "camera (a file played live) goes on at once from its next keyframe, its "
                  "frames up to it dropped: a camera that makes a new session wait for its "
                  "next keyframe would add up to one keyframe interval.")
        print(f"launching: {shlex.join(['python', *command[1:]])} (log: {out / 'run.log'})",
              flush=True)
        result = Result()
        try:
            measure(plan, mode, command, result, health_s, deadline)
        except (MeasurementError, OSError, ValueError) as error:
            result.notes.append(f"failed: {error}")
        finally:
            shutil.rmtree(records, ignore_errors=True)
    except ImportError as error:
        print(f"error: {error.name or error} is not installed (the live view's packages: "
              "pip install -e '.[live]')", file=sys.stderr)
        return 1
    except (BenchmarkError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    table = markdown(plan, result, header)
    (out / "results.md").write_text(table)
    (out / "results.json").write_text(json.dumps(as_json(plan, result), indent=1))
    print(f"saved under {out}: results.md, results.json, run.log, config.yaml, the files' JSONL")
    print(table, end="")
    # the targets met or not are the result; a measurement that did not happen is not
    return 0 if result.measured else 1


if __name__ == "__main__":
    raise SystemExit(main())
