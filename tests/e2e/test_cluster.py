"""Several pipelines under one supervisor, end to end on the CPU path with the sample model:
four file sources over two pipelines, one pipeline killed mid-run. Its sources must continue
on the other pipeline from their last written record: every file's records complete, in
order, each frame once. Once with local processes (the source workers of ``runtime.workers``)
and once with GPU units as Ray actors on a local Ray cluster (``--ray``)."""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from pipeline.app.supervisor import LocalExecutor, Supervisor, absolute_paths
from pipeline.config import PipelineConfig, parse_config, partial_path
from tests.e2e.conftest import pipeline_config, records
from tests.support.ci import require_ray_installed
from tests.support.harness import wait_for

FRAMES = 60  # per source
SOURCES = 4


@pytest.fixture(scope="module")
def clip(make_clip) -> Path:
    """A 60-frame street clip."""
    return make_clip("bikes", FRAMES, (320, 136))


def cluster_config(samples, out: Path, clip: Path) -> PipelineConfig:
    # The detector runs on every third frame (the CPU is slow); every frame gets a record.
    sources = [{"name": f"cam{i}", "uri": str(clip), "detect_every": 3} for i in range(SOURCES)]
    data = pipeline_config(samples, out, sources,
                           runtime={"decode_workers": 0, "workers": 2, "max_restarts": 2})
    return absolute_paths(parse_config(data))


def kill_one_mid_run(supervisor: Supervisor, out: Path, kill, host: int = 1
                     ) -> tuple[dict, float, list[str]]:
    """Run ``supervisor`` on a thread; once a source of ``host`` has written some records but
    is far from done, ``kill(host)``. Returns the results, when it was killed and the sources
    it had then."""
    results: dict = {}
    runner = threading.Thread(target=lambda: results.update(supervisor.run()), daemon=True)
    runner.start()
    deadline = time.monotonic() + 60
    while True:
        on_host = [name for name, at in supervisor.placement.items() if at == host]
        written = {name: len(records(partial_path(out / f"{name}.jsonl"))) for name in on_host}
        if any(10 <= count <= FRAMES - 15 for count in written.values()):
            break
        assert runner.is_alive(), f"the run ended before host {host} could be killed: {results}"
        assert time.monotonic() < deadline, f"host {host} wrote no records in time: {written}"
        time.sleep(0.05)
    killed_at = time.time()
    kill(host)
    runner.join(90)
    assert not runner.is_alive(), "the run did not end within 90 s of the kill"
    return results, killed_at, on_host


def check_records_complete(supervisor: Supervisor, out: Path, killed_at: float,
                           moved: list[str], to: int = 0, killed: int = 1) -> None:
    assert moved, f"host {killed} had no source"
    for i in range(SOURCES):
        name = f"cam{i}"
        assert not partial_path(out / f"{name}.jsonl").exists()
        frames = [record["frame"] for record in records(out / f"{name}.jsonl")]
        assert frames == list(range(FRAMES)), f"{name}: records not complete and in order"
    kept = 0
    for name in moved:
        # Continued on host ``to``, resumed: the records before the kill are the first run's
        # (captured before it), the rest the later runs' (it may move back to the killed host
        # once that is restarted, to even the loads); not started over.
        hosts = [host for source, host, _ in supervisor.history if source == name]
        assert hosts[:2] == [killed, to], f"{name} ran on {hosts}"
        captured = [record["capture_time"] for record in records(out / f"{name}.jsonl")]
        before = sum(t < killed_at for t in captured)
        assert before < FRAMES and all(t < killed_at for t in captured[:before])
        kept += before
    assert kept >= 10  # one of them had written at least 10 records: they were kept
    assert supervisor.moves == {name: 1 for name in moved}


