"""pipeline.app.supervisor's supervisor against a scripted executor (no processes), the command
line's --ray, and Ray staying out of a normal run. The real processes and Ray actors are
in tests/e2e/test_cluster.py, the real hosts' graphs in tests/e2e/test_one_top.py."""

from __future__ import annotations

import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import subprocess
import sys
import threading
import time

import pytest

from pipeline.app import cli
from pipeline.app.host import HostReport, Reply, SourceEnded, SourceRequest
from pipeline.app.placement import SourceLoad
from pipeline.app.supervisor import (
    Supervisor,
    absolute_paths,
    backoff_s,
    default_workers,
    exit_status,
    exiting,
    host_names,
    resolve_devices,
    spare_hosts,
)
from pipeline.config import ConfigError, SourceConfig, parse_config
from pipeline.graph import SourceConflict
from tests.support.harness import wait_for


def Report(*args, **kwargs) -> HostReport:  # noqa: N802 - reads as the record it makes
    """A report of a host whose graph is ready (the scripted hosts always are)."""
    return HostReport(*args, **{"ready": True, **kwargs})


class ScriptedExecutor:
    """Hosts that run nothing: every ``add`` is accepted (or refused, ``refuse``); the test
    ends sources and kills hosts. Records every call."""

    def __init__(self, hosts: int, spares: set[int] = frozenset(),
                 groups: list | None = None) -> None:
        self.names = [f"h{i}" for i in range(hosts)]
        self.spares = set(spares)
        self.groups = groups or [None] * hosts
        self.calls: list[tuple[int, str, tuple]] = []
        self.running: dict[str, tuple[int, SourceRequest]] = {}  # source -> (host, request)
        self.reports: dict[int, list[HostReport]] = {i: [] for i in range(hosts)}
        self.dead: dict[int, str] = {}
        self.refuse: dict[str, tuple[str, bool]] = {}  # source -> (error, conflict)
        self.records: dict[str, int] = {}  # source -> its records' count: where a move resumes
        self.lock = threading.Lock()
        self.closed = False

    def start(self, host: int) -> None:
        self.calls.append((host, "start_host", ()))

    def call(self, host: int, method: str, *args) -> None:
        with self.lock:
            self.calls.append((host, method, args))
            if method == "add":
                request = args[0]
                source = request.source
                if isinstance(source, dict):
                    source = SourceConfig(**source)
                if source.name in self.refuse:
                    error, conflict = self.refuse[source.name]
                    self.reports[host].append(Report(
                        (Reply(request.id, error=error, conflict=conflict),)))
                    return
                if request.resume and source.name in self.records:  # as SourceControl.add
                    source = dataclasses.replace(source, start_frame=self.records[source.name])
                self.running[source.name] = (host, request)
                self.reports[host].append(Report((Reply(request.id, source),)))
            elif method == "remove" and args[0] in self.running:
                self._end(args[0], complete=False)
            elif method == "stop":
                for name, (h, _) in list(self.running.items()):
                    if h == host:
                        self._end(name, complete=True)
                self.reports[host].append(Report(finished=True))

    def _end(self, name: str, complete: bool, error: str | None = None) -> None:
        host, _ = self.running.pop(name)
        self.reports[host].append(Report(ended=(SourceEnded(
            name, error, complete, None if complete else "stopped at frame 5 of 60", 5,
            {"source": name}),)))

    def poll(self, host: int):
        with self.lock:
            reports, self.reports[host] = self.reports[host], []
            return reports, self.dead.pop(host, None)

    def restart(self, host: int) -> bool:
        self.calls.append((host, "restart_host", ()))
        with self.lock:
            self.reports[host].append(Report())  # its graph is ready again
        return True

    def engine_states(self) -> dict:
        return {}

    def close(self) -> None:
        self.closed = True

    # -- the test's side
    def finish(self, name: str, error: str | None = None) -> None:
        with self.lock:
            self._end(name, complete=error is None, error=error)

    def die(self, host: int) -> None:
        with self.lock:
            for name, (h, _) in list(self.running.items()):
                if h == host:
                    del self.running[name]
            self.dead[host] = "killed by SIGKILL"

    def on(self, host: int) -> dict[str, SourceRequest]:
        with self.lock:
            return {name: request for name, (h, request) in self.running.items() if h == host}

    def removed(self) -> list[tuple[int, str]]:
        with self.lock:
            return [(host, args[0]) for host, method, args in self.calls if method == "remove"]


@pytest.fixture()
def config(samples):
    return parse_config({"sources": [{"name": n, "uri": str(samples.bikes)}
                                     for n in ("a", "b", "c", "d")],
                         "runtime": {"workers": 2}})


LOADS = [SourceLoad("a", 100, 100, 4), SourceLoad("b", 100, 100, 3),
         SourceLoad("c", 100, 100, 2), SourceLoad("d", 100, 100, 1)]


