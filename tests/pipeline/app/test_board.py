"""The live view's control side (``pipeline.app.board``): two real pipelines (the sample
clips paced as cameras, on the CPU with the test model), each with its ``HostView``, feeding
one ``SourceBoard``: every source listed in config order with its host, pictures of the
watched source only and from its own host, a host gone (its source ``reconnecting``) and the
source placed on the other host; ``local_board``'s add and remove on a real pipeline; the
board's merging rules step by step with reports made by hand; and the control side's imports
(no stage, no OpenCV)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import cv2
import httpx
import numpy as np
import pytest

import pipeline.app.board as board_module
from pipeline.app.board import SourceBoard, ViewReport
from pipeline.app.build import build_graph
from pipeline.app.http import HttpServer
from pipeline.app.view import HostView
from pipeline.config import parse_config
from pipeline.graph import Graph, SourceConflict
from tests.e2e.conftest import pipeline_config
from tests.support.harness import wait_for
from tests.support.live_view import LocalPump, local_board, running, shown, source_config


def jpeg_shape(data: bytes) -> tuple[int, ...]:
    picture = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    assert picture is not None, "not a JPEG"
    return picture.shape


def camera(name: str, uri: Path, fps: int = 6) -> dict:
    return {"name": name, "uri": str(uri), "pace_fps": fps, "live": True}


# -- two real pipelines, one board -------------------------------------------------------------
def test_two_hosts_on_one_board(samples, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(board_module, "SILENT_AFTER_S", 1.0)
    runtime = {"decode_workers": 0, "stop_when": "never", "http": {"port": 0}}
    configs = [parse_config(pipeline_config(samples, tmp_path / host, sources, runtime=runtime))
               for host, sources in (("pipeline0", [camera("street", samples.bikes)]),
                                     ("pipeline1", [camera("car", samples.carphone)]))]
    graphs = [build_graph(config) for config in configs]
    board = SourceBoard(None, None, preview_fps=5, order=["street", "car"])
    views = [HostView(f"pipeline{i}", graph, graph.preview, config)
             for i, (graph, config) in enumerate(zip(graphs, configs))]
    pumps = [LocalPump(board, view) for view in views]
    with ExitStack() as stack:
        for graph, pump in zip(graphs, pumps):
            stack.enter_context(pump)
            stack.enter_context(running(graph))
        wait_for(lambda: board.health()["sources"] == {"street": "running", "car": "running"},
                 "both hosts ready and running", 30)
        assert board.names() == ["street", "car"]
        assert [board.source(n)["host"] for n in board.names()] == ["pipeline0", "pipeline1"]
        health = board.health()
        assert (health["status"], health["reasons"]) == ("ok", [])
        assert {host: (h["ready"], h["sources"], h["gone"])
                for host, h in health["hosts"].items()} == {"pipeline0": (True, 1, False),
                                                            "pipeline1": (True, 1, False)}
        assert all(h["report_age_s"] < 1 for h in health["hosts"].values())
        assert not any(h["spare"] for h in health["hosts"].values())
        board.set_spares(["pipeline1"])  # the supervisor says which hosts are idle spares
        assert [h["spare"] for h in board.health()["hosts"].values()] == [False, True]
        board.set_spares([])
        # the engine (EngineProcess.state) restarting, then back: told, and a reason
        engine = {"pid": 7, "ready": False, "restarts": 1, "standby": None, "failed": None}
        board.set_engines({"engine": engine})
        health = board.health()
        assert (health["status"], health["reasons"], health["engines"]) == (
            "degraded", ["engine is restarting: its workers' cameras drop, files wait"],
            {"engine": engine})
        board.set_engines({"engine": {**engine, "ready": True, "standby": "ready"}})
        assert (board.health()["status"], board.health()["reasons"]) == ("ok", [])
        board.set_engines({"engine": {**engine, "failed": "the engine died 4 times"}})
        assert board.health()["reasons"] == ["engine failed: the engine died 4 times"]
        board.set_engines({})

        # A snapshot asked of the car: only its host is asked for pictures, of it only.
        board.request("car")
        assert (board.wanted("pipeline0"), board.wanted("pipeline1")) == ([], ["car"])
        wait_for(lambda: board.picture_number("car") >= 2, "two pictures of the car", 10)
        number, data = board.picture("car")
        assert jpeg_shape(data) == (144, 176, 3)
        assert board.picture("street") is None
        assert board.source("car")["picture"] == {"width": 176, "height": 144}

        # pipeline1 stops reporting, then is gone: the car is moved to pipeline0.
        pumps[1].close()
        wait_for(lambda: "host pipeline1 has not reported for 1 s" in board.health()["reasons"],
                 "the silent host named", 5)
        assert board.health()["status"] == "degraded"
        board.host_gone("pipeline1")
        car = board.source("car")
        assert (car["state"], car["host"], car["fps"]) == ("reconnecting", "pipeline1", 0.0)
        assert car["error"] == "its host pipeline1 stopped: being placed again"
        health = board.health()
        assert health["hosts"]["pipeline1"]["gone"] is True
        assert "source car is reconnecting (its host pipeline1 stopped: being placed again)" \
            in health["reasons"] and "host pipeline1 stopped" in health["reasons"]

        moved = graphs[0].control.add(camera("car", samples.carphone))
        with pumps[0].lock:
            views[0].add(moved)
            board.added(moved, "pipeline0")
        assert board.names() == ["street", "car"]  # a move keeps its place
        assert (board.source("car")["state"], board.source("car")["host"]) == ("starting",
                                                                                "pipeline0")
        wait_for(lambda: board.source("car")["state"] == "running", "the car running again", 20)
        assert board.source("car")["host"] == "pipeline0"
        board.request("car")  # (the first request's window may be over)
        assert board.wanted("pipeline0") == ["car"] and board.wanted("pipeline1") == []
        wait_for(lambda: board.picture_number("car") > number, "a picture from pipeline0", 10)
        assert jpeg_shape(board.picture("car")[1]) == (144, 176, 3)
        assert board.health()["sources"] == {"street": "running", "car": "running"}


# -- local_board on a real pipeline ----------------------------------------------------------
@pytest.fixture()
def local(samples, tmp_path: Path) -> Iterator[tuple[SourceBoard, Graph]]:
    config = parse_config(pipeline_config(
        samples, tmp_path, [camera("street", samples.bikes)],
        runtime={"decode_workers": 0, "stop_when": "never", "http": {"port": 0}}))
    graph = build_graph(config)
    board, view, pump = local_board(graph, graph.preview, config, host="gpu0")
    assert view.host == "gpu0" and board.editable
    with pump, running(graph):
        wait_for(lambda: board.state("street") == "running", "the street running", 30)
        yield board, graph


def test_local_board_adds_and_removes_through_the_graph(local, samples, tmp_path: Path) -> None:
    board, graph = local
    source = board.add({"name": "car", "uri": str(samples.carphone), "pace_fps": 15})
    assert source.name == "car" and board.names() == ["street", "car"]
    car = board.source("car")
    assert car["host"] == "gpu0" and car["live"] is False and car["state"] in ("starting",
                                                                                "running")
    with pytest.raises(SourceConflict, match="is in use"):
        board.add({"name": "car", "uri": str(samples.carphone)})
    wait_for(lambda: board.source("car")["frames"] >= 10, "10 frames of the car", 30)
    answer = board.remove("car", 30)
    assert answer["name"] == "car" and answer["state"] == "removed"
    lines = (tmp_path / "car.partial.jsonl").read_text().splitlines()
    assert answer["outputs"] == [str(tmp_path / "car.partial.jsonl")]
    assert answer["frames"] == len(lines) >= 10
    for _ in range(5):  # reports keep coming: it does not come back
        time.sleep(0.1)
        assert board.names() == ["street"] and board.source("car") is None
    with pytest.raises(SourceConflict, match="no source named 'car'"):
        board.remove("car", 1)
    assert board.source("street")["state"] == "running"


def test_a_removal_that_takes_longer_is_removing_then_leaves(local, samples) -> None:
    board, graph = local
    board.add({"name": "car", "uri": str(samples.carphone), "pace_fps": 15})
    answer = board.remove("car", 0)  # no wait at all: answered before the outputs are final
    assert answer == {"name": "car", "state": "removing"}
    assert board.state("car") in ("removing", None)
    wait_for(lambda: board.source("car") is None, "the car to leave once final", 20)
    assert graph.source_done("car") and board.names() == ["street"]


def test_a_stream_of_a_source_that_is_removed_ends(local, samples) -> None:
    board, graph = local
    config = parse_config(pipeline_config(samples, Path("."), [camera("street", samples.bikes)],
                                          runtime={"http": {"port": 0}}))
    server = HttpServer(config.runtime.http, board, config)
    port = server.start()
    board.add({"name": "car", "uri": str(samples.carphone), "pace_fps": 15, "live": True})
    parts, removing_at = 0, 0.0
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client, \
                client.stream("GET", "/api/sources/car/stream.mjpg") as stream:
            for chunk in stream.iter_bytes():
                parts += chunk.count(b"--frame\r\n")
                if parts >= 2 and not removing_at:  # streaming: now remove it (a DELETE)
                    removing_at = time.monotonic()
                    threading.Thread(target=board.remove, args=("car", 30)).start()
        assert time.monotonic() - removing_at < 10, "the stream did not end with its source"
        assert board.source("car") is None
    finally:
        server.close()


# -- the merging rules, step by step -------------------------------------------------------------
def report(host: str, *sources: dict, ready: bool = True, pictures: dict | None = None,
           reasons: tuple[str, ...] = ()) -> ViewReport:
    return ViewReport(host, ready, {s["name"]: s for s in sources}, pictures or {},
                      list(reasons))


def test_a_frames_age_counts_from_when_its_report_was_made_not_when_it_came() -> None:
    """A report that waited 2 s in the pipe (the supervisor busy restarting the engine):
    its frame is at least 2 s older than the report says (counted from its arrival alone,
    the failover benchmark took a frame captured before a kill for one after it)."""
    board = SourceBoard(None, None, preview_fps=5, order=["a"])
    board.update(replace(report("h0", {**shown("a"), "last_frame_age_s": 0.05}),
                         made_at=time.time() - 2.0))
    assert 2.05 <= board.source("a")["last_frame_age_s"] < 2.5
    board.update(replace(report("h0", {**shown("a"), "last_frame_age_s": 0.05}),
                         made_at=time.time()))
    assert 0.05 <= board.source("a")["last_frame_age_s"] < 0.5
    board.update(report("h0", {**shown("a"), "last_frame_age_s": 0.05}))  # made_at unknown
    assert 0.05 <= board.source("a")["last_frame_age_s"] < 0.5


def test_health_is_starting_until_every_host_is_ready_and_names_hosts_when_several() -> None:
    board = SourceBoard(None, None, preview_fps=5, order=["a", "b"])
    assert board.health() == {"status": "starting", "reasons": ["no pipeline has reported yet"],
                              "sources": {}, "hosts": {}, "engines": {}}
    board.update(report("h0", shown("a"), ready=False))
    health = board.health()
    assert (health["status"], health["reasons"], health["sources"]) == (
        "starting", ["the model is warming up"], {"a": "starting"})
    board.update(report("h0", shown("a")))
    assert board.health()["status"] == "ok"
    board.update(report("h1", shown("b", "stalled"), ready=False))
    assert board.health()["status"] == "starting"
    board.update(report("h1", shown("b", "stalled"), reasons=("source b: no frame for 12 s",)))
    health = board.health()
    assert (health["status"], health["reasons"], health["sources"]) == (
        "degraded", ["h1: source b: no frame for 12 s"], {"a": "running", "b": "stalled"})
    with pytest.raises(RuntimeError, match="cannot add sources"):
        board.add({"name": "c", "uri": "rtsp://cam/c"})


def test_a_source_placed_on_a_host_that_has_not_reported_is_listed_and_the_run_starting(
        ) -> None:
    """A worker slow to start (9 s once in CI): its placed sources are listed as starting
    on it from the placement, and health says starting until it reports, not ok."""
    board = SourceBoard(None, None, preview_fps=5, order=["a", "b"])
    board.added(source_config("a"), "h0")
    board.added(source_config("b"), "h1")
    board.update(report("h0", shown("a")))
    assert board.names() == ["a", "b"]
    assert (board.source("b")["state"], board.source("b")["host"]) == ("starting", "h1")
    health = board.health()
    assert (health["status"], health["reasons"], health["sources"]) == (
        "starting", ["host h1 has not reported yet"], {"a": "running", "b": "starting"})
    board.update(report("h1", shown("b")))
    assert board.health()["status"] == "ok"


def test_a_report_made_before_a_forget_does_not_bring_the_source_back() -> None:
    board = SourceBoard(None, None, preview_fps=5)
    board.update(report("h0", shown("a"), shown("b")))
    old = report("h0", shown("a"), shown("b", "removing"))
    board.forget("b")
    board.update(old)  # made before the host forgot it
    assert board.names() == ["a"]
    board.update(report("h0", shown("a")))
    board.update(report("h0", shown("a"), shown("b", "starting")))  # a new b, first reported
    assert board.names() == ["a", "b"]


def test_a_source_its_host_no_longer_reports_has_left_unless_pending() -> None:
    config = source_config("c", "rtsp://u:pw@cam/c")
    board = SourceBoard(None, None, preview_fps=5, order=["a", "b"])
    board.update(report("h0", shown("b"), shown("a")))
    assert board.names() == ["a", "b"]  # config order, whatever the host's
    board.added(config, "h1")
    assert board.names() == ["a", "b", "c"]
    c = board.source("c")
    assert (c["state"], c["host"], c["uri"]) == ("starting", "h1", "rtsp://***@cam/c")
    board.update(report("h1"))  # made before it took c: c still pending
    board.update(report("h0", shown("a")))  # b's outputs are final: it left
    assert board.names() == ["a", "c"]
    board.update(report("h1", shown("c", frames=3)))
    assert board.source("c")["frames"] == 3


def test_a_moved_source_is_shown_from_its_new_host_only_and_its_pictures_keep_rising() -> None:
    board = SourceBoard(None, None, preview_fps=5, order=["a", "b"])
    board.update(report("h0", shown("a", frames=50), shown("b", "ended", 9),
                        pictures={"a": (7, b"jpeg-h0-7")}))
    assert board.picture("a") == (1, b"jpeg-h0-7")  # numbered here
    board.host_gone("h0")
    assert board.source("a")["state"] == "reconnecting" and board.state("b") == "ended"
    moved = source_config("a")
    board.added(moved, "h1")
    a = board.source("a")
    assert (a["state"], a["host"], a["frames"]) == ("starting", "h1", 50)  # last counters
    board.added(moved, "h1")  # told again (placed, then its host's answer): counted once
    assert board.source("a")["frames"] == 50
    board.update(report("h1", shown("a", frames=2), pictures={"a": (1, b"jpeg-h1-1")}))
    board.update(report("h0", shown("a", "removing", 51), pictures={"a": (8, b"old")}))
    # its frames count on over both hosts (they once fell back to the new host's 2)
    assert (board.source("a")["host"], board.source("a")["frames"]) == ("h1", 52)
    assert board.picture("a") == (2, b"jpeg-h1-1")
    # h0 came back without b, which had ended there: still shown, ended, until removed
    assert board.names() == ["a", "b"] and board.state("b") == "ended"
    board.forget("b")
    assert board.names() == ["a"]


def test_a_source_added_under_the_name_of_one_that_ended_on_a_host_now_gone_starts_afresh():
    """An ended source of a dead host is never moved: a source placed under its name is a
    new one (added again), shown without the earlier one's counters, age or picture."""
    board = SourceBoard(None, None, preview_fps=5, order=["a"])
    board.update(report("h0", {**shown("a", "ended", 250), "last_frame_age_s": 9.5},
                        pictures={"a": (3, b"old")}))
    board.host_gone("h0")
    board.added(source_config("a"), "h1")
    a = board.source("a")
    assert (a["state"], a["host"], a["frames"], a["last_frame_age_s"]) == (
        "starting", "h1", 0, None)
    assert board.picture("a") is None
    board.added(source_config("a"), "h1")  # told again (placed, then its host's answer)
    board.update(report("h1", {**shown("a", frames=2), "last_frame_age_s": 0.1}))
    a = board.source("a")
    assert (a["state"], a["host"], a["frames"]) == ("running", "h1", 2)
    assert a["last_frame_age_s"] < 1.0


def test_pictures_are_wanted_while_watched_or_for_a_while_after_a_snapshot(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(board_module, "WANT_WINDOW_S", 0.2)
    board = SourceBoard(None, None, preview_fps=5)
    board.update(report("h0", shown("a"), shown("b")))
    board.update(report("h1", shown("c")))
    assert board.wanted("h0") == [] and not board.watched("a")
    board.request("a")
    with board.watching("c"), board.watching("c"):
        assert (board.wanted("h0"), board.wanted("h1")) == (["a"], ["c"])
        assert board.viewers("c") == 2 and board.source("c")["viewers"] == 2
    time.sleep(0.25)
    assert (board.wanted("h0"), board.wanted("h1")) == ([], [])
    assert board.source("c")["viewers"] == 0


def test_the_control_side_imports_no_stage_and_no_encoder() -> None:
    code = ("import sys, json, pipeline.app.http, pipeline.app.board; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('stages', 'cv2', 'kernels') or m in ('pipeline.app.view', 'pipeline.app.preview'))))")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, cwd=Path(__file__).resolve().parents[3])
    assert json.loads(found.stdout) == []
