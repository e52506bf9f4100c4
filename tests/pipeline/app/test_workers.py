"""Decode worker processes for real: small generated clips decoded in spawned processes into
the shared slot ring, a worker killed with SIGKILL mid-run, a frame too large for its slot,
and the slot ring's routing of released slots back to the workers that own them."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pipeline.app.workers as workers
from pipeline.app.build import build_graph
from pipeline.app.workers import DecodeWorkerPool, WorkerSource, default_worker_count
from pipeline.config import parse_config
from pipeline.graph import Graph
from pipeline.records import BatchDetections
from pipeline.slots import SlotRing
from tests.e2e.conftest import pipeline_config, records
from tests.support.clips import ClipFactory

SIZES = {"a": (320, 136), "b": (288, 160), "c": (176, 144)}
FRAMES = {"a": 24, "b": 18, "c": 12}


@pytest.fixture(scope="module")
def clips(make_clip: ClipFactory) -> dict[str, Path]:
    """Three short clips of real street scenes, each of its own size and length; one long
    clip (kill test); one clip larger than the ring's 1920x1080 slots."""
    made = {name: make_clip("bikes", FRAMES[name], size, start=i * 7)
            for i, (name, size) in enumerate(SIZES.items())}
    made["long"] = make_clip("bikes", 36, (256, 112))
    made["huge"] = make_clip("bikes", 3, (1984, 1120))  # > 1920x1080 bytes
    return made


def build(samples, out: Path, sources: list[dict[str, Any]], decode_workers: int,
          on_batch_done: Callable[[str, BatchDetections], None] | None = None,
          **sections: Any) -> Graph:
    runtime = {"decode_workers": decode_workers, **sections.pop("runtime", {})}
    config = parse_config(pipeline_config(samples, out, sources, runtime=runtime, **sections))
    return build_graph(config, on_batch_done=on_batch_done)


def pool_of(graph: Graph) -> DecodeWorkerPool:
    pools = {id(s.pool): s.pool for s in graph.sources if isinstance(s, WorkerSource)}
    assert len(pools) == 1, "expected every CPU-decoded source in one worker pool"
    return next(iter(pools.values()))


def without_capture_time(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in line.items() if k != "capture_time"} for line in lines]


def worker_processes_left() -> list[multiprocessing.process.BaseProcess]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("streamdet-decode")]


# ---------------------------------------------------------------------------------------------
# Units


@pytest.mark.parametrize(("sources", "cores", "expected"), [
    (1, 1, 1), (1, 2, 1), (3, 2, 1), (3, 4, 2), (3, 8, 3), (8, 16, 8), (20, 16, 14),
    (0, 8, 1),
])
def test_default_worker_count(sources: int, cores: int, expected: int) -> None:
    assert default_worker_count(sources, cores) == expected