def start(config, executor, **kwargs) -> tuple[Supervisor, threading.Thread, dict]:
    supervisor = Supervisor(config, executor, loads=LOADS, **kwargs)
    results: dict = {}
    thread = threading.Thread(target=lambda: results.update(supervisor.run()), daemon=True)
    thread.start()
    return supervisor, thread, results


def test_sources_are_placed_by_load_one_by_one_and_the_run_ends_when_each_ended(config):
    executor = ScriptedExecutor(2)
    supervisor, thread, results = start(config, executor)
    wait_for(lambda: len(executor.running) == 4, "four sources started")
    assert sorted(executor.on(0)) == ["a", "d"] and sorted(executor.on(1)) == ["b", "c"]
    assert not any(r.resume for h in (0, 1) for r in executor.on(h).values())
    executor.finish("a")
    executor.finish("d")
    executor.finish("b", error="cannot open")
    time.sleep(0.3)
    assert thread.is_alive()  # c still runs: the run goes on
    executor.finish("c")
    thread.join(5)
    assert not thread.is_alive() and executor.closed
    assert results == {"a": None, "b": "cannot open", "c": None, "d": None}
    assert executor.removed() == []  # no source was ever cut


def test_a_dead_host_s_sources_resume_on_the_other_and_it_restarts(config):
    executor = ScriptedExecutor(2)
    supervisor, thread, results = start(config, executor, max_restarts=1)
    wait_for(lambda: len(executor.running) == 4, "four sources started")
    kept = dict(executor.on(0))
    died_at = time.monotonic()
    executor.die(1)
    wait_for(lambda: sorted(executor.on(0)) == list("abcd"), "the moved sources on host 0")
    # A first move is at once (no backoff: a camera's frames are lost while it waits)
    assert supervisor.sources["b"].not_before <= time.monotonic()
    assert supervisor.sources["b"].not_before - died_at < backoff_s(0)
    moved = executor.on(0)
    assert moved["b"].resume and moved["c"].resume  # they resume after their records
    assert moved["a"] is kept["a"] and moved["d"] is kept["d"]  # never touched
    assert supervisor.moves == {"b": 1, "c": 1}
    # Host 1 is back: the loads are evened again (4 + 1 | 3 + 2), moving sources one by one
    # (each cut where it ran and resumed on host 1); the others go on untouched.
    wait_for(lambda: executor.on(1) and len(executor.on(0)) + len(executor.on(1)) == 4,
               "sources rebalanced onto the restarted host 1")
    assert (1, "restart_host", ()) in executor.calls
    assert all(r.resume for r in executor.on(1).values())
    cut = [name for host, name in executor.removed()]
    assert cut and set(cut) == set(executor.on(1))  # only the moved ones were cut
    # It dies again: no restart left (max_restarts=1); the run goes on with host 0. The
    # sources that moved before wait a backoff (one that kills its hosts is slowed down).
    again = sorted(executor.on(1))
    died_at = time.monotonic()
    executor.die(1)
    wait_for(lambda: supervisor.hosts[1].gone, "host 1 given up")
    assert all(supervisor.sources[name].not_before - died_at >= backoff_s(0) * 0.9
               for name in again if supervisor.sources[name].moves > 1)
    wait_for(lambda: sorted(executor.on(0)) == list("abcd"), "every source on host 0")
    for name in "abcd":
        executor.finish(name)
    thread.join(5)
    assert results == {name: None for name in "abcd"}


def test_a_moved_file_counts_the_frames_its_records_hold_not_only_those_reported(config):
    executor = ScriptedExecutor(2)
    supervisor, thread, results = start(config, executor, max_restarts=0)
    wait_for(lambda: len(executor.running) == 4, "four sources started")
    with executor.lock:  # host 1 reported 40 frames of b, then wrote 2 more and died
        executor.reports[1].append(Report(frames={"b": 40}))
    wait_for(lambda: supervisor.frames["b"] == 40, "b's report")
    executor.records["b"] = 42
    executor.die(1)
    wait_for(lambda: "b" in executor.on(0), "b moved to host 0")
    wait_for(lambda: supervisor.frames["b"] == 42, "b counted from its records")
    for name in "abcd":
        executor.finish(name)  # each ends having done 5 frames where it ran last
    thread.join(5)
    assert supervisor.frames["b"] == 47 and supervisor.frames["a"] == 5