@pytest.mark.slow
def test_local_processes_a_killed_worker_s_sources_continue_on_the_spare(samples, tmp_path, clip):
    out = tmp_path / "out"
    config = cluster_config(samples, out, clip)
    executor = LocalExecutor(config, [None, None, None], spares={2})  # as make_executor does
    supervisor = Supervisor(config, executor, config.runtime.max_restarts)
    pids = {}

    def kill(host: int) -> None:
        pids["killed"] = executor.kill(host)

    results, killed_at, moved = kill_one_mid_run(supervisor, out, kill)
    assert results == {f"cam{i}": None for i in range(SOURCES)}
    check_records_complete(supervisor, out, killed_at, moved, to=2)
    # Host 0's sources ran there only; host 1 was restarted (a fresh, empty process) as the
    # spare, and every host process is gone at the end.
    placed = [(source, host) for source, host, _ in supervisor.history if source not in moved]
    assert {host for _, host in placed} == {0} and len(placed) == SOURCES - len(moved)
    assert supervisor.hosts[1].restarts == 1 and supervisor.hosts[1].spare
    assert executor.processes[1].pid != pids["killed"]
    assert not any(process.is_alive() for process in executor.processes.values())


def close_and_linger(conn) -> None:
    """A worker that has closed its end of the pipe and is still exiting (a killed worker
    while the driver tears down its CUDA context)."""
    conn.close()
    time.sleep(60)


def linger(conn) -> None:
    """A worker that goes on as if alive (its pipe open) while its engine saw it go."""
    time.sleep(60)


@contextmanager
def worker_0_as(samples, tmp_path, clip, target):
    """A ``LocalExecutor`` whose worker 0 is a process running ``target(conn)`` (its end
    of the pipe); yields (executor, process)."""
    executor = LocalExecutor(cluster_config(samples, tmp_path / "out", clip), [None, None])
    try:
        ours, theirs = executor._context.Pipe()
        process = executor._context.Process(target=target, args=(theirs,))
        process.start()
        theirs.close()
        executor._attach(0, process, ours)
        yield executor, process
    finally:
        executor.close()


def test_a_worker_its_engine_saw_go_is_gone_at_once(samples, tmp_path, clip):
    with worker_0_as(samples, tmp_path, clip, linger) as (executor, process):
        assert executor.poll(0) == ([], None)  # alive
        executor.engines[None].gone.add(process.pid)  # its engine's ("gone", 0, pid)
        reports, died = executor.poll(0)
        assert died == f"process {process.pid} ended (its exit status not in yet)"
        process.join(5)
        assert process.exitcode == -9 and not executor.engines[None].gone
        with capture_logs() as logs:  # reaped at the next poll: its status said then
            executor.poll(0)
        assert {"event": "source worker exited", "pid": process.pid, "how": "killed by SIGKILL",
                "log_level": "info"} in logs


def test_a_worker_whose_pipe_closed_is_gone_at_once(samples, tmp_path, clip):
    with worker_0_as(samples, tmp_path, clip, close_and_linger) as (executor, process):
        deadline = time.monotonic() + 30
        while True:
            reports, died = executor.poll(0)
            if died is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert died == f"process {process.pid} ended (its exit status not in yet)"
        process.join(5)
        assert process.exitcode == -9  # made sure of


