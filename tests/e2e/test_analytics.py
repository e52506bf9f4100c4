"""Tracking and analytics end to end on bikes.mp4 with the real model (CPU): track ids are
stable against a reference built here from the boxes alone, the events file agrees with the
final counts and the Prometheus metrics, frames the detector skips carry the tracks'
predictions, and the events reach MQTT and webhooks (real receivers on loopback)."""

from __future__ import annotations

import sys
import time
import types
from collections import Counter, defaultdict
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs

from pipeline.app.build import build_graph
from pipeline.app.prometheus import LatencyHistogram
from pipeline.config import parse_config
from stages.analytics import AnalyticsStage
from tests.e2e.conftest import pipeline_config, records
from tests.support.batches import batch_detections, make_frame
from tests.support.harness import wait_for
from tests.support.metrics import HostMetrics, value
from tests.support.webhook_receiver import WebhookReceiver

WIDTH, HEIGHT = 640, 272  # bikes.mp4
ANALYTICS = [
    {"type": "line", "name": "middle", "start": [320, 0], "end": [320, HEIGHT]},
    {"type": "zone", "name": "right", "polygon": [[320, 0], [WIDTH, 0], [WIDTH, HEIGHT],
                                                  [320, HEIGHT]]},
    {"type": "zone", "name": "people", "polygon": [[0, 0], [WIDTH, 0], [WIDTH, HEIGHT],
                                                   [0, HEIGHT]], "classes": ["person"]},
]
TRAILS = 20  # output.trails
CLIP = {"pre_s": 1.0, "post_s": 1.5}
MAIN_OBJECT_FRAMES = 20  # a chain this long (0.8 s) is one of the clip's main objects
STABLE_SHARE = 0.9


def iou(a: list[float], b: list[float]) -> float:
    x1, y1, x2, y2 = max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])
    inter = max(0.0, x2 - x1) * max(0.0, y2 - y1)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def iou_chains(lines: list[dict]) -> list[list[dict]]:
    """Detections chained frame to frame: each joins the chain of the detection of the same
    class in the previous frame that overlaps it most, with IoU > 0.5 (each at most once)."""
    chains: list[list[dict]] = []
    previous: list[tuple[dict, int]] = []  # (detection, its chain) in the previous frame
    for line in lines:
        current, taken = [], set()
        for detection in line["detections"]:
            best, best_iou = None, 0.5
            for k, (before, _) in enumerate(previous):
                overlap = iou(before["xyxy"], detection["xyxy"])
                if k not in taken and before["class_id"] == detection["class_id"] \
                        and overlap > best_iou:
                    best, best_iou = k, overlap
            if best is None:
                chains.append([])
                chain = len(chains) - 1
            else:
                taken.add(best)
                chain = previous[best][1]
            chains[chain].append(detection)
            current.append((detection, chain))
        previous = current
    return chains


class FakePublisher:
    """Stands in for ``pipeline.app.mqtt.MqttPublisher`` (same interface), keeping what it gets."""

    made: list[FakePublisher] = []

    def __init__(self, config: Any, sources: list[str]) -> None:
        self.config, self.sources = config, sources
        self.calls: list[str] = []
        self.events: list[tuple[str, dict]] = []
        self.counts: list[tuple[str, dict]] = []
        FakePublisher.made.append(self)

    def start(self) -> None:
        self.calls.append("start")

    def publish_event(self, source: str, event: dict) -> None:
        self.events.append((source, event))

    def publish_counts(self, source: str, counts: dict) -> None:
        self.counts.append((source, counts))

    def close(self) -> None:
        self.calls.append("close")