def test_a_restarted_host_takes_no_running_camera_back_but_takes_new_ones(samples):
    # Moving a camera back cuts it (its frames meanwhile are lost): on the H200, moving 34
    # cameras back onto a restarted worker cost the healthy ones 5,428 frames.
    cameras = parse_config({"sources": [{"name": n, "uri": str(samples.bikes), "live": True}
                                        for n in ("a", "b", "c", "d")],
                            "runtime": {"workers": 2}})
    executor = ScriptedExecutor(2)
    supervisor, thread, results = start(cameras, executor, max_restarts=1)
    wait_for(lambda: len(executor.running) == 4, "four cameras started")
    executor.die(1)
    wait_for(lambda: sorted(executor.on(0)) == list("abcd"), "its cameras on host 0")
    wait_for(lambda: (1, "restart_host", ()) in executor.calls, "host 1 restarted")
    wait_for(lambda: supervisor.hosts[1].ready, "host 1 ready")
    time.sleep(0.3)  # the loop had its turns: no camera was cut to even the loads
    assert executor.removed() == [] and executor.on(1) == {}
    supervisor.add_source({"name": "e", "uri": "rtsp://h/x"}, SourceLoad("e", 100, 100, 1))
    assert "e" in executor.on(1)  # the least loaded
    supervisor.request_stop()
    thread.join(5)
    assert results == {name: None for name in "abcde"}


def test_a_dead_host_s_sources_go_to_its_spare_which_it_becomes_once_restarted(config):
    executor = ScriptedExecutor(3, spares={2})
    supervisor, thread, results = start(config, executor)
    wait_for(lambda: len(executor.running) == 4, "four sources started")
    assert executor.on(2) == {}  # a spare takes nothing while the others live
    kept, lost = dict(executor.on(0)), dict(executor.on(1))
    executor.die(1)
    wait_for(lambda: sorted(executor.on(2)) == sorted(lost), "host 1's sources on the spare")
    assert all(request.resume for request in executor.on(2).values())
    assert executor.on(0) == kept and executor.removed() == []  # host 0 untouched
    wait_for(lambda: (1, "restart_host", ()) in executor.calls, "host 1 restarted")
    wait_for(lambda: supervisor.hosts[1].ready, "host 1 ready")
    time.sleep(0.3)  # the loop had its turns: nothing was evened onto the new spare
    assert supervisor.hosts[1].spare and executor.on(1) == {} and executor.removed() == []
    supervisor.add_source({"name": "e", "uri": "rtsp://h/x"}, SourceLoad("e", 100, 100, 1))
    assert "e" not in executor.on(1)  # a spare takes no new source either
    gone = sorted(executor.on(0))
    executor.die(0)  # and the new spare takes the next one's
    wait_for(lambda: sorted(executor.on(1)) == gone, "host 0's sources on host 1")
    supervisor.request_stop()
    thread.join(5)
    assert results == {name: None for name in "abcde"}


def test_a_spare_takes_only_the_sources_of_its_own_engine_s_workers(config):
    # hosts 0 and 1 feed one engine (GPU), 2 and 3 another, whose spare is 3
    executor = ScriptedExecutor(4, spares={3}, groups=[0, 0, 1, 1])
    supervisor, thread, results = start(config, executor)
    wait_for(lambda: len(executor.running) == 4, "four sources started")
    lost = sorted(executor.on(0))
    executor.die(0)
    wait_for(lambda: set(lost) <= set(executor.on(1)) | set(executor.on(2)),
             "host 0's sources on the live hosts")
    assert executor.on(3) == {}
    supervisor.request_stop()
    thread.join(5)


class FinishingExecutor(ScriptedExecutor):
    """A host whose file reaches its end before a cut to move it takes effect: ``remove``
    of a source in ``finish_first`` ends it complete (its outputs final), not cut short."""

    def __init__(self, hosts: int, finish_first: set[str]) -> None:
        super().__init__(hosts)
        self.finish_first = finish_first

    def call(self, host: int, method: str, *args) -> None:
        if method == "remove" and args[0] in self.finish_first and args[0] in self.running:
            with self.lock:
                self.calls.append((host, method, args))
                self._end(args[0], complete=True)
            return
        super().call(host, method, *args)


def test_a_file_that_ends_before_its_move_is_done_not_started_over(config):
    """Rebalancing onto a restarted host cuts a file where it runs; when the file reached its
    end first (complete, its records final), it is done: starting it on the new host would
    find no partial records and write them all again (seen in CI)."""
    executor = FinishingExecutor(2, finish_first=set("abcd"))
    supervisor, thread, results = start(config, executor, max_restarts=1)
    wait_for(lambda: len(executor.running) == 4, "four sources started")
    executor.die(1)
    wait_for(lambda: sorted(executor.on(0)) == list("abcd"), "the moved sources on host 0")
    wait_for(lambda: executor.removed(), "a source cut to move it onto the restarted host 1")
    cut = [name for _, name in executor.removed()]
    time.sleep(0.5)  # several supervisor turns
    assert not set(cut) & set(executor.on(1)), "a file that had ended was started again"
    assert all(results.get(name) is None for name in cut)
    for name in list(executor.on(0)) + list(executor.on(1)):
        executor.finish(name)
    thread.join(5)
    assert results == {name: None for name in "abcd"}
    adds = [args[0].source.name for host, method, args in executor.calls
            if method == "add" and host == 1]
    assert not set(cut) & set(adds[2:])  # host 1's adds after its restart: none of the cut


