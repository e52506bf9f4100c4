"""The test harness itself: the list source's markers, run_stage's order of hooks, wait_for's
failure."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterable
from typing import Any

import pytest

from pipeline.records import EndOfStream
from pipeline.stage import Stage
from tests.support.batches import make_frame
from tests.support.harness import ListSink, ListSource, SourceAborted, run_stage, wait_for


def indices(items: list) -> list:
    return [item.index if not isinstance(item, EndOfStream) else item for item in items]


def test_eof_ends_the_stream_and_a_later_run_goes_on_after_it() -> None:
    frames = [make_frame("cam", i, width=4, height=2) for i in range(5)]
    source = ListSource("cam", [*frames[:2], ListSource.EOF, *frames[2:]])
    assert indices(list(source.frames(threading.Event()))) == [0, 1, EndOfStream("cam", 2)]
    assert indices(list(source.frames(threading.Event()))) == [2, 3, 4, EndOfStream("cam", 3)]


def test_abort_raises_and_a_given_end_marker_is_passed_on_as_it_is() -> None:
    frames = [make_frame("cam", i, width=4, height=2) for i in range(3)]
    aborted = ListSource("cam", [frames[0], ListSource.ABORT, frames[1]]).frames(threading.Event())
    assert next(aborted).index == 0
    with pytest.raises(SourceAborted, match="source cam aborted at item 1"):
        next(aborted)
    failed = EndOfStream("cam", 1, error="lost")
    assert indices(list(ListSource("cam", [frames[0], failed, frames[1]]).frames(
        threading.Event()))) == [0, failed]


class Recorder(Stage):
    """Notes each hook it sees; doubles what it processes; raises on ``"bad"``."""

    def __init__(self) -> None:
        super().__init__("recorder")
        self.calls: list[Any] = []

    def open(self) -> None:
        self.calls.append("open")

    def process(self, item: Any) -> Iterable[Any]:
        if item == "bad":
            raise ValueError("bad item")
        self.calls.append(item)
        return (item, item)

    def end_of_stream(self, eos: EndOfStream) -> Iterable[Any]:
        self.calls.append("eos")
        return (eos,)

    def finish(self) -> Iterable[Any]:
        self.calls.append("finish")
        return ("pending",)

    def close(self) -> None:
        self.calls.append("close")


def test_run_stage_calls_the_hooks_in_the_graph_s_order_and_closes_after_an_error() -> None:
    stage, eos = Recorder(), EndOfStream("cam", 2)
    assert run_stage(stage, [1, 2, eos]) == [1, 1, 2, 2, eos, "pending"]
    assert stage.calls == ["open", 1, 2, "eos", "finish", "close"]
    stage = Recorder()
    assert run_stage(stage, [1], finish=False) == [1, 1]
    assert stage.calls == ["open", 1, "close"]
    stage = Recorder()
    with pytest.raises(ValueError, match="bad item"):
        run_stage(stage, [1, "bad", 2])
    assert stage.calls == ["open", 1, "close"]


def test_list_sink_keeps_items_and_end_markers() -> None:
    seen: list[Any] = []
    sink, eos = ListSink("sink", on_item=seen.append), EndOfStream("cam", 1)
    assert run_stage(sink, ["part", eos]) == []
    assert (sink.items, sink.ends, seen, sink.closed) == (["part", eos], [eos], ["part"], True)


def test_wait_for_fails_naming_what_it_waited_for_and_the_process_that_exited() -> None:
    with pytest.raises(pytest.fail.Exception, match="timed out after 0.1 s waiting for never"):
        wait_for(lambda: False, "never", 0.1)

    class Run:
        process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])

        def stderr(self) -> str:
            return "the log"

    Run.process.wait()
    with pytest.raises(pytest.fail.Exception, match=r"exited \(3\) before the first frame"):
        wait_for(lambda: False, "the first frame", 10, Run())