@pytest.fixture(scope="module")
def analytics_run(samples, tmp_path_factory) -> dict[str, Any]:
    """bikes.mp4 with tracking, a line and two zones, built and run in this process, its
    metrics served as a run serves them (``tests.support.metrics.HostMetrics``: the host's
    snapshot, with the latency fed per batch as the host feeds it, on a ``ClusterExporter``)
    and scraped once the run ended; ``output.mqtt`` goes to a ``FakePublisher``,
    ``output.webhooks`` to a real receiver on loopback (``WebhookReceiver``); the video is
    written, and each event's snapshot and clip (cut from it)."""
    out = tmp_path_factory.mktemp("analytics")
    receiver = WebhookReceiver().start()
    config = parse_config(pipeline_config(
        samples, out, [{"name": "bikes", "uri": str(samples.bikes), "tracker": "bytetrack",
                        "analytics": ANALYTICS}],
        inference={"batch_size": 4},
        output={"mqtt": {"host": "broker.invalid"}, "webhooks": [{"url": receiver.url}],
                "video": "{source}.mp4", "trails": TRAILS, "event_media": {"clip": CLIP}}))
    latency = LatencyHistogram()
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "pipeline.app.mqtt",
                      types.SimpleNamespace(MqttPublisher=FakePublisher))
        FakePublisher.made.clear()
        graph = build_graph(config, on_batch_done=lambda source, part: latency.observe(
            source, time.time() - np.asarray(part.frames.capture_time)))
    (publisher,) = FakePublisher.made
    with HostMetrics(graph, latency) as served:
        with capture_logs() as logs:
            graph.run()
        metrics = served.scrape()
    receiver.stop()
    (stage,) = [s for s in graph.chain if isinstance(s, AnalyticsStage)]
    logged = [entry["counts"] for entry in logs if entry["event"] == "analytics counts"]
    return {"records": records(out / "bikes.jsonl"), "video": out / "bikes.mp4",
            "events": records(out / "bikes.events.jsonl"),
            "counts": stage.counts()["bikes"], "logged": logged, "metrics": metrics,
            "publisher": publisher, "config": config, "webhook": receiver, "logs": logs,
            "out": out}


def test_main_objects_keep_one_track_id(analytics_run: dict[str, Any]) -> None:
    lines = analytics_run["records"]
    assert len(lines) == 250
    assert all("tracker_id" in d for line in lines for d in line["detections"])
    main = [chain for chain in iou_chains(lines) if len(chain) >= MAIN_OBJECT_FRAMES]
    assert len(main) >= 2, [len(c) for c in iou_chains(lines)]
    for chain in main:
        ids = Counter(d["tracker_id"] for d in chain if d["tracker_id"] >= 0)
        assert ids, chain[0]
        track_id, frames = ids.most_common(1)[0]
        assert frames >= STABLE_SHARE * len(chain), (chain[0]["class_name"], len(chain), ids)


def fold(events: list[dict]) -> dict[str, Any]:
    """The counts the events add up to, as ``AnalyticsCounts.to_json`` lays them out (only
    classes that have events)."""
    zones: dict = defaultdict(lambda: {"entered": Counter(), "exited": Counter()})
    lines: dict = defaultdict(lambda: {"in": Counter(), "out": Counter()})
    for event in events:
        cls = event["class_name"]
        if "zone" in event:
            zones[event["zone"]]["entered" if event["kind"] == "enter" else "exited"][cls] += 1
        else:
            lines[event["line"]]["in" if event["kind"] == "cross_in" else "out"][cls] += 1
    return {"zones": {name: {"inside": dict(k["entered"] - k["exited"]), "entered": dict(k["entered"]),
                             "exited": dict(k["exited"])} for name, k in zones.items()},
            "lines": {name: {d: dict(k[d]) for d in ("in", "out")} for name, k in lines.items()}}


def nonzero(counts: dict[str, Any]) -> dict[str, Any]:
    """``counts`` without its zeros (a region's configured classes start at 0)."""
    return {kind: {name: {what: {c: n for c, n in by_class.items() if n}
                          for what, by_class in region.items()}
                   for name, region in regions.items() if any(any(v.values()) for v in region.values())}
            for kind, regions in counts.items()}