def test_the_live_view_lists_every_placed_source_before_its_host_has_taken_it(config):
    """Host 1 answers nothing yet (a worker still starting): its sources are on the board
    as starting there from their placement, not missing from the API."""
    from pipeline.app.board import SourceBoard

    class SlowHostOne(ScriptedExecutor):
        held = True

        def poll(self, host: int):
            return ([], None) if host == 1 and self.held else super().poll(host)

    executor = SlowHostOne(2)
    board = SourceBoard(None, None, preview_fps=5, order=["a", "b", "c", "d"])
    supervisor, thread, results = start(config, executor, board=board)
    wait_for(lambda: len(executor.running) == 4, "four sources placed")
    on_one = set(executor.on(1))
    assert on_one and board.names() == ["a", "b", "c", "d"]
    assert {name: board.source(name)["host"] for name in on_one} == dict.fromkeys(on_one, "h1")
    assert {board.source(name)["state"] for name in on_one} == {"starting"}
    executor.held = False
    supervisor.request_stop()
    thread.join(5)
    assert not thread.is_alive() and set(results) == set("abcd")


def test_every_host_dead_for_good_fails_the_remaining_sources(config):
    executor = ScriptedExecutor(1)
    supervisor, thread, results = start(config, executor, max_restarts=0)
    wait_for(lambda: len(executor.running) == 4, "four sources")
    executor.die(0)
    thread.join(5)
    assert not thread.is_alive()
    assert set(results) == set("abcd") and all("every pipeline died" in e for e in results.values())


def test_removing_a_source_cuts_only_it_and_an_added_one_goes_to_the_least_loaded(config,
                                                                                   samples):
    executor = ScriptedExecutor(2)
    supervisor, thread, results = start(config, executor)
    wait_for(lambda: len(executor.running) == 4, "four sources started")
    before = {h: dict(executor.on(h)) for h in (0, 1)}  # a 4 + d 1 | b 3 + c 2
    supervisor.remove_source("c")
    wait_for(lambda: "c" not in executor.running, "c stopped")
    assert executor.removed() == [(1, "c")]
    time.sleep(0.3)  # the loop had its turns: nothing else moved or restarted
    assert executor.removed() == [(1, "c")]
    assert {h: dict(executor.on(h)) for h in (0, 1)} == {0: before[0], 1: {"b": before[1]["b"]}}
    assert supervisor.source_done("c")
    added = supervisor.add_source({"name": "e", "uri": "rtsp://h/x"}, SourceLoad("e", 100, 100, 1))
    assert added.name == "e" and "e" in executor.on(1)  # h1 had 3, h0 5
    with pytest.raises(SourceConflict, match="'e' is in use"):
        supervisor.add_source({"name": "e", "uri": "rtsp://h/y"}, SourceLoad("e", 100, 100, 1))
    with pytest.raises(ConfigError, match=r"^sources\[5\]\.uri: "):
        supervisor.add_source({"name": "f"}, SourceLoad("f", 100, 100, 1))
    # the whole-config checks number it as the run's sixth too (c, finished, is left out)
    with pytest.raises(ConfigError, match=r"^sources\[5\]\.uri \(source 'f'\): file not found"):
        supervisor.add_source({"name": "f", "uri": "no-such.mp4"}, SourceLoad("f", 100, 100, 1))
    from structlog.testing import capture_logs

    with capture_logs() as logs:  # a file read live without pace_fps: warned as at the start
        supervisor.add_source({"name": "looped", "uri": str(samples.bikes), "loop": True},
                              SourceLoad("looped", 100, 100, 1))
        supervisor.add_source({"name": "paced", "uri": str(samples.bikes), "loop": True,
                               "pace_fps": 25}, SourceLoad("paced", 100, 100, 1))
    from pipeline.config import UNPACED_FILES

    assert [(e["source"], e["key"]) for e in logs if e["event"] == UNPACED_FILES] == [
        ("looped", "sources[5].pace_fps")]
    executor.refuse["g"] = ("sources[7].tracker: this run has no tracking stage", False)
    with pytest.raises(ConfigError, match="no tracking stage"):
        supervisor.add_source({"name": "g", "uri": "rtsp://h/z"}, SourceLoad("g", 100, 100, 1))
    supervisor.request_stop()
    thread.join(5)
    assert results == {"a": None, "b": None, "c": None, "d": None, "e": None, "looped": None,
                       "paced": None}


