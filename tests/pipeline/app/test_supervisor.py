"""pipeline.app.supervisor's supervisor against a scripted executor (no processes), the command
line's --ray, and Ray staying out of a normal run. The real processes and Ray actors are
in tests/e2e/test_cluster.py."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from pipeline.app import cli
from pipeline.app.host import Assignment, AssignmentEnded, HostReport, assignment_config
from pipeline.app.placement import SourceLoad
from pipeline.app.supervisor import (
    Supervisor,
    absolute_paths,
    backoff_s,
    host_names,
    resolve_devices,
    share_cores,
)
from pipeline.config import ConfigError, parse_config
from tests.support.harness import wait_for


class ScriptedExecutor:
    """Hosts that run nothing: the test ends their assignments and kills them."""

    def __init__(self, hosts: int) -> None:
        self.names = [f"h{i}" for i in range(hosts)]
        self.calls: list[tuple[int, str, tuple]] = []
        self.running: dict[int, tuple[int, Assignment]] = {}
        self.reports: dict[int, list[HostReport]] = {i: [] for i in range(hosts)}
        self.dead: dict[int, str] = {}
        self.lock = threading.Lock()
        self.closed = False

    def start(self, host: int) -> None:
        self.calls.append((host, "start_host", ()))

    def call(self, host: int, method: str, *args) -> None:
        with self.lock:
            self.calls.append((host, method, args))
            if method == "start":
                self.running[args[0].id] = (host, args[0])
            elif method == "abort" and args[0] in self.running:
                _, assignment = self.running.pop(args[0])
                self.reports[host].append(HostReport((AssignmentEnded(
                    assignment.id, cut=assignment.sources),)))
            elif method == "stop":
                for aid, (h, _) in list(self.running.items()):
                    if h == host:
                        self.finish(aid)

    def poll(self, host: int):
        with self.lock:
            reports, self.reports[host] = self.reports[host], []
            return reports, self.dead.pop(host, None)

    def restart(self, host: int) -> bool:
        self.calls.append((host, "restart_host", ()))
        return True

    def close(self) -> None:
        self.closed = True

    # -- the test's side
    def finish(self, assignment_id: int, error: str | None = None) -> None:
        host, assignment = self.running.pop(assignment_id)
        self.reports[host].append(HostReport((AssignmentEnded(
            assignment.id, {name: error for name in assignment.sources}),)))

    def die(self, host: int) -> None:
        with self.lock:
            for aid, (h, _) in list(self.running.items()):
                if h == host:
                    del self.running[aid]
            self.dead[host] = "killed by SIGKILL"

    def on(self, host: int) -> list[Assignment]:
        with self.lock:
            return [a for h, a in self.running.values() if h == host]


@pytest.fixture()
def config(samples):
    return parse_config({"sources": [{"name": n, "uri": str(samples.bikes)}
                                     for n in ("a", "b", "c", "d")],
                         "runtime": {"pipelines": 2}})


LOADS = [SourceLoad("a", 100, 100, 4), SourceLoad("b", 100, 100, 3),
         SourceLoad("c", 100, 100, 2), SourceLoad("d", 100, 100, 1)]


def start(config, executor, **kwargs) -> tuple[Supervisor, threading.Thread, dict]:
    supervisor = Supervisor(config, executor, loads=LOADS, **kwargs)
    results: dict = {}
    thread = threading.Thread(target=lambda: results.update(supervisor.run()), daemon=True)
    thread.start()
    return supervisor, thread, results


def test_sources_are_placed_by_load_and_the_run_ends_when_each_ended(config):
    executor = ScriptedExecutor(2)
    supervisor, thread, results = start(config, executor)
    wait_for(lambda: len(executor.running) == 2, "two assignments")
    assert [sorted(a.sources) for a in executor.on(0)] == [["a", "d"]]
    assert [sorted(a.sources) for a in executor.on(1)] == [["b", "c"]]
    assert all(not a.resume for a in executor.on(0) + executor.on(1))
    (first,) = executor.on(0)
    executor.finish(first.id)
    (second,) = executor.on(1)
    executor.finish(second.id, error="cannot open")
    thread.join(5)
    assert not thread.is_alive() and executor.closed
    assert results == {"a": None, "b": "cannot open", "c": "cannot open", "d": None}


def test_a_dead_host_s_sources_resume_on_the_other_after_a_backoff_and_it_restarts(config):
    executor = ScriptedExecutor(2)
    supervisor, thread, results = start(config, executor, max_restarts=1)
    wait_for(lambda: len(executor.running) == 2, "two assignments")
    (kept,) = executor.on(0)
    died_at = time.monotonic()
    executor.die(1)

    def started_on_0() -> list[Assignment]:
        return [args[0] for host, method, args in list(executor.calls)
                if host == 0 and method == "start" and args[0].id != kept.id]

    wait_for(started_on_0, "the moved sources on host 0")
    (moved,) = started_on_0()
    assert time.monotonic() - died_at >= backoff_s(0) * 0.9  # not at once: a backoff
    assert sorted(moved.sources) == sorted(moved.resume) == ["b", "c"]  # they resume
    assert supervisor.moves == {"b": 1, "c": 1}
    # Host 1 is back: the loads are evened again (a 4 + d 1 | b 3 + c 2 -> 5 | 5), the
    # moved sources' pipelines cut short and every source resumed after its records.
    wait_for(lambda: executor.on(1) and len(executor.on(0)) == 1 and kept.id not in
               executor.running, "sources rebalanced onto the restarted host 1")
    assert (1, "restart_host", ()) in executor.calls
    on = {host: sorted(n for a in executor.on(host) for n in a.sources) for host in (0, 1)}
    assert sorted([on[0], on[1]]) == [["a", "d"], ["b", "c"]]
    assert all(set(a.resume) == set(a.sources) for h in (0, 1) for a in executor.on(h))
    # It dies again: no restart left (max_restarts=1); the run goes on with host 0.
    executor.die(1)
    wait_for(lambda: supervisor.hosts[1].gone, "host 1 given up")
    wait_for(lambda: sorted(n for a in executor.on(0) for n in a.sources) == list("abcd"),
               "every source on host 0")
    for assignment in executor.on(0):
        executor.finish(assignment.id)
    thread.join(5)
    assert results == {name: None for name in "abcd"}


def test_every_host_dead_for_good_fails_the_remaining_sources(config):
    executor = ScriptedExecutor(1)
    supervisor, thread, results = start(config, executor, max_restarts=0)
    wait_for(lambda: len(executor.running) == 1, "one assignment")
    executor.die(0)
    thread.join(5)
    assert not thread.is_alive()
    assert set(results) == set("abcd") and all("every pipeline died" in e for e in results.values())


def test_removing_a_source_cuts_its_pipeline_and_the_others_of_it_resume(config):
    executor = ScriptedExecutor(2)
    supervisor, thread, results = start(config, executor)
    wait_for(lambda: len(executor.running) == 2, "two assignments")
    (old,) = executor.on(1)  # b (3) and c (2); host 0: a (4) and d (1)
    supervisor.remove_source("c")
    # Rebalanced: d moves to host 1 (4 | 4); both pipelines are cut and their sources resume.
    wait_for(lambda: old.id not in executor.running and executor.on(1) and executor.on(0),
               "the sources restarted")
    assert (1, "abort", (old.id,)) in executor.calls
    (again,) = executor.on(1)
    assert sorted(again.sources) == sorted(again.resume) == ["b", "d"]
    assert [(a.sources, a.resume) for a in executor.on(0)] == [(("a",), ("a",))]
    supervisor.add_source(parse_config({"sources": [{"name": "e", "uri": "rtsp://h/x"}]}).sources[0],
                          SourceLoad("e", 100, 100, 1))
    wait_for(lambda: any("e" in a.sources for a in executor.running.values() for a in [a[1]]),
               "e started")
    supervisor.request_stop()
    thread.join(5)
    assert results == {"a": None, "b": None, "d": None, "e": None}


def test_an_assignment_runs_only_its_sources_resumed_from_their_records(samples, tmp_path):
    config = parse_config({"sources": [{"name": n, "uri": str(samples.bikes)} for n in "ab"],
                           "output": {"dir": str(tmp_path), "video": None},
                           "runtime": {"pipelines": 2, "metrics_port": 9100}})
    (tmp_path / "b.partial.jsonl").write_text('{"frame":0}\n{"frame":1}\n{"fra')
    sub = assignment_config(config, Assignment(7, ("b",), resume=("b",)))
    assert [(s.name, s.start_frame) for s in sub.sources] == [("b", 2)]
    assert (tmp_path / "b.partial.jsonl").read_text() == '{"frame":0}\n{"frame":1}\n'
    assert (sub.runtime.pipelines, sub.runtime.metrics_port, sub.runtime.progress) == (None, None, False)
    assert config.runtime.pipelines == 2 and len(config.sources) == 2  # the original is kept


@pytest.mark.parametrize("kwargs, match", [
    ({"id": 1, "sources": ()}, "at least one source"),
    ({"id": 1, "sources": ("a", "a")}, "named twice"),
    ({"id": 1, "sources": ("a",), "resume": ("b",)}, "not all in"),
])
def test_an_assignment_is_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Assignment(**kwargs)


@pytest.mark.parametrize("runtime, expected", [
    ({"pipelines": 3}, [None, None, None]),
    ({"gpus": [0, 1]}, [0, 1]),
    ({"gpus": [3]}, [3]),
    ({"gpus": [0, 1], "pipelines": 5}, [0, 1, 0, 1, 0]),  # spread over the GPUs in turn
    ({"gpus": [2], "pipelines": 3}, [2, 2, 2]),
])
def test_resolve_devices(samples, runtime, expected):
    config = parse_config({"sources": [{"name": "a", "uri": str(samples.bikes)}], "runtime": runtime})
    assert resolve_devices(config) == expected


def test_fewer_pipelines_than_gpus_is_a_configuration_error(samples):
    with pytest.raises(ConfigError, match=r"^runtime\.pipelines: at least one per GPU of "
                                          r"runtime\.gpus \(3\), got 2$"):
        parse_config({"sources": [{"name": "a", "uri": str(samples.bikes)}],
                      "runtime": {"gpus": [0, 1, 2], "pipelines": 2}})


def test_hosts_are_named_by_their_gpu_and_their_place_on_it():
    assert host_names([0, 1]) == ["gpu0", "gpu1"]
    assert host_names([0, 1, 0, 1, 0]) == ["gpu0.0", "gpu1.0", "gpu0.1", "gpu1.1", "gpu0.2"]
    assert host_names([None, None]) == ["pipeline0", "pipeline1"]


@pytest.mark.parametrize("gpus, actors, share", [
    (0, 4, 0), (2, 2, 1), (2, 1, 1), (2, 3, 0.5), (2, 6, 1 / 3), (1, 3, 1 / 3), (0.5, 2, 0)])
def test_ray_actors_share_a_gpu_when_there_are_more_of_them_than_gpus(gpus, actors, share):
    from pipeline.app.ray_cluster import actor_gpus

    assert actor_gpus(gpus, actors) == pytest.approx(share)


def test_cores_are_shared_out_in_contiguous_shares(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert share_cores(2) == [[0, 1], [2, 3, 4]]
    assert share_cores(5) == [[0], [1], [2], [3], [4]]
    assert share_cores(6) is None and share_cores(1) is None


def test_relative_paths_are_made_absolute(samples, tmp_path):
    config = parse_config({"sources": [{"name": "a", "uri": str(samples.bikes)},
                                       {"name": "b", "uri": "rtsp://h/x"}],
                           "output": {"dir": "out"}})
    absolute = absolute_paths(config, "/base")
    assert absolute.output.dir == "/base/out"
    assert absolute.model.path == f"/base/{config.model.path}"
    assert absolute.sources[1].uri == "rtsp://h/x"
    assert config.output.dir == "out"


def test_ray_without_the_package_is_a_one_line_error(samples, tmp_path, monkeypatch, capsys):
    import importlib.util

    config = tmp_path / "c.yaml"
    config.write_text(f"sources: [{{name: a, uri: {samples.bikes}}}]\n")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else real(name, *a))
    assert cli.main(["--config", str(config), "--ray", "auto"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == ("error: --ray: needs the Python package 'ray', which is "
                                       "not installed: pip install 'streamdet[ray]'\n")


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
