"""Decode worker processes end to end: a real RTSP camera decoded in a worker beside a file,
and ``run.py`` stopped with SIGINT or SIGTERM, or killed with SIGKILL, while its workers
decode: no worker process and no shared-memory segment may outlive it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from pipeline.app.build import build_graph
from pipeline.app.workers import WorkerSource
from pipeline.config import parse_config
from pipeline.records import BatchDetections
from tests.e2e.conftest import Run, pipeline_config, records
from tests.support.clips import ClipFactory
from tests.support.harness import wait_for


@pytest.fixture(scope="module")
def clip(make_clip: ClipFactory) -> Path:
    """A 30-frame street clip."""
    return make_clip("bikes", 30, (320, 136))


# -- processes and shared memory, read from /proc ---------------------------------------------

def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def children(pid: int) -> dict[int, str]:
    """The child processes of ``pid``, with their command lines."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rfind(")") + 2:].split()[1]) == pid:
            found[int(entry.name)] = cmdline(int(entry.name))
    return found


def decode_workers(pid: int) -> list[int]:
    """The decode worker processes of the pipeline ``pid`` (multiprocessing's spawned
    children; its resource tracker is the other child)."""
    return [child for child, line in children(pid).items() if "spawn_main" in line]


def shm_segments(pid: int) -> set[str]:
    """The ``/dev/shm/streamdet_*`` segments that process ``pid`` has mapped."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    return {line.split()[-1] for line in maps.splitlines() if "/dev/shm/streamdet_" in line}


def start_two_files(samples, clip: Path, tmp_path: Path, run_pipeline,
                    new_session: bool = False) -> tuple[Run, list[int], str]:
    """run.py on bikes.mp4 (250 frames) and a short clip, each in its own decode worker,
    caught mid-run: the run, its worker pids and its shared segment."""
    sources = [{"name": "bikes", "uri": str(samples.bikes)}, {"name": "street", "uri": str(clip)}]
    run = run_pipeline(pipeline_config(samples, tmp_path, sources,
                                       runtime={"decode_workers": 2}), tmp_path, new_session)
    wait_for(lambda: len(records(tmp_path / "bikes.partial.jsonl")) >= 10, "the first frames",
             90, run)
    pid = run.process.pid
    workers = decode_workers(pid)
    segments = shm_segments(pid)
    assert len(workers) == 2, children(pid)
    assert len(segments) == 1 and all(shm_segments(w) == segments for w in workers), segments
    started = run.events("decode workers started")
    assert [(e["workers"], e["sources"]) for e in started] == [(2, 2)]
    return run, workers, segments.pop()


# -- tests ------------------------------------------------------------------------------------

@pytest.mark.slow  # a real RTSP server
def test_a_camera_decoded_in_a_worker_beside_a_file(samples, clip: Path, tmp_path: Path,
                                                    rtsp_server) -> None:
    """The file completes, the camera's frames arrive, and when the file is done the camera
    is stopped: both outputs are final."""
    server = rtsp_server({"cam": "live"})
    camera_first: list[bool] = []

    def on_batch_done(source: str, part: BatchDetections) -> None:
        # Hold the file's first batch until the camera's first frame has come from its
        # worker, so the camera is running before the file can end. (Hold it no longer: the
        # camera's frames held up in the stalled chain would take all its worker's slots.)
        if source == "street" and not camera_first:
            deadline = time.monotonic() + 20
            while pool.next_index[0] < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            camera_first.append(pool.next_index[0] >= 1)

    sources = [{"name": "cam", "uri": server.url("cam")}, {"name": "street", "uri": str(clip)}]
    config = parse_config(pipeline_config(samples, tmp_path, sources,
                                          runtime={"decode_workers": 2,
                                                   "stop_when": "files_ended"}))
    graph = build_graph(config, on_batch_done=on_batch_done)
    assert all(isinstance(s, WorkerSource) for s in graph.sources)
    pool = graph.sources[0].pool
    assert [w.sources for w in pool.workers] == [[0], [1]]
    shm = Path("/dev/shm", graph.ring.shm_name)
    graph.run()

    assert camera_first == [True], "no frame came from the camera's worker in 20 s"
    assert sorted(p.name for p in tmp_path.glob("*.jsonl")) == ["cam.jsonl", "street.jsonl"]
    assert [r["frame"] for r in records(tmp_path / "street.jsonl")] == list(range(30))
    cam = [r["frame"] for r in records(tmp_path / "cam.jsonl")]
    assert cam and cam == sorted(set(cam))
    assert graph.source_metrics["cam"].error is None and graph.source_metrics["street"].error is None
    assert all(not w.process.is_alive() for w in pool.workers)
    assert not shm.exists()


@pytest.mark.parametrize(("signum", "to_group"), [
    (signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGTERM, True)],
    ids=["SIGINT", "SIGTERM", "SIGTERM-to-the-process-group"])
def test_a_signal_stops_the_workers_and_closes_every_output(
        samples, clip: Path, tmp_path: Path, run_pipeline, signum: int, to_group: bool) -> None:
    """Also a SIGTERM to the whole process group (systemd's stop, ``kill -TERM -PGID``): the
    workers leave the stop to the pipeline, no worker is reported dead. The files were cut
    short: exit 3, their outputs closed under their ``.partial`` names, complete line by
    line."""
    run, workers, segment = start_two_files(samples, clip, tmp_path, run_pipeline, to_group)
    if to_group:
        os.killpg(run.process.pid, signum)
    else:
        run.signal(signum)
    assert run.wait() == 3, run.stderr()[-3000:]

    names = sorted(p.name for p in tmp_path.glob("*.jsonl"))
    # the short clip may have ended before the signal: then it has its final name
    assert names in (["bikes.partial.jsonl", "street.partial.jsonl"],
                     ["bikes.partial.jsonl", "street.jsonl"]), names
    bikes = [r["frame"] for r in records(tmp_path / "bikes.partial.jsonl")]
    street = [r["frame"] for r in records(tmp_path / names[1])]
    assert 10 <= len(bikes) < 250 and bikes == list(range(len(bikes)))
    assert street == list(range(len(street)))
    assert not [w for w in workers if alive(w)], "decode workers outlived the pipeline"
    assert not Path(segment).exists(), f"{segment} was left behind"
    assert not run.events("decode worker died: restarting its sources")
    assert "Traceback" not in run.stderr()


def test_a_killed_pipeline_leaves_no_worker_and_no_shared_memory(
        samples, clip: Path, tmp_path: Path, run_pipeline) -> None:
    run, workers, segment = start_two_files(samples, clip, tmp_path, run_pipeline)
    tracker = [c for c, line in children(run.process.pid).items() if "resource_tracker" in line]
    run.process.kill()
    killed_at = time.monotonic()
    run.wait()

    deadline = killed_at + 5.0
    while [w for w in workers if alive(w)] and time.monotonic() < deadline:
        time.sleep(0.05)
    workers_s = time.monotonic() - killed_at
    assert not [w for w in workers if alive(w)], "decode workers outlived the killed pipeline"
    deadline = killed_at + 5.0
    while Path(segment).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    shm_s = time.monotonic() - killed_at
    print(f"\nafter SIGKILL: workers gone in {workers_s:.2f} s, {segment} gone in {shm_s:.2f} s")
    assert not Path(segment).exists(), f"{segment} leaked after the pipeline was killed"
    while [t for t in tracker if alive(t)] and time.monotonic() < deadline + 2.0:
        time.sleep(0.05)
    assert not [t for t in tracker if alive(t)], "the resource tracker outlived its work"
