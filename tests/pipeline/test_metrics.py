"""StageMetrics (work and blocked time apart) and SourceMetrics (per-batch latency window)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from pipeline import metrics
from pipeline.metrics import LATENCY_WINDOW, LinkStatus, SourceMetrics, StageMetrics

# ---------------------------------------------------------------------------------------------
# StageMetrics

@pytest.mark.parametrize(("records", "frames", "calls", "work_s", "blocked_s", "work_ms"), [
    pytest.param([], 0, 0, 0.0, 0.0, 0.0, id="nothing"),
    pytest.param([(1, 0.01, 0.0)], 1, 1, 0.01, 0.0, 10.0, id="one-frame"),
    pytest.param([(4, 0.02, 0.5), (4, 0.02, 0.0), (2, 0.01, 0.25)], 10, 3, 0.05, 0.75, 5.0,
                 id="batches"),
    pytest.param([(0, 0.0, 0.1)], 0, 1, 0.0, 0.1, 0.0, id="no-frames"),
])
def test_stage_record_and_summary(records: list[tuple[int, float, float]], frames: int,
                                  calls: int, work_s: float, blocked_s: float,
                                  work_ms: float) -> None:
    stage = StageMetrics("infer")
    for record in records:
        stage.record(*record)
    assert (stage.frames, stage.calls) == (frames, calls)
    assert stage.work_s == pytest.approx(work_s) and stage.blocked_s == pytest.approx(blocked_s)
    summary = stage.summary()
    assert set(summary) == {"stage", "frames", "fps", "work_ms_per_frame", "work_s", "blocked_s"}
    assert summary["stage"] == "infer" and summary["frames"] == frames
    assert summary["work_ms_per_frame"] == pytest.approx(work_ms)
    assert summary["work_s"] == pytest.approx(work_s) and summary["blocked_s"] == pytest.approx(blocked_s)
    assert not hasattr(stage, "busy_s")


def test_stage_fps_is_over_the_active_time_including_the_first_items_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([100.0, 101.0, 102.0])
    monkeypatch.setattr(metrics, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    stage = StageMetrics("sink")
    stage.record(10, 0.5, 0.5)  # began at 99.0
    stage.record(10, 0.1, 0.0)
    stage.record(10, 0.1, 0.2)
    assert (stage.started, stage.ended) == (99.0, 102.0)
    assert stage.summary()["fps"] == 10.0  # 30 frames over 3 s


def test_stage_record_from_threads_loses_nothing() -> None:
    stage = StageMetrics("s")

    def worker() -> None:
        for _ in range(1000):
            stage.record(2, 0.001, 0.002)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert (stage.frames, stage.calls) == (16_000, 8_000)
    assert stage.work_s == pytest.approx(8.0) and stage.blocked_s == pytest.approx(16.0)


# ---------------------------------------------------------------------------------------------
# SourceMetrics

def reference_percentile(values: list[float], q: float) -> float | None:
    """The definition the summary has always used: index int(q/100*n) of the sorted values."""
    ordered = sorted(values)
    if not ordered:
        return None
    return round(1000 * ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))], 1)


@pytest.mark.parametrize("batches", [
    pytest.param([], id="none"),
    pytest.param([[0.25]], id="one-frame"),
    pytest.param([[0.01, 0.02, 0.03], [], [0.5, 0.004]], id="small-batches"),
    pytest.param([list(np.linspace(0.001, 1.0, 997))] * 3, id="under-the-window"),
    pytest.param([list(np.random.default_rng(1).exponential(0.05, 3001)) for _ in range(7)],
                 id="wraps-the-window"),
    pytest.param([list(np.random.default_rng(2).exponential(0.05, LATENCY_WINDOW + 123))],
                 id="one-batch-over-the-window"),
])
def test_source_frames_done_and_percentiles(batches: list[list[float]]) -> None:
    source = SourceMetrics("cam")
    for batch in batches:
        source.frames_done(np.asarray(batch, dtype=np.float64))
    everything = [v for batch in batches for v in batch]
    window = everything[-LATENCY_WINDOW:]
    assert source.frames_out == len(everything)
    np.testing.assert_array_equal(source.latency_s, np.asarray(window, dtype=np.float64))
    for q in (0, 50, 90, 99, 100):
        assert source.latency_percentile(q) == reference_percentile(window, q)
    summary = source.summary(2.0)
    assert summary["frames"] == len(everything)
    assert summary["fps"] == round(len(everything) / 2.0, 1)
    assert summary["latency_p50_ms"] == reference_percentile(window, 50)
    assert summary["latency_p99_ms"] == reference_percentile(window, 99)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_source_frames_done_accepts_float_arrays(dtype: type) -> None:
    source = SourceMetrics("cam")
    source.frames_done(np.array([0.5, 0.25], dtype=dtype))
    assert source.frames_out == 2
    assert source.latency_s.dtype == np.float64
    assert source.latency_percentile(0) == 250.0


def test_source_frames_done_from_threads_loses_nothing() -> None:
    source = SourceMetrics("cam")
    batch = np.full(7, 0.1)

    def worker() -> None:
        for _ in range(500):
            source.frames_done(batch)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert source.frames_out == 14_000
    assert len(source.latency_s) == LATENCY_WINDOW
    assert source.latency_percentile(50) == 100.0


def test_source_frames_done_is_per_batch_cheap() -> None:
    """A batch slice costs one call, not one per frame: 10,000 slices of 8 well under a second."""
    source = SourceMetrics("cam")
    batch = np.linspace(0.01, 0.08, 8)
    began = time.perf_counter()
    for _ in range(10_000):
        source.frames_done(batch)
    assert time.perf_counter() - began < 1.0
    assert source.frames_out == 80_000


def test_a_live_source_not_connected_at_its_end_gives_its_last_error_in_its_summary():
    """A camera that never connected (a new user's Ctrl-C after 9 refused attempts) ended with
    ``error=None`` alone in its summary; its last attempt's reason now comes with it."""
    metrics = SourceMetrics("door")
    metrics.link = LinkStatus("reconnecting", 9, None, "cannot open rtsp://h/x: Connection refused")
    summary = metrics.summary(10.0)
    assert (summary["error"], summary["last_error"]) == (
        None, "cannot open rtsp://h/x: Connection refused")
    metrics.link = LinkStatus("connected", error="cannot open rtsp://h/x: Connection refused")
    assert "last_error" not in metrics.summary(10.0)  # it connected again: it ended well
