"""Base classes of the graph's nodes: a source produces frames, a stage transforms items.

A stage never knows which stage feeds it or which it feeds: the graph calls its hooks on its
own thread and puts what they return on the next queue. Hooks return iterables (usually a
list or a generator) of items; returning nothing drops the item.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any

from pipeline.metrics import LinkStatus
from pipeline.records import EndOfStream, Frame


class Stage:
    """A step of the graph, run on its own thread.

    Attributes:
        name: unique name, used in logs and metrics.
        poll_interval_s: when set, ``on_idle`` is called after this long without input
            (batching stages use it to run a partial batch).
        blocked_s: seconds the stage's hooks spent waiting rather than working (for a free
            buffer set, for the GPU); the stage adds to it, the graph reports it apart from
            work time.
    """

    poll_interval_s: float | None = None

    def __init__(self, name: str) -> None:
        self.name = name
        self.blocked_s = 0.0

    def open(self) -> None:
        """Allocate buffers and warm up; called once before any frame flows."""

    def process(self, item: Any) -> Iterable[Any]:
        """Handle one item (a ``Frame`` before the batcher, a batch record after it) and
        return what goes downstream; subclasses declare the record types they take."""
        return (item,)

    def end_of_stream(self, eos: EndOfStream) -> Iterable[Any]:
        """A source ended; by default the marker travels on."""
        return (eos,)

    def on_idle(self) -> Iterable[Any]:
        """No input arrived for ``poll_interval_s`` seconds."""
        return ()

    def finish(self) -> Iterable[Any]:
        """Every producer is done: return what is still pending."""
        return ()

    def close(self) -> None:
        """Release resources; always called once the thread ends, also after an error."""


class SourceStage:
    """Produces the frames of one source on its own thread.

    Attributes:
        name: the source's unique name.
        live: True when the source is a live camera (its queue lane drops the oldest frame
            instead of blocking).
        expected_frames: frame count announced by a file's container, or None when unknown.
        reconnects: reconnection attempts so far (live streams).
        link: a live stream's connection as last reported (``LinkStatus``), or None.
        dropped: frames a live source decoded but discarded because every frame slot was in
            flight (the pipeline is behind); they still count in the frame index.
    """

    live: bool = False
    expected_frames: int | None = None
    reconnects: int = 0
    dropped: int = 0
    link: LinkStatus | None = None

    def __init__(self, name: str) -> None:
        self.name = name

    def frames(self, stop_reading: threading.Event) -> Iterator[Frame | EndOfStream]:
        """Yield the frames, then exactly one ``EndOfStream``; stop early when
        ``stop_reading`` is set. A failure of the source itself (unreadable, unreachable)
        ends the stream with ``EndOfStream(error=...)`` rather than raising."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the source; always called once its thread ends."""


def frames_in(item: Any) -> int:
    """How many frames an item carries (for metrics): 1 for a ``Frame``, the batch size for
    a batch record, 0 for a marker."""
    if isinstance(item, Frame):
        return 1
    if isinstance(item, EndOfStream):
        return 0
    return len(item)