def test_a_pipeline_that_cannot_start_fails_its_sources_once(config):
    executor = ScriptedExecutor(1)
    supervisor, thread, results = start(config, executor)
    wait_for(lambda: len(executor.running) == 4, "four sources")
    with executor.lock:
        executor.running.clear()
        executor.reports[0].append(Report(failure="inference.device: 'cuda' cannot be used",
                                              usage=True, finished=True))
    thread.join(5)
    assert not thread.is_alive()
    assert supervisor.failure == ("inference.device: 'cuda' cannot be used", True)
    assert all(e.startswith("pipeline failed") for e in results.values())


@pytest.mark.parametrize("runtime, expected", [
    ({"workers": 3}, [None, None, None]),
    ({"workers": 1}, [None]),
    ({"gpus": [0, 1], "workers": 1}, [0, 1]),
    ({"gpus": [3], "workers": 1}, [3]),
    ({"gpus": [0, 1], "workers": 2}, [0, 0, 1, 1]),  # workers per GPU
    ({"gpus": [2], "workers": 3}, [2, 2, 2]),
])
def test_resolve_devices(samples, runtime, expected):
    config = parse_config({"sources": [{"name": "a", "uri": str(samples.bikes)}], "runtime": runtime})
    assert resolve_devices(config) == expected


@pytest.mark.parametrize("runtime, expected", [
    ({"workers": 3}, [None]),  # one by default where there are two or more workers
    ({"workers": 2, "spare_workers": 0}, []),
    ({"workers": 2, "spare_workers": 2}, [None, None]),
    ({"workers": 1, "spare_workers": 1}, []),  # the whole pipeline in this process
    ({"gpus": [0, 1], "workers": 2}, [0, 1]),  # per GPU
    ({"gpus": [0, 1], "workers": 1}, []),
    ({"gpus": [0, 1], "workers": 1, "spare_workers": 1}, [0, 1]),
])
def test_spare_workers(samples, runtime, expected):
    config = parse_config({"sources": [{"name": "a", "uri": str(samples.bikes)}], "runtime": runtime})
    assert spare_hosts(config, resolve_devices(config)) == expected


def test_a_process_is_exiting_once_linux_says_so():
    import os

    assert not exiting(os.getpid())  # running
    assert not exiting(2**22 + 1)  # no such process (above pid_max's default)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: gone
    assert not exiting(child.pid)
    # A process whose main thread has exited while another runs on: exiting, and no exit
    # status yet (what a killed worker is while the driver tears its GPU work down)
    code = ("import ctypes, threading, time; threading.Thread(target=time.sleep, args=(3,))"
            ".start(); ctypes.CDLL(None).pthread_exit(None)")
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        wait_for(lambda: exiting(child.pid), "its main thread exited", 10)
        assert child.poll() is None
    finally:
        child.wait(10)


def test_workers_by_default_one_per_source_at_most_five_per_gpu_and_half_the_cores():
    assert default_workers(1, cores=16) == 1
    assert default_workers(2, cores=16) == 2
    assert default_workers(100, cores=16) == 5
    assert default_workers(100, gpus=2, cores=16) == 4
    assert default_workers(100, gpus=2, cores=8) == 2
    assert default_workers(10, cores=2) == 1


def test_runtime_pipelines_names_what_replaced_it(samples):
    with pytest.raises(ConfigError, match=r"^runtime\.pipelines: replaced by runtime\.workers"):
        parse_config({"sources": [{"name": "a", "uri": str(samples.bikes)}],
                      "runtime": {"pipelines": 2}})


def test_workers_are_named_by_their_gpu_and_their_place_on_it():
    assert host_names([0, 1]) == ["gpu0.worker0", "gpu1.worker0"]
    assert host_names([0, 0, 1, 1]) == ["gpu0.worker0", "gpu0.worker1", "gpu1.worker0",
                                        "gpu1.worker1"]
    assert host_names([None, None]) == ["worker0", "worker1"]


@pytest.mark.parametrize("runtime, inference, gpus, nodes, units", [
    ({}, {}, 4, 2, 4),  # the GPU path: one unit per GPU of the cluster
    ({"gpus": [0, 1]}, {}, 4, 2, 2),  # a list: its length
    ({}, {}, 0, 3, 3),  # no GPU: one per node (the CPU path)
    ({}, {"device": "cpu"}, 4, 3, 3),  # the CPU path asked for: GPUs not counted
])
def test_ray_units_one_per_gpu_else_one_per_node(samples, runtime, inference, gpus, nodes, units):
    from pipeline.app.ray_cluster import unit_count

    config = parse_config({"sources": [{"name": "a", "uri": str(samples.bikes)}],
                           "runtime": runtime, "inference": inference})
    assert unit_count(config, {"CPU": 16.0, "GPU": float(gpus)}, nodes) == units