def test_default_worker_count_reads_the_cores_this_process_may_use(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU affinity (a container's or taskset's limit), not every core of the machine."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    assert default_worker_count(10) == 4
    assert default_worker_count(10, cores=3) == 1  # a host's share
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert default_worker_count(10) == 1


def test_release_routes_slots_to_their_workers_in_one_call_each() -> None:
    ring = SlotRing(10, 64)
    calls: list[tuple[int, list[int]]] = []
    shares = ring.give_to_workers([3, 2], lambda worker, slots: calls.append((worker, slots)))
    assert [len(s) for s in shares] == [3, 2]
    assert not set(shares[0]) & set(shares[1]) and ring.free_slots() == 5
    assert ring.owner[shares[0]].tolist() == [0] * 3 and ring.owner[shares[1]].tolist() == [1] * 2
    local = [ring.acquire(), ring.acquire()]
    assert not set(local) & {*shares[0], *shares[1]}  # this process only takes its own slots

    ring.release(np.array([shares[0][0], shares[1][1], local[0], -1, shares[0][2], local[1]]))
    assert sorted(calls) == [(0, [shares[0][0], shares[0][2]]), (1, [shares[1][1]])]
    assert ring.free_slots() == 5  # the two local slots came back here, none of the workers'

    calls.clear()
    ring.release([ring.acquire()])  # only local slots: no worker hears of it
    ring.release([])
    assert calls == [] and ring.free_slots() == 5

    with pytest.raises(ValueError, match="6 slots asked for workers, 5 free"):
        SlotRing(5, 64).give_to_workers([3, 3], lambda worker, slots: None)


def _child_reads_and_writes(name: str, slots: int, slot_bytes: int, conn: Any) -> None:
    ring = SlotRing.attach(name, slots, slot_bytes, free=[3])
    conn.send((ring.memory[1].tobytes(), ring.acquire(), ring.try_acquire()))
    ring.memory[3, :] = np.arange(slot_bytes, dtype=np.uint8)[::-1]
    ring.close_view()
    conn.send("written")


def test_attach_in_a_child_process_sees_the_parents_writes_and_vice_versa() -> None:
    ring = SlotRing(4, 256, shared=True)
    try:
        assert ring.shm_name is not None and Path("/dev/shm", ring.shm_name).exists()
        ring.memory[1, :] = np.arange(256, dtype=np.uint8)
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        child = context.Process(target=_child_reads_and_writes,
                                args=(ring.shm_name, 4, 256, theirs))
        child.start()
        assert ours.poll(30), "the child did not answer"
        seen, first, second = ours.recv()
        assert seen == bytes(range(256))
        assert (first, second) == (3, None)  # its free list is the slots it was given
        assert ours.poll(30) and ours.recv() == "written"
        child.join(10)
        assert child.exitcode == 0
        assert ring.memory[3].tolist() == list(range(255, -1, -1))
    finally:
        name = ring.shm_name
        ring.close()
        ring.close()  # idempotent
    assert not Path("/dev/shm", name).exists()


def test_a_starved_live_source_s_drops_are_told_without_waiting_for_its_next_frame(samples
                                                                                   ) -> None:
    """A worker whose two slots the pipeline never frees: its live camera (bikes looped at 50
    fps: it never ends) sends two frames, then drops every frame it decodes. Its counts reach the pipeline
    within a poll (``POLL_S``), not with its next frame: the live view showed "dropped 0" for
    5 s once, then 67 at once."""
    from pipeline.app.workers import END, FRAME, STATS, worker_main
    from pipeline.config import SourceConfig
    from pipeline.slots import i420_bytes

    slot_bytes = i420_bytes(640, 272)
    ring = SlotRing(2, slot_bytes, shared=True)
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    camera = SourceConfig(name="cam", uri=str(samples.bikes), loop=True, pace_fps=50.0)
    child = context.Process(target=worker_main, args=(
        0, [(7, camera, 0)], ring.shm_name, 2, slot_bytes, [0, 1], theirs, "json", "warning", 1))
    try:
        child.start()
        messages: list[tuple] = []
        deadline = time.monotonic() + 10  # 10 frames dropped take 0.2 s at 50 fps
        while time.monotonic() < deadline and not any(
                m[0] == STATS and m[3] >= 10 for m in messages):
            if ours.poll(0.1):
                messages.append(ours.recv())
        kinds = [m[0] for m in messages]
        assert END not in kinds and kinds.count(FRAME) == 2, kinds  # its slots, never freed
        last_frame = max(i for i, kind in enumerate(kinds) if kind == FRAME)
        dropped = [m[3] for m in messages[last_frame + 1:] if m[0] == STATS]
        assert dropped and dropped == sorted(dropped) and dropped[-1] >= 10, messages
        ours.send(("stop",))
        while ours.poll(10):
            if ours.recv()[0] == END:
                break
        child.join(10)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
        ring.close()


# ---------------------------------------------------------------------------------------------
# The pipeline with worker processes


@pytest.mark.slow  # every clip twice through the CPU detector
def test_files_through_worker_processes_match_the_threaded_decode(samples, clips, tmp_path) -> None:
    sources = [{"name": name, "uri": str(clips[name])} for name in SIZES]
    results = {}
    for decode_workers in (2, 0):
        out = tmp_path / f"workers{decode_workers}"
        graph = build(samples, out, sources, decode_workers)
        ring = graph.ring
        if decode_workers:
            pool = pool_of(graph)
            assert len(pool.workers) == 2 and sorted(
                sid for w in pool.workers for sid in w.sources) == [0, 1, 2]
            assert ring.shm_name is not None
        graph.run()
        assert not worker_processes_left()
        if decode_workers:
            assert not Path("/dev/shm", ring.shm_name).exists()
        assert sorted(p.name for p in out.glob("*.jsonl")) == [f"{n}.jsonl" for n in SIZES]
        results[decode_workers] = {name: records(out / f"{name}.jsonl") for name in SIZES}
        for name, lines in results[decode_workers].items():
            assert [r["frame"] for r in lines] == list(range(FRAMES[name])), name
            assert {r["source"] for r in lines} == {name}
            assert graph.source_metrics[name].error is None
    assert sum(len(r["detections"]) for lines in results[2].values() for r in lines) > 20
    for name in SIZES:
        assert without_capture_time(results[2][name]) == without_capture_time(results[0][name])


class TimedLog:
    """Stands in for ``pipeline.app.workers.log``: notes when each event was logged."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.events: list[tuple[float, str, dict]] = []

    def __getattr__(self, level: str) -> Callable[..., Any]:
        def emit(event: str, **fields: Any) -> Any:
            self.events.append((time.monotonic(), event, fields))
            return getattr(self.inner, level)(event, **fields)
        return emit


def test_a_killed_worker_is_restarted_and_its_file_resumes_at_the_next_frame(
        samples, clips, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    timed = TimedLog(workers.log)
    monkeypatch.setattr(workers, "log", timed)
    killed: dict[str, Any] = {}
    kill_once = threading.Lock()

    def on_batch_done(source: str, part: BatchDetections) -> None:
        # Kill the worker of "long" after a few of its frames, from a sink thread, mid-run.
        if source == "long" and part.frames.index.max() >= 5 and kill_once.acquire(False):
            victim = next(w for w in pool.workers if 0 in w.sources)
            killed["worker"], killed["pid"] = victim.number, pool.kill_worker(victim.number)
            killed["at"] = time.monotonic()

    sources = [{"name": "long", "uri": str(clips["long"])}, {"name": "a", "uri": str(clips["a"])}]
    graph = build(samples, tmp_path, sources, 2, on_batch_done)
    pool = pool_of(graph)
    assert [w.sources for w in pool.workers] == [[0], [1]]  # one source per worker
    spawned: list[tuple[float, int]] = []
    spawn = pool._spawn

    def timed_spawn(worker: Any) -> None:
        spawn(worker)
        spawned.append((time.monotonic(), worker.number))

    monkeypatch.setattr(pool, "_spawn", timed_spawn)
    graph.run()

    assert killed, "the kill never happened"
    lines = records(tmp_path / "long.jsonl")
    assert [r["frame"] for r in lines] == list(range(36))  # each frame once, in order, all
    assert [r["frame"] for r in records(tmp_path / "a.jsonl")] == list(range(FRAMES["a"]))
    died = [(t, f) for t, event, f in timed.events if event.startswith("decode worker died")]
    assert len(died) == 1, timed.events
    died_at, fields = died[0]
    assert fields["worker"] == killed["worker"] and fields["sources"] == ["long"]
    assert fields["exit_code"] == -9
    detect_s = died_at - killed["at"]
    restarts = [t for t, number in spawned if number == killed["worker"]][1:]
    assert len(restarts) == 1, spawned
    restart_s = restarts[0] - killed["at"]
    print(f"\nworker kill: detected after {detect_s * 1000:.0f} ms, restarted after "
          f"{restart_s * 1000:.0f} ms (backoff {fields['retry_in_s']} s)")
    assert detect_s < 1.0
    assert restart_s < 1.0 + fields["retry_in_s"]
    assert pool.workers[killed["worker"]].process.pid != killed["pid"]
    assert graph.source_metrics["long"].error is None and graph.source_metrics["long"].reconnects == 1
    assert graph.source_metrics["a"].error is None and graph.source_metrics["a"].reconnects == 0
    assert not worker_processes_left()
    assert not Path("/dev/shm", graph.ring.shm_name).exists()


def test_a_restarted_worker_s_looped_camera_goes_on_with_its_pts(samples, clips,
                                                                  tmp_path) -> None:
    """A looped paced file (a simulated camera) in a decode worker killed mid-run: after the
    restart its frame numbers and its pts go on (the pts once started again at 0.0)."""
    killed: dict[str, int] = {}
    lock = threading.Lock()

    def on_batch_done(source: str, part: BatchDetections) -> None:
        last = int(part.frames.index.max())
        with lock:
            if "at" not in killed and last >= 5:
                killed["at"] = last
                pool.kill_worker(pool.workers[0].number)
            elif "at" in killed and last >= killed["at"] + 20:
                graph.request_stop()

    sources = [{"name": "cam", "uri": str(clips["long"]), "loop": True, "pace_fps": 25}]
    graph = build(samples, tmp_path, sources, 1, on_batch_done)
    pool = pool_of(graph)
    graph.run()

    assert killed, "the kill never happened"
    lines = records(tmp_path / "cam.jsonl")
    frames, pts = [r["frame"] for r in lines], [r["pts"] for r in lines]
    assert frames == sorted(set(frames)) and frames[-1] >= killed["at"] + 20
    assert graph.source_metrics["cam"].reconnects == 1  # its worker was restarted once
    assert all(b > a for a, b in zip(pts, pts[1:])), pts
    assert not worker_processes_left()


def test_a_frame_too_large_for_its_slot_ends_that_source_alone(samples, clips, tmp_path) -> None:
    # Slots are sized for the largest FILE source (at least 1920x1080): a live source bigger
    # than that cannot fit. Both sources are decoded by the same worker process.
    sources = [{"name": "huge", "uri": str(clips["huge"]), "live": True},
               {"name": "c", "uri": str(clips["c"])}]
    graph = build(samples, tmp_path, sources, 1)
    assert [w.sources for w in pool_of(graph).workers] == [[0, 1]]
    graph.run()
    error = graph.source_metrics["huge"].error
    assert error is not None and "\n" not in error
    assert error.startswith("a 1984x1120 frame does not fit the frame slots of 3110400 bytes")
    assert [r["frame"] for r in records(tmp_path / "c.jsonl")] == list(range(FRAMES["c"]))
    assert graph.source_metrics["c"].error is None
    assert not records(tmp_path / "huge.jsonl") and not records(tmp_path / "huge.partial.jsonl")
    assert not worker_processes_left()


@pytest.mark.parametrize("role, title", [
    ("engine", "sd.engine"), ("worker3", "sd.worker3"), ("gpu1.worker2", "sd.gpu1.worker2"),
    ("unit1.worker2", "sd.u1.worker2"),  # a Ray unit's worker: 16 bytes as sd.unit1.worker2
    ("gpu10.worker0", "sd.g10.worker0"), ("unit12.engine", "sd.u12.engine"),
])
def test_each_process_is_named_within_what_linux_keeps_with_its_number(role, title):
    from pipeline.app.workers import process_title

    assert process_title(role) == title
    assert len(title.encode()) <= 15


def test_a_process_shows_its_name_to_ps():
    """The name is really set: a child names itself, and /proc says so."""
    if not Path("/proc/self/comm").exists():
        pytest.skip("no /proc (not Linux)")
    import subprocess
    import sys

    code = ("from pipeline.app.workers import name_this_process\n"
            "name_this_process('unit1.worker2')\n"
            "print(open('/proc/self/comm').read().strip())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[3])
    assert out.stdout.strip() == "sd.u1.worker2"


@pytest.mark.parametrize("shielded", [True, False])
def test_a_child_started_shielded_outlives_a_ctrl_c_during_its_start(shielded: bool) -> None:
    """A terminal's Ctrl-C reaches every process of the group, also a child still starting
    (here: sleeping where it would import); started shielded, it goes on undisturbed; else
    it dies of KeyboardInterrupt, as a new user's workers did."""
    import multiprocessing
    import signal
    import time

    from pipeline.app.workers import start_shielded

    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(1.0,))
    (start_shielded if shielded else type(child).start)(child)
    time.sleep(0.3)
    os.kill(child.pid, signal.SIGINT)
    child.join(10)
    assert (child.exitcode == 0) is shielded
