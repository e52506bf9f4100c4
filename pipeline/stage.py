"""Base classes of the graph's nodes: a source produces frames, a stage transforms records.

A stage never knows which stage feeds it or which it feeds: the graph calls its hooks on its
own thread and puts what they return on the next queue. Hooks return iterables (usually a
list or a generator) of records; returning nothing drops the item.

A stage declares its ports in its class line, as the type parameters of ``Stage``:

```
class InferStage(Stage[FrameBatch, ModelOutputs]):    # consumes FrameBatch, produces ModelOutputs
    def process(self, item: FrameBatch) -> Iterable[ModelOutputs]: ...

class SinkStage(Stage[BatchDetections, None]):        # a sink: produces nothing
```

The graph reads them (``consumes``, ``produces``) to check the chain when it is built
(``pipeline.graph.Graph``). ``EndOfStream`` markers are not part of a port: every stage
passes them on (``end_of_stream``).
"""

from __future__ import annotations

import threading
import types
from collections.abc import Iterable, Iterator, Sized
from typing import Any, ClassVar, Generic, TypeVar, get_args, get_origin

from pipeline.metrics import LinkStatus
from pipeline.records import EndOfStream, Frame

In = TypeVar("In")
Out = TypeVar("Out")


class Stage(Generic[In, Out]):
    """A step of the graph, run on its own thread, that turns ``In`` records into ``Out``
    records.

    Class attributes (the stage's ports, set from the type parameters of ``Stage[In, Out]``
    in the class line; a stage may also assign them itself):
        consumes: the record type ``process`` takes (a class, or a union of classes such as
            ``FrameBatch | BatchDetections``).
        produces: the record type ``process``, ``on_idle`` and ``finish`` emit, or None for
            a sink (it emits nothing).
        A stage that declares nothing (``class S(Stage)``) consumes and produces ``object``,
        as the base class's pass-through ``process`` does: it accepts anything, and what
        follows it must accept anything too.

    Attributes:
        name: unique name, used in logs and metrics.
        poll_interval_s: when set, ``on_idle`` is called after this long without input
            (batching stages use it to run a partial batch).
        blocked_s: seconds the stage's hooks spent waiting rather than working (for a free
            buffer set, for the GPU); the stage adds to it, the graph reports it apart from
            work time.
    """

    consumes: ClassVar[type | types.UnionType] = object
    produces: ClassVar[type | types.UnionType | None] = object
    poll_interval_s: float | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # The ports of ``class S(Stage[In, Out])``, unless its body assigns them; a subclass
        # of a stage inherits its ports.
        for base in cls.__dict__.get("__orig_bases__", ()):
            if get_origin(base) is not Stage:
                continue
            consumes, produces = get_args(base)
            if "consumes" not in cls.__dict__ and not isinstance(consumes, TypeVar):
                cls.consumes = consumes
            if "produces" not in cls.__dict__ and not isinstance(produces, TypeVar):
                cls.produces = None if produces is type(None) else produces

    def __init__(self, name: str) -> None:
        self.name = name
        self.blocked_s = 0.0

    def open(self) -> None:
        """Allocate buffers and warm up; called once before any frame flows."""

    def process(self, item: In) -> Iterable[Out]:
        """Handle one record (a ``Frame`` before the batcher, a batch record after it) and
        return what goes downstream; by default the record passes unchanged."""
        return (item,)  # type: ignore[return-value]  # the pass-through of Stage[T, T]

    def end_of_stream(self, eos: EndOfStream) -> Iterable[Out | EndOfStream]:
        """A source ended; by default the marker travels on (a stage that holds records of
        that source returns them first)."""
        return (eos,)

    def on_idle(self) -> Iterable[Out]:
        """No input arrived for ``poll_interval_s`` seconds."""
        return ()

    def finish(self) -> Iterable[Out]:
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
            flight (the pipeline is behind), or read without decoding them to catch up with
            real time (``max_lag_ms``); they still count in the frame index.
        skipped: of ``dropped``, those read without decoding to catch up with real time.
    """

    live: bool = False
    expected_frames: int | None = None
    reconnects: int = 0
    dropped: int = 0
    skipped: int = 0
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


def frames_in(item: Frame | EndOfStream | Sized) -> int:
    """How many frames an item carries (for metrics): 1 for a ``Frame``, the batch size for
    a batch record, 0 for a marker."""
    if isinstance(item, Frame):
        return 1
    if isinstance(item, EndOfStream):
        return 0
    return len(item)