def test_events_agree_with_the_final_counts_and_the_metrics(analytics_run: dict[str, Any]) -> None:
    events, counts = analytics_run["events"], analytics_run["counts"]
    kinds = Counter(e["kind"] for e in events)
    assert kinds["enter"] and kinds["exit"] and kinds["cross_in"] + kinds["cross_out"], kinds
    assert nonzero(fold(events)) == nonzero(counts)
    assert analytics_run["logged"] == [counts]  # logged when the source ended
    metrics = analytics_run["metrics"]  # host pipeline0's samples (``value``)
    for name, region in counts["lines"].items():
        for direction in ("in", "out"):
            for cls, n in region[direction].items():
                assert value(metrics, "pipeline_line_crossings_total", source="bikes", line=name,
                             direction=direction, **{"class": cls}) == n
    for name, region in counts["zones"].items():
        for cls in region["inside"]:
            labels = {"source": "bikes", "zone": name, "class": cls}
            assert value(metrics, "pipeline_zone_objects", **labels) == region["inside"][cls]
            for kind, key in (("enter", "entered"), ("exit", "exited")):
                assert value(metrics, "pipeline_zone_events_total", kind=kind, **labels) == \
                    region[key][cls]
    # Every frame reached the sink, each with its capture-to-sink latency.
    assert value(metrics, "pipeline_source_frames_total", source="bikes") == 250
    assert value(metrics, "pipeline_frame_latency_seconds_count", source="bikes") == 250


def test_events_match_the_frames_they_happened_on(analytics_run: dict[str, Any]) -> None:
    """Every event names a frame of the records, with its pts; an entry or crossing is the
    box of a detection of that frame with the event's track id; a track's entries into and
    exits from a zone alternate, entry first; a person-only zone sees only persons."""
    by_frame = {line["frame"]: line for line in analytics_run["records"]}
    events = analytics_run["events"]
    assert [e["frame"] for e in events] == sorted(e["frame"] for e in events)
    inside: dict[tuple[str, int], bool] = defaultdict(bool)
    for event in events:
        line = by_frame[event["frame"]]
        assert event["pts"] == line["pts"] and event["source"] == "bikes"
        if event["kind"] != "exit":
            assert any(d["tracker_id"] == event["tracker_id"] and d["xyxy"] == event["xyxy"]
                       for d in line["detections"]), event
        if "zone" in event:
            key = (event["zone"], event["tracker_id"])
            assert inside[key] == (event["kind"] == "exit"), event
            inside[key] = not inside[key]
            assert (event["dwell_s"] >= 0) == (event["kind"] == "exit") if "dwell_s" in event \
                else event["kind"] == "enter"
            if event["zone"] == "people":
                assert event["class_name"] == "person"


@pytest.mark.slow  # the detector over a whole video on the CPU
def test_skipped_frames_carry_the_tracks_predictions(samples, tmp_path: Path) -> None:
    """detect_every 3: each frame in between shows, at its predicted place, every track the
    detector had confirmed on the frame before (less those that left the picture)."""
    out = tmp_path / "out"
    config = parse_config(pipeline_config(
        samples, out, [{"name": "bikes", "uri": str(samples.bikes), "tracker": "bytetrack",
                        "detect_every": 3}], inference={"batch_size": 4}))
    build_graph(config).run()
    lines = records(out / "bikes.jsonl")
    assert len(lines) == 250
    last_detected: dict[int, list[float]] = {}
    same, overlapping, predicted = 0, 0, 0
    for line in lines:
        if line.get("detected", True):
            assert line["frame"] % 3 == 0
            last_detected = {d["tracker_id"]: d["xyxy"] for d in line["detections"]
                             if d["tracker_id"] >= 0}
            continue
        shown = {d["tracker_id"]: d["xyxy"] for d in line["detections"]}
        assert set(shown) <= set(last_detected), line["frame"]
        same += set(shown) == set(last_detected)
        for track_id, box in shown.items():
            predicted += 1
            overlapping += iou(box, last_detected[track_id]) > 0.5
    skipped = 250 - len(range(0, 250, 3))
    assert same >= 0.9 * skipped and predicted > 100
    assert overlapping >= 0.9 * predicted  # near where the object was a frame or two before