def running(pid: int) -> bool:
    """``pid`` runs (exists and is not a zombie waiting to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def require_ray():
    """Ray, or a skip (a failure in CI: ``skip_unless_ci``)."""
    require_ray_installed()
    import ray

    return ray


@pytest.mark.slow
def test_ray_units_a_killed_unit_s_sources_continue_on_the_other(samples, tmp_path, clip):
    """Two units on a local Ray cluster (the CPU path: one engine process, one source worker
    and its spare each, inside the unit's actor); unit 1's actor is killed: its worker and its
    spare die together, the worker's sources resume on unit 0's worker (not on the dead
    spare), Ray brings the unit back and both are started there again."""
    ray = require_ray()
    from pipeline.app.ray_cluster import RayExecutor

    out = tmp_path / "out"
    config = cluster_config(samples, out, clip)
    config.runtime.workers, config.runtime.spare_workers = 1, 1
    config.runtime.standby_engine = False
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        executor = RayExecutor(config, units=2)
        assert executor.options["num_gpus"] == 0 and executor.options["max_restarts"] == 2
        assert executor.names == ["unit0.worker0", "unit0.worker1", "unit1.worker0",
                                  "unit1.worker1"]
        assert executor.groups == [0, 0, 1, 1] and executor.spares == {1, 3}
        supervisor = Supervisor(config, executor, config.runtime.max_restarts)
        seen = {}

        def kill(host: int) -> None:
            seen["pid"] = ray.get(executor.actors[1].pid.remote())
            seen["engines"] = ray.get(executor.actors[1].engine_states.remote())
            executor.kill(host)

        results, killed_at, moved = kill_one_mid_run(supervisor, out, kill, host=2)
        assert results == {f"cam{i}": None for i in range(SOURCES)}
        check_records_complete(supervisor, out, killed_at, moved, to=0, killed=2)
        assert [supervisor.hosts[h].restarts for h in range(4)] == [0, 0, 1, 1]
        assert supervisor.hosts[3].spare and not supervisor.hosts[2].spare
        # the unit ran its own engine process (its one model copy), which went with it
        (engine,) = seen["engines"].values()
        assert engine["ready"] and engine["pid"] not in (None, seen["pid"]), seen
        assert not running(engine["pid"]), "the killed unit's engine lives on"
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_a_stop_signal_to_the_whole_group_of_a_ray_local_run_ends_it_in_seconds(
        samples, tmp_path, run_pipeline):
    """``kill -TERM -PGID`` (what ``timeout`` and systemd send) on ``run.py --ray local``
    reaches the Ray instance the run started too (its unit, in a process group of its own,
    drains until Ray's processes have gone): the run sees its cluster gone and ends in
    seconds with exit 3, its output kept to resume. (Before, it waited out Ray's call
    timeouts: 48-57 s, once exit 1 when Ray's driver gave the GCS up.)"""
    require_ray()
    config = pipeline_config(
        samples, tmp_path, [{"name": "street", "uri": str(samples.bikes), "pace_fps": 10,
                             "detect_every": 2}],
        runtime={"workers": 1, "standby_engine": False, "decode_workers": 0})
    run = run_pipeline(config, tmp_path, new_session=True, extra_args=["--ray", "local"])
    partial = partial_path(tmp_path / "street.jsonl")
    wait_for(lambda: len(records(partial)) >= 5, "the first records", 180, run)
    os.killpg(run.process.pid, signal.SIGTERM)
    signalled = time.monotonic()
    code = run.wait(60)
    took = time.monotonic() - signalled
    assert code == 3, run.stderr()[-3000:]
    assert run.events("ray cluster gone"), run.stderr()[-3000:]
    assert took < 15, f"the run took {took:.1f} s to end"
    assert partial.exists() and 5 <= len(records(partial)) < 250
    # the unit's log lines, which Ray prints for it, are in the log without colour codes
    assert "(RayUnit pid=" in run.stderr() and "\x1b[" not in run.stderr()


@pytest.mark.slow
def test_a_moved_simulated_camera_s_pts_go_on_after_its_last_record(samples, tmp_path, clip):
    """A looped, paced file (a simulated camera) on a killed worker goes on on the spare:
    its frame numbers and its pts go on after its last record (the pts once started again at
    0.0 on the spare: they went back in the records)."""
    out = tmp_path / "out"
    sources = [{"name": "cam", "uri": str(clip), "loop": True, "pace_fps": 10},
               {"name": "file", "uri": str(clip), "detect_every": 3}]
    config = absolute_paths(parse_config(pipeline_config(
        samples, out, sources, runtime={"decode_workers": 0, "workers": 2,
                                        "max_restarts": 2})))
    executor = LocalExecutor(config, [None, None, None], spares={2})
    supervisor = Supervisor(config, executor, config.runtime.max_restarts)
    results: dict = {}
    runner = threading.Thread(target=lambda: results.update(supervisor.run()), daemon=True)
    runner.start()
    try:
        wait_for(lambda: len(records(partial_path(out / "cam.jsonl"))) >= 10,
                 "the camera's first records", 60)
        executor.kill(supervisor.placement["cam"])
        wait_for(lambda: supervisor.moves.get("cam") == 1, "the camera moved", 30)
        moved_at = len(records(partial_path(out / "cam.jsonl")))
        wait_for(lambda: len(records(partial_path(out / "cam.jsonl"))) >= moved_at + 10,
                 "the camera's records after the move", 60)
    finally:
        supervisor.request_stop()
        runner.join(60)
    assert not runner.is_alive()
    written = records(out / "cam.jsonl")
    frames = [record["frame"] for record in written]
    pts = [record["pts"] for record in written]
    assert frames == sorted(set(frames)), "frame numbers went back or repeated"
    assert all(b > a for a, b in zip(pts, pts[1:])), f"pts went back: {pts}"