@pytest.mark.parametrize("gpus, inference, cluster, message", [
    ([0, 1, 2], {}, {"CPU": 16.0, "GPU": 2.0},
     r"^runtime\.gpus: lists 3 GPUs; the Ray cluster has 2 \(one unit per GPU\)$"),
    ([0, 1, 2], {}, {"CPU": 16.0},
     r"^runtime\.gpus: lists 3 GPUs; the Ray cluster has none \(one unit per GPU\)$"),
    ([0], {}, {"CPU": 16.0},
     r"^runtime\.gpus: lists 1 GPU; the Ray cluster has none \(one unit per GPU\)$"),
    ("all", {}, {"CPU": 16.0}, r"^runtime\.gpus: 'all' found no GPU"),
    # the CPU path asked for: a unit takes a CPU, and Ray would never place a third
    ([0, 1, 2], {"device": "cpu"}, {"CPU": 2.0},
     r"^--ray: 3 units on the CPU path take a CPU each; the Ray cluster has 2$"),
])
def test_ray_units_the_cluster_cannot_hold_are_a_config_error(samples, gpus, inference, cluster,
                                                               message):
    from pipeline.app.ray_cluster import unit_count

    config = parse_config({"sources": [{"name": "a", "uri": str(samples.bikes)}],
                           "runtime": {"gpus": gpus}, "inference": inference})
    with pytest.raises(ConfigError, match=message):
        unit_count(config, cluster, 1)


def test_a_ray_unit_names_its_workers_run_wide_and_sizes_them_for_its_share(samples):
    """The actor's class itself (no Ray): the CPU path; its workers carry the run-wide names
    (logs, metrics labels: two units' worker0 must not share a series)."""
    from pipeline.app.ray_cluster import RayUnit

    config = parse_config({"sources": [{"name": f"c{i}", "uri": str(samples.bikes)}
                                       for i in range(8)],
                           "inference": {"device": "cpu"}})
    unit = RayUnit(config, ["unit1.worker0", "unit1.worker1"], units=2, metrics=False)
    try:
        assert unit.executor.names == ["unit1.worker0", "unit1.worker1"]
        assert unit.executor.devices == [None, None]  # the CPU path: no GPU of its own
        assert unit.executor.sources_per_worker == 2  # 8 sources over 2 units of 2 workers
        assert unit.poll(0) == ([], "its unit was restarted")  # never started here
        unit.call(0, "stop")  # to a worker never started: nothing
    finally:
        unit.close()


def test_relative_paths_are_made_absolute(samples, tmp_path):
    config = parse_config({"sources": [{"name": "a", "uri": str(samples.bikes)},
                                       {"name": "b", "uri": "rtsp://h/x"}],
                           "output": {"dir": "out"}})
    absolute = absolute_paths(config, "/base")
    assert absolute.output.dir == "/base/out"
    assert absolute.model.path == f"/base/{config.model.path}"
    assert absolute.sources[1].uri == "rtsp://h/x"
    assert config.output.dir == "out"