def test_mqtt_gets_every_event_and_the_counts(analytics_run: dict[str, Any]) -> None:
    """With ``output.mqtt``, the publisher (``pipeline.app.mqtt.MqttPublisher``'s interface) is
    made for the sources with analytics, started and closed with the run, and given every
    event of the events file and, last, the final counts."""
    publisher = analytics_run["publisher"]
    assert publisher.config is analytics_run["config"].output.mqtt
    assert publisher.sources == ["bikes"] and publisher.calls == ["start", "close"]
    assert publisher.events == [("bikes", event) for event in analytics_run["events"]]
    assert {source for source, _ in publisher.counts} == {"bikes"}
    assert publisher.counts[-1][1] == analytics_run["counts"]
    # Once at the start, then only after batches that had events (one per batch at most).
    assert 2 <= len(publisher.counts) <= 1 + len({e["frame"] for e in analytics_run["events"]})


@pytest.mark.slow  # a real MQTT broker, paced
def test_events_reach_a_real_broker_across_its_restart(samples, tmp_path: Path) -> None:
    """output.mqtt to a real mosquitto that is stopped for 3 s mid-run and started again: the
    pipeline loses no frame, and a subscriber receives every event of the events file, in
    order (a QoS 1 resend may repeat one: counted once), and the final counts, retained."""
    import json
    import threading

    from tests.pipeline.app.test_mqtt import Subscriber
    from tests.support.mosquitto import MosquittoBroker, require_mosquitto

    require_mosquitto()
    broker = MosquittoBroker(tmp_path / "broker")
    broker.start()
    subscriber = Subscriber(broker, client_id="analytics-test")
    try:
        out = tmp_path / "out"
        config = parse_config(pipeline_config(
            samples, out, [{"name": "bikes", "uri": str(samples.bikes), "tracker": "bytetrack",
                            "analytics": ANALYTICS, "pace_fps": 25}],
            inference={"batch_size": 4},
            output={"mqtt": {"host": "127.0.0.1", "port": broker.port}}))
        graph = build_graph(config)
        outage: list[float] = []

        def stop_and_start() -> None:
            time.sleep(3)
            broker.stop()
            outage.append(time.time())
            time.sleep(3)
            broker.start()
            outage.append(time.time())

        thread = threading.Thread(target=stop_and_start)
        thread.start()
        graph.run()
        thread.join()
        frames, events = records(out / "bikes.jsonl"), records(out / "bikes.events.jsonl")
        assert [r["frame"] for r in frames] == list(range(250))
        assert any(outage[0] <= e["capture_time"] <= outage[1] for e in events), \
            "no event happened while the broker was down"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            received = list(dict.fromkeys(subscriber.payloads("streamdet/bikes/events")))
            if len(received) >= len(events):
                break
            time.sleep(0.2)
        assert [json.loads(p) for p in received] == events
        (stage,) = [s for s in graph.chain if isinstance(s, AnalyticsStage)]
        assert json.loads(subscriber.last("streamdet/bikes/counts")) == stage.counts()["bikes"]
        # closed at the end: the broker has it (close() waits for its PUBACK); the
        # subscriber gets it a moment later
        wait_for(lambda: subscriber.last("streamdet/availability") == "offline",
                 "offline published at the end", 10)
    finally:
        subscriber.close()
        broker.kill()


def test_a_webhook_gets_every_event_once_as_its_events_file_line(
        analytics_run: dict[str, Any]) -> None:
    """With ``output.webhooks`` beside ``output.mqtt``: the receiver got one POST per line of
    the events file, byte for byte, in order, each with its own Idempotency-Key; the metrics
    and the run's summary line count them, and nothing failed."""
    events_file = analytics_run["config"].output_path("{source}.events.jsonl", "bikes")
    lines = events_file.read_bytes().splitlines()
    receiver = analytics_run["webhook"]
    assert [r.body for r in receiver.requests] == lines and len(lines) >= 3
    assert len({r.headers["idempotency-key"] for r in receiver.requests}) == len(lines)
    metrics = analytics_run["metrics"]
    url = receiver.url
    assert value(metrics, "pipeline_webhook_delivered_total", url=url) == len(lines)
    for name in ("failed_total", "rejected_total", "dropped_total", "waiting", "failing"):
        assert value(metrics, f"pipeline_webhook_{name}", url=url) == 0, name
    (summary,) = [e for e in analytics_run["logs"] if e["event"] == "webhook summary"]
    assert (summary["url"], summary["delivered"], summary["failed"], summary["dropped"],
            summary["unsent"]) == (url, len(lines), 0, 0, 0)


