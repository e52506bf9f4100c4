"""The graph on list-backed sources and sinks: ordering, fan-in/out, errors, stop."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator

import numpy as np
import pytest
from structlog.testing import capture_logs

from pipeline.config import NmsConfig, parse_config
from pipeline.graph import Graph, PipelineError, SourceConflict
from pipeline.records import BatchDetections, EndOfStream, Frame, FrameBatch, ModelOutputs
from pipeline.slots import SlotRing
from pipeline.stage import Stage
from stages.analytics import AnalyticsStage
from stages.annotate import AnnotateStage
from stages.batcher import BatcherStage
from stages.filters import DetectionFilterStage
from stages.infer import InferStage
from stages.postprocess import PostprocessStage
from stages.sinks import SinkStage
from stages.tracking import TrackerStage
from tests.support.harness import ListSink, ListSource, wait_for

NAMES = ("a", "b", "cam", "clip", "file")


def make_frame(source: str, index: int, slot: int = -1, ring: SlotRing | None = None) -> Frame:
    image = ring.image(slot, 4, 2) if ring is not None else np.zeros((3, 4), np.uint8)
    return Frame(source=source, index=index, pts=index / 25, capture_time=time.time(),
                 width=4, height=2, image=image, slot=slot)


class TinySource(ListSource):
    """The harness's list source of ``count`` tiny frames (``fail_at``: it raises there
    instead). With a ring, each frame takes a slot first (waiting for one, as the decoder
    does)."""

    def __init__(self, name: str, count: int, delay_s: float = 0.0, live: bool = False,
                 fail_at: int | None = None, ring: SlotRing | None = None) -> None:
        super().__init__(name, self._make(count, fail_at), delay_s, live)
        self.count, self.ring = count, ring
        self._stop = threading.Event()

    def _make(self, count: int, fail_at: int | None) -> Iterator[Frame | object]:
        for i in range(count):
            if i == fail_at:
                yield ListSource.ABORT
            slot = -1
            if self.ring is not None:
                slot = self.ring.acquire(self._stop)
                if slot is None:
                    yield ListSource.EOF
                    return
            yield make_frame(self.name, i, slot, self.ring)

    def frames(self, stop_reading: threading.Event) -> Iterator[Frame | EndOfStream]:
        self._stop = stop_reading  # what a wait for a slot gives up on
        return super().frames(stop_reading)


def batcher(batch_size: int = 1) -> BatcherStage:
    return BatcherStage("batch", (8, 8), batch_size, 5.0, NAMES)


class Tag(Stage[FrameBatch | BatchDetections, BatchDetections]):
    """Notes the frames of each batch it handles; can raise in any hook. The first stage after
    the batcher (``detect=True``) turns each ``FrameBatch`` into ``BatchDetections`` with one
    box per frame whose x1 is the frame's index, and can return the batch's slots."""

    def __init__(self, name: str, fail_in: str | None = None, detect: bool = False,
                 release: SlotRing | None = None) -> None:
        super().__init__(name)
        self.fail_in, self.detect, self.release = fail_in, detect, release
        self.seen: list[tuple[str, int]] = []
        self.closed = False

    def _maybe_fail(self, hook: str) -> None:
        if self.fail_in == hook:
            raise ValueError(f"{self.name} failed in {hook}")

    def open(self) -> None:
        self._maybe_fail("open")

    def process(self, item: FrameBatch | BatchDetections) -> Iterable[BatchDetections]:
        self._maybe_fail("process")
        frames = item if self.detect else item.frames
        self.seen += [(frames.source_name(i), int(frames.index[i])) for i in range(len(frames))]
        if not self.detect:
            return (item,)
        if self.release is not None:
            self.release.release(frames.slot)
        boxes = [(np.array([[i, 0, i + 1, 1]], np.float32), np.float32([0.5]), np.int32([7]))
                 for i in frames.index.tolist()]
        return (BatchDetections.from_lists(frames, boxes),)

    def finish(self) -> Iterable[BatchDetections]:
        self._maybe_fail("finish")
        return ()

    def close(self) -> None:
        self.closed = True
        self._maybe_fail("close")


def chain_of(*tags: Tag, batch_size: int = 1) -> list[Stage]:
    """The batcher, then ``tags`` (the first of which makes the detections)."""
    tags[0].detect = True
    return [batcher(batch_size), *tags]


class PartSink(ListSink):
    """The harness's list sink, ``delay_s`` slow; with a ring it returns each part's slots
    (the last reader of the images)."""

    def __init__(self, name: str, delay_s: float = 0.0, ring: SlotRing | None = None) -> None:
        super().__init__(name, on_item=self._handled)
        self.delay_s, self.ring = delay_s, ring

    def _handled(self, part: BatchDetections) -> None:
        time.sleep(self.delay_s)
        if self.ring is not None:
            self.ring.release(part.frames.slot)

    @property
    def parts(self) -> list[BatchDetections]:
        return [item for item in self.items if not isinstance(item, EndOfStream)]

    @property
    def frames(self) -> list[int]:
        """The frame indices received, in order."""
        return [i for part in self.parts for i in part.frames.index.tolist()]

    @property
    def sources(self) -> set[str]:
        return {part.frames.source_name(i) for part in self.parts for i in range(len(part))}


def build(sources: list[TinySource], chain: list[Stage], queue_size: int = 2,
          sink_delay_s: float = 0.0) -> tuple[Graph, dict[str, PartSink]]:
    sinks = {s.name: PartSink(f"sink:{s.name}", sink_delay_s) for s in sources}
    return Graph(sources, chain, sinks, queue_size), sinks  # type: ignore[arg-type]


def test_every_frame_reaches_its_own_sink_in_order() -> None:
    sources = [TinySource("a", 30), TinySource("b", 17, delay_s=0.001)]
    one, two = Tag("one"), Tag("two")
    graph, sinks = build(sources, chain_of(one, two, batch_size=4))
    graph.run()
    for source in sources:
        sink = sinks[source.name]
        assert sink.frames == list(range(source.count)) and sink.sources == {source.name}
        # Detections follow their frames through the split by source.
        assert [x1 for part in sink.parts for x1 in part.xyxy[:, 0].tolist()] == sink.frames
        assert all(part.frames.buffers is None and len(part) <= 4 for part in sink.parts)
        assert [e.frames for e in sink.ends] == [source.count]
        assert sink.closed and source.closed
        everything = {(source.name, i) for i in range(source.count)}
        assert everything <= set(one.seen) and everything <= set(two.seen)
    assert len(one.seen) == len(two.seen) == 47
    assert graph.stage_metrics["batch"].frames == 47  # frames, one by one
    assert graph.stage_metrics["one"].frames == 47  # frames, in batches
    assert graph.source_metrics["b"].frames_out == 17


def test_live_source_drops_oldest_when_downstream_is_slow() -> None:
    sources = [TinySource("cam", 60, live=True)]
    graph, sinks = build(sources, chain_of(Tag("one")), queue_size=2, sink_delay_s=0.01)
    graph.run()
    received = sinks["cam"].frames
    assert graph.source_metrics["cam"].dropped > 0
    assert len(received) + graph.source_metrics["cam"].dropped == 60
    assert received == sorted(received) and received[-1] == 59  # newest kept, order kept



def test_live_drops_are_told_once_a_report_with_why() -> None:
    sources = [TinySource("cam", 60, live=True)]
    graph, _ = build(sources, chain_of(Tag("one")), queue_size=2, sink_delay_s=0.01)
    with capture_logs() as logs:
        graph.run()
    in_queues = graph.source_metrics["cam"].dropped
    assert in_queues > 0
    # the run is shorter than DROP_REPORT_S: its one line came as it ended, with them all
    (told,) = [e for e in logs if e["event"] == "live frames dropped"]
    assert told["log_level"] == "warning" and told["frames"] == in_queues
    # the slow sink's lane drops, and its backpressure may fill the source's lane: which
    # of the two drops depends on the threads' timing
    assert told.get("queue_full", 0) + told.get("sink_behind", 0) == in_queues
    assert told["sources"] == 1 and told["most"] == f"cam ({in_queues})"
    assert "host" not in told  # a graph of no host (the whole pipeline in one process)

    sources[0].dropped, sources[0].skipped = 7, 3  # as a decoder counts: 4 want a slot, 3 skipped
    graph.host = "worker2"
    with capture_logs() as logs:
        graph.report_drops(5.0)
        graph.report_drops(5.0)  # nothing new since: no line
    (told,) = [e for e in logs if e["event"] == "live frames dropped"]
    assert told["frames"] == 7 and told["seconds"] == 5.0 and told["host"] == "worker2"
    assert (told["no_frame_slot"], told["behind_real_time"], told["most"]) == (4, 3, "cam (7)")
    assert "sink_behind" not in told and "queue_full" not in told


def test_file_source_never_drops() -> None:
    sources = [TinySource("file", 40)]
    graph, sinks = build(sources, chain_of(Tag("one")), queue_size=1, sink_delay_s=0.002)
    graph.run()
    assert sinks["file"].frames == list(range(40))
    assert graph.source_metrics["file"].dropped == 0


@pytest.mark.parametrize("hook", ["process", "finish", "close"])
@pytest.mark.parametrize("position", [0, 1])
def test_exception_in_any_stage_stops_the_graph(hook: str, position: int) -> None:
    tags = [Tag("one"), Tag("two")]
    tags[position].fail_in = hook
    chain = chain_of(*tags, batch_size=2)
    sources = [TinySource("a", 500, delay_s=0.0), TinySource("b", 500)]
    graph, sinks = build(sources, chain)
    started = time.monotonic()
    with pytest.raises(PipelineError, match=f"{tags[position].name}: ValueError: .* in {hook}"):
        graph.run()
    assert time.monotonic() - started < 5
    assert all(sink.closed for sink in sinks.values())
    assert all(tag.closed for tag in tags)


@pytest.mark.parametrize("at_sink", [False, True], ids=["postprocess-releases", "sink-releases"])
def test_dropped_live_frames_and_parts_give_their_slots_back(at_sink: bool) -> None:
    ring = SlotRing(6, 12)
    cam = TinySource("cam", 200, live=True, ring=ring)
    chain = chain_of(Tag("one", release=None if at_sink else ring), batch_size=2)
    sinks = {"cam": PartSink("sink:cam", delay_s=0.005, ring=ring if at_sink else None)}
    graph = Graph([cam], chain, sinks, 2, ring=ring, release_at_sink=at_sink)  # type: ignore[list-item]
    graph.run()
    metrics = graph.source_metrics["cam"]
    assert metrics.dropped > 0 and metrics.frames_out + metrics.dropped == 200
    assert sinks["cam"].frames == sorted(sinks["cam"].frames)
    assert ring.free_slots() == 6  # every slot came back: dropped, processed or written


def test_a_stage_waiting_for_room_downstream_reports_it_as_blocked_not_work() -> None:
    graph, _ = build([TinySource("file", 30)], chain_of(Tag("one")), queue_size=1,
                     sink_delay_s=0.01)
    graph.run()
    one = graph.stage_metrics["one"]
    assert one.frames == 30 and one.calls == 30
    assert one.blocked_s > 0.1 and one.work_s < one.blocked_s / 2  # waits for the sink
    sink = graph.stage_metrics["sink:file"]
    assert sink.work_s > 0.25 and sink.blocked_s < 0.05


def test_exception_when_opening_a_stage() -> None:
    tags = [Tag("one"), Tag("two", fail_in="open")]
    graph, _ = build([TinySource("a", 3)], chain_of(*tags))
    with pytest.raises(PipelineError, match="stage two failed to start"):
        graph.run()
    assert tags[0].closed


def test_exception_in_a_source_stops_the_graph() -> None:
    graph, _ = build([TinySource("a", 1000, fail_at=5), TinySource("b", 1000, delay_s=0.001)],
                     chain_of(Tag("one")))
    with pytest.raises(PipelineError, match="a: SourceAborted: source a aborted at item 5"):
        graph.run()


def test_exception_in_a_sink_stops_the_graph() -> None:
    class FailingSink(PartSink):
        def process(self, item: BatchDetections) -> Iterable[BatchDetections]:
            raise OSError("disk full")

    sources = [TinySource("a", 200)]
    graph = Graph(sources, chain_of(Tag("one")), {"a": FailingSink("sink:a")}, 2)
    with pytest.raises(PipelineError, match="sink:a: OSError: disk full"):
        graph.run()


def test_request_stop_drains_and_ends_every_stream() -> None:
    sources = [TinySource("a", 10_000, delay_s=0.001), TinySource("b", 10_000, delay_s=0.001)]
    graph, sinks = build(sources, chain_of(Tag("one"), batch_size=3))
    threading.Timer(0.2, graph.request_stop).start()
    graph.run()
    for name, sink in sinks.items():
        count = len(sink.frames)
        assert 0 < count < 10_000
        assert sink.frames == list(range(count))
        assert [e.frames for e in sink.ends] == [count], name


def test_abort_stops_quickly_even_with_full_queues() -> None:
    sources = [TinySource("a", 100_000)]
    graph, sinks = build(sources, chain_of(Tag("one")), queue_size=1, sink_delay_s=0.05)
    threading.Timer(0.2, graph.abort).start()
    started = time.monotonic()
    graph.run()
    assert time.monotonic() - started < 3
    assert sinks["a"].closed and not sinks["a"].ends


def test_slow_sink_of_a_live_source_never_slows_a_file_source() -> None:
    cam, clip = TinySource("cam", 10_000, delay_s=0.001, live=True), TinySource("clip", 100)
    sinks = {"cam": PartSink("sink:cam", delay_s=0.02), "clip": PartSink("sink:clip")}
    graph = Graph([cam, clip], chain_of(Tag("one")), sinks, 2,  # type: ignore[arg-type]
                  stop_when="files_ended")
    started = time.monotonic()
    graph.run()  # ends when the file is done: the live source is stopped then
    assert time.monotonic() - started < 2.0  # 100 frames, not paced by the 20 ms/frame sink
    assert sinks["clip"].frames == list(range(100))
    assert graph.source_metrics["cam"].dropped > 0
    assert [e.error for e in sinks["cam"].ends] == [None]  # stopped cleanly, outputs final


def test_live_latency_is_bounded_by_queue_size_times_sink_time() -> None:
    queue_size, sink_s = 3, 0.02
    cam = TinySource("cam", 300, delay_s=0.002, live=True)  # 500 fps into a 50 fps sink
    cam.reconnects = 2  # type: ignore[attr-defined]
    graph, sinks = build([cam], chain_of(Tag("one")), queue_size=queue_size,
                         sink_delay_s=sink_s)
    graph.run()
    metrics = graph.source_metrics["cam"]
    # A frame waits for at most queue_size frames ahead of it in the sink's lane plus the one
    # being written, then is written itself; one more frame time covers timer jitter.
    assert metrics.latency_percentile(99) / 1000 < (queue_size + 2) * sink_s
    assert metrics.dropped > 0 and metrics.frames_out + metrics.dropped == 300
    assert metrics.reconnects == 2 and metrics.summary(1.0)["reconnects"] == 2


def test_abort_does_not_wait_for_a_source_blocked_in_io() -> None:
    class StuckSource(TinySource):
        def frames(self, stop_reading: threading.Event) -> Iterator[Frame | EndOfStream]:
            yield make_frame(self.name, 0)
            time.sleep(5)  # a read that ignores every stop request until it times out
            yield EndOfStream(self.name, 1)

    graph, _ = build([StuckSource("cam", 1, live=True)], chain_of(Tag("one")))
    threading.Timer(0.2, graph.abort).start()
    started = time.monotonic()
    graph.run()
    assert time.monotonic() - started < 2.5


def test_long_runs_report_source_stats_periodically(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pipeline.graph.REPORT_INTERVAL_S", 0.1)
    graph, _ = build([TinySource("cam", 40, delay_s=0.01, live=True)], chain_of(Tag("one")))
    with capture_logs() as logs:
        graph.run()
    stats = [e for e in logs if e["event"] == "source stats"]
    assert len(stats) >= 2 and stats[-1]["source"] == "cam" and stats[-1]["frames"] > 0
    assert {"dropped", "reconnects", "latency_p99_ms", "fps"} <= set(stats[-1])


def run_in_thread(graph: Graph) -> threading.Thread:
    thread = threading.Thread(target=graph.run, daemon=True)
    thread.start()
    return thread


def test_by_default_cameras_keep_running_after_the_files_ended() -> None:
    """stop_when all_ended: the file's outputs are final when it ends; the camera goes on
    until the run is stopped."""
    cam, clip = TinySource("cam", 100_000, delay_s=0.002, live=True), TinySource("clip", 20)
    sinks = {"cam": PartSink("sink:cam"), "clip": PartSink("sink:clip")}
    graph = Graph([cam, clip], chain_of(Tag("one")), sinks, 2)  # type: ignore[arg-type]
    thread = run_in_thread(graph)
    wait_for(lambda: graph.source_done("clip"), "the clip to end")
    assert graph.source_done("clip") and sinks["clip"].closed  # finalised as it ended
    assert sinks["clip"].frames == list(range(20))
    time.sleep(0.3)
    assert thread.is_alive() and not sinks["cam"].closed
    graph.request_stop()
    thread.join(10)
    assert not thread.is_alive() and [e.error for e in sinks["cam"].ends] == [None]


def test_stop_when_never_runs_on_with_no_source_left_and_takes_new_ones() -> None:
    clip = TinySource("clip", 5)
    sinks = {"clip": PartSink("sink:clip")}
    graph = Graph([clip], chain_of(Tag("one")), sinks, 2,  # type: ignore[arg-type]
                  stop_when="never")
    thread = run_in_thread(graph)
    wait_for(lambda: graph.source_done("clip"), "the clip to end")
    time.sleep(0.3)
    assert thread.is_alive()  # every source ended, and the run goes on
    late, late_sink = TinySource("late", 7, delay_s=0.1), PartSink("sink:late")
    graph.chain[0].add_source("late")  # the batcher numbers it (pipeline.app.control does this)
    graph.add_source(late, late_sink)
    with pytest.raises(SourceConflict, match="'late' is in use"):  # running
        graph.add_source(TinySource("late", 1), PartSink("sink:late2"))
    # An ended source's name may be used again once its outputs are final.
    again, again_sink = TinySource("clip", 3), PartSink("sink:clip2")
    graph.chain[0].add_source("clip")
    graph.add_source(again, again_sink)
    wait_for(lambda: graph.source_done("late") and graph.source_done("clip"),
             "the late source and the clip added again to end")
    assert late_sink.frames == list(range(7)) and late_sink.closed
    assert again_sink.frames == list(range(3)) and again_sink.closed
    assert sinks["clip"].frames == list(range(5))
    assert [s.name for s in graph.sources] == ["late", "clip"]
    graph.request_stop()
    thread.join(10)
    assert not thread.is_alive()
    with pytest.raises(SourceConflict, match="ending"):
        graph.add_source(TinySource("after", 1), PartSink("sink:after"))


def test_a_source_s_threads_are_shown_once_started_so_a_starting_sink_is_not_done(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A thread has its ident before it is alive: shown then, a starting sink thread read as
    # one that ended (source_done), and its source was placed again (a flaky CI failure).
    sources = [TinySource("a", 3), TinySource("b", 3)]
    graph, _ = build(sources, chain_of(Tag("one")))
    shown_at_start = []
    start = threading.Thread.start

    def checked_start(thread: threading.Thread) -> None:
        shown = [*graph._sink_threads.values(), *graph._source_threads.values()]
        shown_at_start.append(any(t is thread for t in shown))
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", checked_start)
    graph.run()
    assert len(shown_at_start) >= 4 and not any(shown_at_start)
    assert graph.source_done("a") and graph.source_done("b")


def test_a_removed_source_ends_cleanly_while_another_runs() -> None:
    cam, clip = TinySource("cam", 100_000, delay_s=0.002, live=True), TinySource(
        "clip", 100_000, delay_s=0.002)
    sinks = {"cam": PartSink("sink:cam"), "clip": PartSink("sink:clip")}
    graph = Graph([cam, clip], chain_of(Tag("one")), sinks, 2)  # type: ignore[arg-type]
    thread = run_in_thread(graph)
    time.sleep(0.3)
    graph.remove_source("clip")
    wait_for(lambda: graph.source_done("clip"), "the clip to end")
    count = len(sinks["clip"].frames)
    assert 0 < count < 100_000 and sinks["clip"].frames == list(range(count))
    assert [e.frames for e in sinks["clip"].ends] == [count]
    with pytest.raises(SourceConflict, match="no running source"):
        graph.remove_source("clip")
    before = len(sinks["cam"].frames)
    time.sleep(0.2)
    assert len(sinks["cam"].frames) > before and thread.is_alive()
    graph.request_stop()
    thread.join(10)
    assert not thread.is_alive()


class FrameSink(Stage[Frame, None]):
    """A sink of single frames: wired after a chain, it takes the wrong record."""


# (chain, sink, the one-line message)
MISWIRED = [
    pytest.param(lambda: [Tag("one")], lambda: ListSink("sink:a"),
                 "stage 'one' (Tag) consumes FrameBatch | BatchDetections, but every source "
                 "produces Frame", id="no batcher"),
    pytest.param(lambda: [batcher(), PostprocessStage("postprocess", NmsConfig())],
                 lambda: ListSink("sink:a"),
                 "stage 'postprocess' (PostprocessStage) consumes ModelOutputs, but stage "
                 "'batch' (BatcherStage) before it produces FrameBatch", id="no infer"),
    pytest.param(lambda: [batcher(), DetectionFilterStage("filter", {})],
                 lambda: ListSink("sink:a"),
                 "stage 'filter' (DetectionFilterStage) consumes BatchDetections, but stage "
                 "'batch' (BatcherStage) before it produces FrameBatch", id="no detector"),
    pytest.param(lambda: chain_of(Tag("one"), ListSink("early"), Tag("two")),
                 lambda: ListSink("sink:a"),
                 "stage 'two' (Tag) consumes FrameBatch | BatchDetections, but stage 'early' "
                 "(ListSink) before it produces nothing", id="a sink inside"),
    pytest.param(lambda: [batcher()], lambda: ListSink("sink:a"),
                 "the last stage 'batch' (BatcherStage) produces FrameBatch, but the graph "
                 "splits BatchDetections by source for the sinks", id="ends with batches"),
    pytest.param(lambda: chain_of(Tag("one")), lambda: FrameSink("sink:a"),
                 "stage 'sink:a' (FrameSink) consumes Frame, but the last stage 'one' (Tag) "
                 "produces BatchDetections", id="a sink of frames"),
]


@pytest.mark.parametrize(("chain", "sink", "message"), MISWIRED)
def test_a_miswired_graph_is_refused_naming_both_stages_and_types(chain, sink, message) -> None:
    with pytest.raises(ValueError) as refused:
        Graph([ListSource("a", [])], chain(), {"a": sink()}, 2)
    assert str(refused.value) == message


def test_a_sink_added_later_is_checked_too() -> None:
    graph = Graph([], chain_of(Tag("one")), {}, 2)
    with pytest.raises(ValueError, match=r"^stage 'sink:a' \(FrameSink\) consumes Frame, but "):
        graph.add_source(ListSource("a", []), FrameSink("sink:a"))
    assert graph.sources == []


@pytest.mark.parametrize(("stage", "consumes", "produces"), [
    (BatcherStage, Frame, FrameBatch),
    (InferStage, FrameBatch, ModelOutputs),
    (PostprocessStage, ModelOutputs, BatchDetections),
    (DetectionFilterStage, BatchDetections, BatchDetections),
    (TrackerStage, BatchDetections, BatchDetections),
    (AnalyticsStage, BatchDetections, BatchDetections),
    (AnnotateStage, BatchDetections, BatchDetections),
    (SinkStage, BatchDetections, None),
])
def test_every_stage_declares_its_ports(stage, consumes, produces) -> None:
    assert (stage.consumes, stage.produces) == (consumes, produces)


def test_the_chain_the_app_builds_passes_the_check(samples, tmp_path) -> None:
    """Every optional stage (filter, tracker, analytics, annotate) and a source's sink, as
    ``build_graph`` wires them: built, not run."""
    from pipeline.app.build import build_graph
    from tests.e2e.conftest import pipeline_config

    config = parse_config(pipeline_config(
        samples, tmp_path,
        [{"name": "bikes", "uri": str(samples.bikes), "classes": ["person"],
          "tracker": "bytetrack",
          "analytics": [{"type": "line", "name": "middle", "start": [320, 0],
                         "end": [320, 272]}]}],
        output={"video": "{source}.mp4"}, runtime={"decode_workers": 0}))
    graph = build_graph(config)
    assert [type(stage) for stage in graph.chain] == [
        BatcherStage, InferStage, PostprocessStage, DetectionFilterStage, TrackerStage,
        AnalyticsStage, AnnotateStage]
    assert [type(sink) for sink in graph.sinks.values()] == [SinkStage]