@pytest.mark.parametrize("missing, address, message", [
    ("ray", "auto", "--ray: needs the Python package 'ray', which is not installed: "
                    "pip install -e '.[ray]' in the project's folder (the ray extra)"),
    ("grpc", "ray://head:10001", "--ray ray://head:10001: Ray's client needs the package "
                                 "'grpcio' (ray[client]): pip install -e '.[ray]' in the "
                                 "project's folder (the ray extra)"),
])
def test_ray_without_the_package_is_a_one_line_error(samples, tmp_path, monkeypatch, capsys,
                                                      missing, address, message):
    import importlib.util

    config = tmp_path / "c.yaml"
    config.write_text(f"sources: [{{name: a, uri: {samples.bikes}}}]\n")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == missing else real(name, *a))
    assert cli.main(["--config", str(config), "--ray", address]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == f"error: {message}\n"


@pytest.mark.parametrize("address", ["bogus", "head", "http://head:6379", "ray://head"])
def test_a_ray_address_of_no_known_form_is_a_usage_error(samples, tmp_path, capsys, address):
    config = tmp_path / "c.yaml"
    config.write_text(f"sources: [{{name: a, uri: {samples.bikes}}}]\n")
    assert cli.main(["--config", str(config), "--ray", address]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == (
        f"error: --ray: {address!r} is not auto, local, HOST:PORT (a cluster's head, e.g. "
        "head:6379) or ray://HOST:PORT (Ray's client, e.g. ray://head:10001)\n")


def test_a_ray_address_where_nothing_answers_fails_at_once(samples, tmp_path, capsys):
    """Ray itself would wait for the cluster without end; nothing is listening on the port."""
    import socket
    import time

    from tests.support.ci import require_ray_installed

    require_ray_installed()

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    config = tmp_path / "c.yaml"
    config.write_text(f"sources: [{{name: a, uri: {samples.bikes}}}]\noutput: {{dir: {tmp_path}}}\n")
    started = time.monotonic()
    assert cli.main(["--config", str(config), "--ray", f"127.0.0.1:{port}"]) == cli.EXIT_FAILED
    assert time.monotonic() - started < 10
    err = capsys.readouterr().err
    assert err.startswith(f"error: failed to start: --ray 127.0.0.1:{port}: no Ray cluster "
                          "answers there (")
    assert err.count("\n") == 1
    assert not list(tmp_path.glob("*.jsonl*"))


def test_ray_local_with_more_gpus_listed_than_this_machine_has_fails_before_ray_starts(
        samples, tmp_path, capsys, monkeypatch):
    import sys

    from tests.support.ci import require_ray_installed

    require_ray_installed()
    monkeypatch.setattr("pipeline.app.supervisor.gpu_count", lambda: 1)
    config = tmp_path / "c.yaml"
    config.write_text(f"sources: [{{name: a, uri: {samples.bikes}}}]\n"
                      f"inference: {{device: cuda}}\nruntime: {{gpus: [0, 1]}}\n"
                      f"output: {{dir: {tmp_path}}}\n")
    assert cli.main(["--config", str(config), "--ray", "local"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == ("error: runtime.gpus: lists 2 GPUs; the Ray cluster has "
                                       "1 (one unit per GPU)\n")
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_a_normal_run_imports_nothing_of_ray(repo_root):
    code = ("import sys, pkgutil, importlib, pipeline, pipeline.app, stages\n"
            "for package in (pipeline, pipeline.app, stages):\n"
            "    for module in pkgutil.iter_modules(package.__path__):\n"
            "        if module.name != 'ray_cluster':\n"
            "            importlib.import_module(f'{package.__name__}.{module.name}')\n"
            "from pipeline.app.cli import main\n"
            "assert main(['--help-config']) == 0\n"
            "assert 'pipeline.app.supervisor' in sys.modules and 'pipeline.app.host' in sys.modules\n"
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def close_files_then_sleep() -> None:
    """A worker being killed, as the supervisor sees it: its files closed (its end of the
    sentinel pipe among them) while it has not exited yet (the driver tearing its CUDA work
    down)."""
    for fd in map(int, os.listdir("/proc/self/fd")):
        if fd > 2:
            try:
                os.close(fd)
            except OSError:
                pass
    time.sleep(5)


def test_a_dying_worker_s_exit_status_is_polled_not_waited_for():
    process = multiprocessing.get_context("spawn").Process(target=close_files_then_sleep)
    process.start()
    try:
        assert multiprocessing.connection.wait([process.sentinel], 30)  # its files closed
        started = time.monotonic()
        assert exit_status(process, 0.2) is None
        # join(0.2) waited here until the process had exited: 5 s (on the H200, the 0.8 s
        # a killed worker's CUDA teardown took, the supervisor's loop with it)
        assert time.monotonic() - started < 1.0
    finally:
        process.kill()
    assert exit_status(process, 5.0) == -9


def test_a_slow_turn_is_logged_but_not_a_host_s_first_answer(config):
    """A turn of the loop that takes SLOW_TURN_S or more is logged (a death waits that long
    to be seen); a host's first answer, which may take its start (a Ray unit's actor is made
    then), is not the loop's delay and is not logged."""
    from structlog.testing import capture_logs

    from pipeline.app.supervisor import SLOW_TURN_S

    class SlowPolls(ScriptedExecutor):
        def __init__(self, hosts: int) -> None:
            super().__init__(hosts)
            self.slow: set[int] = set()  # hosts whose next poll is slow
            self.polled: set[int] = set()

        def poll(self, host: int):
            if host not in self.polled or host in self.slow:
                self.polled.add(host)
                self.slow.discard(host)
                time.sleep(SLOW_TURN_S + 0.05)
            return super().poll(host)

    executor = SlowPolls(2)
    with capture_logs() as logs:
        supervisor, thread, _ = start(config, executor)
        wait_for(lambda: len(executor.running) == 4, "four sources started")
        time.sleep(0.5)
        assert not [e for e in logs if e["event"] == "supervisor turn slow"]
        executor.slow.add(1)
        wait_for(lambda: [e for e in logs if e["event"] == "supervisor turn slow"],
                 "a slow turn logged")
    (slow,) = [e for e in logs if e["event"] == "supervisor turn slow"]
    assert slow["poll_s"] >= SLOW_TURN_S
    for name in "abcd":
        executor.finish(name)
    thread.join(5)


def test_a_host_lost_while_the_run_stops_leaves_its_sources_cut_short_not_finished(config):
    """A host that dies while the run is stopping (a group SIGTERM that also ended a local
    Ray cluster) never reports its sources' ends: their outputs stay .partial, so the run
    says they were stopped early (exit 3), not finished (exit 0)."""
    from pipeline.app.run import EXIT_STOPPED, finish

    class DiesOnStop(ScriptedExecutor):
        def call(self, host: int, method: str, *args) -> None:
            if method == "stop" and host == 1:
                self.die(1)
                return
            super().call(host, method, *args)

    executor = DiesOnStop(2)
    supervisor, thread, results = start(config, executor, max_restarts=0)
    wait_for(lambda: len(executor.running) == 4, "four sources started")
    lost = sorted(executor.on(1))
    supervisor.request_stop()
    thread.join(5)
    assert not thread.is_alive() and results == {name: None for name in "abcd"}
    assert lost and all(supervisor.sources[name].unended == "stopped at frame 0 (its worker "
                        "was lost while the run was stopping)" for name in lost)
    assert all(supervisor.sources[name].unended is None for name in "abcd" if name not in lost)
    for name in lost:  # they had written frames (this executor reports none): .partial
        supervisor.sources[name].frames = 5
    assert finish(supervisor, results, 1, 1.0) == EXIT_STOPPED


def test_sources_a_stopping_run_never_started_are_cut_short_not_finished(config):
    """Ctrl-C before the workers took their sources (a new user's runtime.workers: 2 run,
    interrupted 3.5-5.5 s after its launch, exited 0 with nothing written): each worker
    refuses its adds as its run is stopping, and the run says they were stopped before
    their first frame, not finished (exit 0): nothing was written, so the Ctrl-C's 130 (a
    later new user read its earlier exit 3, "outputs are .partial", of no file)."""
    from pipeline.app.run import EXIT_INTERRUPTED, finish

    class StartsNothing(ScriptedExecutor):
        def __init__(self, hosts: int) -> None:
            super().__init__(hosts)
            self.waiting: dict[int, list] = {}  # host -> the adds it has not answered

        def call(self, host: int, method: str, *args) -> None:
            with self.lock:
                if method == "add":
                    self.waiting.setdefault(host, []).append(args[0])
                    return
                if method == "stop":  # as a stopping host answers what it never started
                    self.reports[host].append(Report(tuple(
                        Reply(request.id, error="the run is ending", conflict=True)
                        for request in self.waiting.pop(host, []))))
            super().call(host, method, *args)

    executor = StartsNothing(2)
    supervisor, thread, results = start(config, executor)
    wait_for(lambda: sum(map(len, executor.waiting.values())) == 4, "four adds sent")
    supervisor.request_stop()
    thread.join(5)
    assert not thread.is_alive() and results == {name: None for name in "abcd"}
    assert all(supervisor.sources[name].unended == "stopped at frame 0 (the run was stopping "
                                                   "before it started on its worker)"
               for name in "abcd")
    assert finish(supervisor, results, 1, 1.0) == EXIT_INTERRUPTED


def test_every_source_the_run_had_gets_a_summary_also_those_whose_name_was_added_again(
        config, samples):
    """A source removed (or ended) whose name is added again keeps its summary line: one per
    source the run had, in the order they were added, the removed ones saying so."""
    from structlog.testing import capture_logs

    from pipeline.app.run import EXIT_STOPPED, finish

    executor = ScriptedExecutor(2)
    supervisor, thread, results = start(config, executor)
    wait_for(lambda: len(executor.running) == 4, "four sources started")
    supervisor.remove_source("c")  # a file cut short: 5 frames, its outputs .partial
    wait_for(lambda: supervisor.source_done("c"), "c removed")
    executor.finish("a")  # ended by itself
    wait_for(lambda: supervisor.source_done("a"), "a ended")
    supervisor.remove_source("a")  # a DELETE of it now only forgets it: not removed (a new
    with pytest.raises(SourceConflict):  # user's file that had ended read removed=True)
        supervisor.remove_source("a")
    for name in ("c", "a", "e"):
        supervisor.add_source({"name": name, "uri": str(samples.bikes)},
                              SourceLoad(name, 100, 100, 1))
    supervisor.request_stop()
    thread.join(5)
    assert not thread.is_alive()
    with capture_logs() as logs:
        assert finish(supervisor, results, 1, 1.0) == EXIT_STOPPED  # the first c is cut short
    summaries = [(e["source"], e["removed"], e.get("cut_short"))
                 for e in logs if e["event"] == "source summary"]
    assert summaries == [("a", False, None), ("b", False, None),
                         ("c", True, "stopped at frame 5 of 60"), ("d", False, None),
                         ("c", False, None), ("a", False, None), ("e", False, None)]
    assert [e["frames"] for e in logs if e["event"] == "source summary"] == [5] * 7
    (early,) = [e for e in logs if e["event"].startswith("stopped early")]
    assert (early["source"], early["at"]) == ("c", "stopped at frame 5 of 60")
    assert "run the same command again" in early["event"]  # c of the config file
