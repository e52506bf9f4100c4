"""A list-backed source and sink, a stage runner and one polling helper: any stage testable
in a few lines, without a graph (after bytewax's ``TestingSource`` / ``TestingSink``).

    items ──> ListSource ──> Graph ──> ListSink.items
    items ──> run_stage(stage) ──> outputs        (open, process / end_of_stream, finish, close)

``ListSource`` takes two markers among its items: ``ListSource.EOF`` ends the stream there
(a later ``frames()`` call goes on after it, as a resumed run would), ``ListSource.ABORT``
raises out of the source (a source that breaks, not one that reports an error).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import pytest

from pipeline.records import EndOfStream, Frame
from pipeline.stage import SourceStage, Stage

_EXHAUSTED = object()


class SourceAborted(RuntimeError):
    """Raised by ``ListSource`` at its ``ABORT`` marker."""


class ListSource(SourceStage):
    """Yields ``items`` (``Frame`` or ``EndOfStream``) in order, then an ``EndOfStream`` with
    the number of frames yielded unless the items ended with one.

    Args:
        name: the source's name.
        items: frames, end markers and the ``EOF`` / ``ABORT`` markers; any iterable (a
            generator makes them as they are taken).
        delay_s: sleep before each frame (a paced source).
        live: report the source as a live camera (its queue lane drops the oldest frame).
    """

    EOF = object()
    ABORT = object()

    def __init__(self, name: str, items: Iterable[Frame | EndOfStream | object],
                 delay_s: float = 0.0, live: bool = False) -> None:
        super().__init__(name)
        self.items = iter(items)  # taken one at a time: a later frames() goes on from there
        self.delay_s, self.live = delay_s, live
        self.taken = 0  # items taken so far, markers included
        self.closed = False

    def frames(self, stop_reading: threading.Event) -> Iterator[Frame | EndOfStream]:
        produced = 0
        while not stop_reading.is_set():
            item = next(self.items, _EXHAUSTED)
            if item is _EXHAUSTED:
                break
            self.taken += 1
            if item is ListSource.ABORT:
                raise SourceAborted(f"source {self.name} aborted at item {self.taken - 1}")
            if item is ListSource.EOF:
                break
            if isinstance(item, EndOfStream):
                yield item
                return
            time.sleep(self.delay_s)
            yield item  # type: ignore[misc]
            produced += 1
        yield EndOfStream(self.name, produced)

    def close(self) -> None:
        self.closed = True


class ListSink(Stage[object, None]):
    """Keeps every item it receives (in ``items``; end markers also in ``ends``) and
    passes nothing on.

    Args:
        name: the sink's name.
        on_item: called with each item other than an end marker (to return its slots, say).
    """

    def __init__(self, name: str, on_item: Callable[[Any], None] | None = None) -> None:
        super().__init__(name)
        self.on_item = on_item
        self.items: list[Any] = []
        self.ends: list[EndOfStream] = []
        self.closed = False

    def process(self, item: Any) -> Iterable[Any]:
        self.items.append(item)
        if self.on_item is not None:
            self.on_item(item)
        return ()

    def end_of_stream(self, eos: EndOfStream) -> Iterable[Any]:
        self.items.append(eos)
        self.ends.append(eos)
        return ()

    def close(self) -> None:
        self.closed = True


def run_stage(stage: Stage, items: Sequence[Any], finish: bool = True) -> list[Any]:
    """Run ``stage`` over ``items`` as the graph's stage thread does and return its outputs in
    order: ``open``, then ``end_of_stream`` for an ``EndOfStream`` and ``process`` for
    anything else, then ``finish`` (left out with ``finish=False``: a run cut short), and
    ``close`` always, also after an error (which is raised)."""
    outputs: list[Any] = []
    stage.open()
    try:
        for item in items:
            hook = stage.end_of_stream if isinstance(item, EndOfStream) else stage.process
            outputs.extend(hook(item))
        if finish:
            outputs.extend(stage.finish())
    finally:
        stage.close()
    return outputs


class Running(Protocol):
    """A process under test that ``wait_for`` watches (``tests.e2e.conftest.Run``)."""

    process: Any  # subprocess.Popen

    def stderr(self) -> str: ...


def wait_for(condition: Callable[[], Any], what: str, timeout_s: float = 15.0,
             run: Running | None = None, interval_s: float = 0.02) -> None:
    """Poll ``condition`` until it is true; fail naming ``what`` after ``timeout_s``. With
    ``run``, fail at once when its process exits first, and show its log's tail."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if run is not None and run.process.poll() is not None:
            pytest.fail(f"the process exited ({run.process.returncode}) before {what}:\n"
                        f"{run.stderr()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}"
                        + (f":\n{run.stderr()[-3000:]}" if run is not None else ""))
        time.sleep(interval_s)