@pytest.mark.slow  # the detector over a whole video on the CPU, through run.py
def test_webhook_gets_every_event_across_a_3_s_outage_of_the_receiver(
        repo_root: Path, run_pipeline, tmp_path: Path) -> None:
    """``python run.py`` with configs/analytics.yaml (its default layout: the webhook is sent
    from the source worker process), the webhook receiver stopped for 3 s from its first
    event on and started again on the same port: the receiver got every line of the events
    file exactly once, in order, and the run's summary line says so, with the failed
    attempts of the outage. (A run that ends during the outage delivers the rest as it
    closes: the receiver is back within the flush time.)"""
    import yaml

    receiver = WebhookReceiver().start()
    config = yaml.safe_load((repo_root / "configs/analytics.yaml").read_text())
    out = tmp_path / "out"
    # no video and no event media (each tested with the analytics_run fixture): this test's
    # time goes to the webhook only
    config["output"].update(dir=str(out), video=None, event_media=None,
                            webhooks=[{"url": receiver.url}])
    config["runtime"] = {"log_format": "json", "progress": False}
    run = run_pipeline(config, tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not receiver.delivered and time.monotonic() < deadline:  # the run is under way
            time.sleep(0.05)
        receiver.stop()
        outage = [time.time()]
        time.sleep(3)
        outage.append(time.time())
        receiver.start()
        assert run.wait(60) == 0, run.stderr()[-3000:]
    finally:
        receiver.stop()
    events = records(out / "bikes.events.jsonl")
    lines = (out / "bikes.events.jsonl").read_bytes().splitlines()
    assert any(outage[0] <= e["capture_time"] <= outage[1] for e in events), \
        "no event happened while the receiver was down"
    assert [r.body for r in receiver.requests] == lines  # each once, in order
    (summary,) = run.events("webhook summary")
    assert (summary["delivered"], summary["dropped"], summary["rejected"], summary["unsent"]) \
        == (len(lines), 0, 0, 0)
    assert summary["failed"] >= 1


def test_the_video_shows_trails_and_box_labels_clear_of_line_and_zone_labels(
        samples, analytics_run: dict[str, Any]) -> None:
    """On the annotated video (output.trails: 20), along the path of the track that moved
    most, between its centres of the last frames and away from every box and label of the
    frame, the picture's colours differ from the source's (the trail); on frames 36 and 130 (where
    box labels sat over the line's label before), and on every other frame, each box label's
    place (as the annotate stage places it, from the frame's records) is clear of every
    zone and line label."""
    from pipeline.config import AnalyticsRegionConfig, SourceConfig
    from stages.analytics import AnalyticsCounts, Region
    from stages.annotate import draw_detections, overlaps, region_labels
    from tests.support import read_frames

    lines = analytics_run["records"]
    names = [line.strip() for line in samples.names.read_text().splitlines()]
    source = SourceConfig("bikes", str(samples.bikes))
    regions = [Region.from_config(f"a[{k}]", AnalyticsRegionConfig(**region), source, names,
                                  len(names)) for k, region in enumerate(ANALYTICS)]
    clear = [rect for _, rect, _ in region_labels(regions, AnalyticsCounts(regions, names),
                                                   WIDTH, HEIGHT)]
    image = np.zeros((HEIGHT * 3 // 2, WIDTH), np.uint8)
    placed_by_frame = {}
    for line in lines:
        detections = line["detections"]
        batch = batch_detections([(make_frame("bikes", line["frame"], image.copy()),
                                   [(*d["xyxy"], d["confidence"], d["class_id"])
                                    for d in detections])])
        batch = replace(batch, tracker_id=np.array([d["tracker_id"] for d in detections],
                                                   np.int64))
        placed = draw_detections(batch.frames.images[0], WIDTH, HEIGHT, batch[0], names, clear)
        assert not any(overlaps(rect, other, 0) for rect in placed for other in clear), line
        placed_by_frame[line["frame"]] = placed
    assert placed_by_frame[36] and placed_by_frame[130]
    # The trail: the track that moved most over TRAILS frames, on the last of them.
    paths: dict[int, dict[int, tuple[float, float]]] = defaultdict(dict)
    for line in lines:
        for d in line["detections"]:
            if d["tracker_id"] >= 0:
                x1, y1, x2, y2 = d["xyxy"]
                paths[d["tracker_id"]][line["frame"]] = ((x1 + x2) / 2, (y1 + y2) / 2)
    best = None
    for track_id, path in paths.items():
        for frame in path:
            recent = [path[f] for f in range(frame - 8, frame + 1) if f in path]
            if len(recent) == 9:
                moved = float(np.hypot(*np.subtract(recent[-1], recent[0])))
                if best is None or moved > best[0]:
                    best = (moved, track_id, frame)
    assert best is not None and best[0] > 40, best
    _, track_id, frame = best
    annotated = read_frames(analytics_run["video"], frame + 1)[frame].to_ndarray(format="rgb24")
    original = read_frames(samples.bikes, frame + 1)[frame].to_ndarray(format="rgb24")
    line = lines[frame]
    busy = [tuple(d["xyxy"]) for d in line["detections"]] + [tuple(r) for r in clear]
    busy += [tuple(r) for r in placed_by_frame[frame]]
    checked = 0
    path = paths[track_id]
    for f in range(frame - 6, frame):  # midpoints of the newest segments: nearly opaque
        if f not in path or f + 1 not in path:
            continue
        x, y = (int(round(v)) for v in np.add(path[f], path[f + 1]) / 2)
        if any(b[0] - 6 <= x <= b[2] + 6 and b[1] - 6 <= y <= b[3] + 6 for b in busy
               if not (b[0] + 6 < x < b[2] - 6 and b[1] + 6 < y < b[3] - 6)):
            continue  # near a box edge or a label: not the trail alone
        if any(overlaps((x - 2, y - 2, x + 2, y + 2), tuple(int(v) for v in r), 0)
               for r in clear + placed_by_frame[frame]):
            continue
        patch = np.s_[y - 1:y + 2, x - 1:x + 2]
        assert np.abs(annotated[patch].astype(int) - original[patch].astype(int)).max() > 25, \
            (track_id, frame, f, x, y)
        checked += 1
    assert checked >= 2, (track_id, frame)


def test_class_aware_tracking_keeps_each_id_to_one_class(analytics_run: dict[str, Any]) -> None:
    """The run's own detections (real, from bikes.mp4) tracked again with
    tracker_class_aware: every id has one class, where one tracker for all classes gives
    some id more than one (the clip's detector changes its mind: car, bus, person)."""
    from stages.tracking import TrackerSettings, TrackerStage

    lines = analytics_run["records"]
    mixed = defaultdict(set)
    for line in lines:
        for d in line["detections"]:
            if d["tracker_id"] >= 0:
                mixed[d["tracker_id"]].add(d["class_id"])
    assert any(len(classes) > 1 for classes in mixed.values()), mixed
    stage = TrackerStage("track", {"bikes": TrackerSettings(0.3, 1.0, class_aware=True)})
    classes: dict[int, set[int]] = defaultdict(set)
    for start in range(0, len(lines), 4):
        chunk = lines[start:start + 4]
        batch = batch_detections([(make_frame("bikes", line["frame"], width=WIDTH, height=HEIGHT,
                                              pts=line["pts"], rate=Fraction(25)),
                                   [(*d["xyxy"], d["confidence"], d["class_id"])
                                    for d in line["detections"]]) for line in chunk])
        (out,) = stage.process(batch)
        for track_id, cls in zip(out.tracker_id.tolist(), out.class_id.tolist()):
            if track_id >= 0:
                classes[track_id].add(cls)
    assert len(classes) >= 5 and all(len(c) == 1 for c in classes.values()), classes


def test_every_event_has_its_snapshot_and_its_clip(analytics_run: dict[str, Any]) -> None:
    """output.event_media with the video written: every event's record names a JPEG that
    shows its box highlighted (the pixels along the box's edges are the highlight's colour)
    and an MP4 cut from the recording (no second encoder) whose frames cover the event's
    frame from pre_s before to post_s after (within the file); the summary counts them."""
    import json

    import av
    import cv2

    from stages.event_media import HIGHLIGHT_BGR

    out, events = analytics_run["out"], analytics_run["events"]
    assert len(events) >= 3
    rate = 25
    for event in events:
        assert event["snapshot"].startswith("bikes.events/") and event["clip"].endswith(".mp4")
        picture = cv2.imread(str(out / event["snapshot"]))
        assert picture is not None and picture.shape == (HEIGHT, WIDTH, 3), event
        x1, y1, x2, y2 = (int(round(v)) for v in event["xyxy"])
        x2, y2 = min(x2, WIDTH - 1), min(y2, HEIGHT - 1)
        edges = np.concatenate([picture[y1, x1:x2], picture[y2, x1:x2], picture[y1:y2, x1],
                                picture[y1:y2, x2]]).astype(int)
        assert (np.abs(edges - HIGHLIGHT_BGR) <= 60).all(axis=1).mean() > 0.9, event
        with av.open(str(out / event["clip"])) as clip:
            meta = json.loads(clip.metadata["comment"])
            frames = sum(1 for _ in clip.decode(clip.streams.video[0]))
        first, last = meta["start_frame"], meta["start_frame"] + frames - 1
        assert first <= max(0, event["frame"] - CLIP["pre_s"] * rate), (event, meta)
        assert last >= min(249, int(event["frame"] + CLIP["post_s"] * rate)), (event, meta)
        assert meta["start_pts"] == pytest.approx(first / rate)
    (summary,) = [e for e in analytics_run["logs"] if e["event"] == "event media summary"]
    assert (summary["snapshots"], summary["clips"], summary["dropped"], summary["failed"]) == \
        (len(events), len(events), 0, 0)


@pytest.mark.slow  # the detector over a clip on the CPU, through run.py with source workers
def test_with_two_workers_only_the_worker_that_made_media_logs_its_summary(
        make_clip, repo_root: Path, run_pipeline, tmp_path: Path) -> None:
    """``runtime.workers: 2`` (and its spare): every source worker builds the event media,
    but only the one that ran the source made any. Its ``event media summary`` is the run's
    one line, naming the source; the two idle workers' lines of zeros (a new user read them
    as real counts) are not logged."""
    import yaml

    config = yaml.safe_load((repo_root / "configs/analytics.yaml").read_text())
    config["sources"][0]["uri"] = str(make_clip("bikes", 100, (WIDTH, HEIGHT)))
    config["inference"].update(backend="onnxruntime", device="cpu")
    # snapshots only, no video: this test's time goes to the workers' summaries
    config["output"].update(dir=str(tmp_path / "out"), video=None,
                            event_media={"clip": None})
    config["runtime"] = {"log_format": "json", "progress": False, "workers": 2}
    run = run_pipeline(config, tmp_path)
    assert run.wait(120) == 0, run.stderr()[-3000:]
    assert len(run.events("worker gone")) == 3, run.stderr()[-3000:]  # two and the spare
    events = records(tmp_path / "out" / "bikes.events.jsonl")
    assert events and all("snapshot" in event for event in events)
    (summary,) = run.events("event media summary")
    assert (summary["snapshots"], summary["clips"], summary["dropped"], summary["failed"],
            summary["sources"]) == (len(events), 0, 0, 0, ["bikes"])
    # nor a stage that did nothing (the idle workers' track, analytics, annotate, ...)
    stages = run.events("stage summary")
    assert stages and all(s["frames"] or s["work_s"] or s["blocked_s"] for s in stages)
    assert len({s["host"] for s in stages if s["stage"] == "analytics"}) == 1
