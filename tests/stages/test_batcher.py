"""BatcherStage on the CPU path: when batches close (size, timeout, end of a stream, end of
the run), what their columns hold and the letterbox of each frame."""

from __future__ import annotations

import time

import av
import numpy as np
import pytest

from kernels.preprocess import letterbox_geometry, preprocess_reference
from pipeline.records import LETTERBOX_COLUMNS, EndOfStream, FrameBatch
from stages.batcher import SET_WAIT_POLL_S, BatcherStage, DetectionSchedule, letterbox_row, pack_nv12
from tests.support.batches import grey_image, make_frame

NAMES = ("a", "b", "c")


def batcher(batch_size: int = 3, timeout_ms: float = 1000.0) -> BatcherStage:
    return BatcherStage("batch", (32, 48), batch_size, timeout_ms, NAMES)


def frame(source: str, index: int, width: int = 64, height: int = 48, slot: int = -1):
    return make_frame(source, index, grey_image(width, height, index % 256), pts=index / 25,
                      slot=slot)


@pytest.mark.parametrize("batch_size", [1, 2, 4])
def test_a_batch_closes_when_it_holds_batch_size_frames(batch_size: int) -> None:
    stage = batcher(batch_size)
    frames = [frame("a", i) for i in range(2 * batch_size)]
    out = [list(stage.process(f)) for f in frames]
    closed_at = [i for i, batches in enumerate(out) if batches]
    assert closed_at == [batch_size - 1, 2 * batch_size - 1]
    for k, i in enumerate(closed_at):
        (batch,) = out[i]
        assert isinstance(batch, FrameBatch)
        assert batch.index.tolist() == list(range(k * batch_size, (k + 1) * batch_size))
    assert stage.poll_interval_s is None and list(stage.finish()) == []


def test_a_partial_batch_closes_on_idle_after_the_timeout() -> None:
    stage = batcher(batch_size=8, timeout_ms=50)
    assert stage.poll_interval_s is None  # nothing pending: no deadline
    assert list(stage.process(frame("a", 0))) == []
    assert 0 < stage.poll_interval_s <= 0.05
    time.sleep(0.02)
    assert list(stage.process(frame("b", 0))) == []
    assert stage.poll_interval_s <= 0.03  # the first frame's deadline, not the last one's
    (batch,) = stage.on_idle()
    assert batch.source.tolist() == [0, 1] and stage.poll_interval_s is None
    assert list(stage.on_idle()) == []


def test_a_frame_arriving_after_the_deadline_closes_its_batch_at_once() -> None:
    stage = batcher(batch_size=8, timeout_ms=20)
    stage.process(frame("a", 0))
    time.sleep(0.03)
    assert stage.poll_interval_s == 0.0
    (batch,) = stage.process(frame("a", 1))
    assert batch.index.tolist() == [0, 1]


def test_end_of_stream_flushes_the_pending_frames_then_passes_the_marker() -> None:
    stage = batcher(batch_size=8)
    stage.process(frame("a", 0))
    stage.process(frame("b", 0))
    stage.process(frame("a", 1))
    eos = EndOfStream("a", 2)
    batch, marker = stage.end_of_stream(eos)
    assert isinstance(batch, FrameBatch) and marker is eos
    assert batch.source.tolist() == [0, 1, 0] and batch.index.tolist() == [0, 0, 1]
    assert list(stage.end_of_stream(eos)) == [eos]  # nothing pending: only the marker
    stage.process(frame("c", 5))
    (last,) = stage.finish()
    assert last.source.tolist() == [2] and list(stage.finish()) == []


def test_columns_and_letterbox_rows_of_a_mixed_size_batch() -> None:
    sizes = [(64, 48), (48, 64), (64, 48), (100, 20)]
    frames = [make_frame(source, i, grey_image(w, h), pts=None if i == 2 else i * 0.04,
                         capture_time=1000.0 + i, slot=10 + i)
              for i, (source, (w, h)) in enumerate(zip(["c", "a", "b", "c"], sizes))]
    stage = batcher(batch_size=4)
    *_, (batch,) = [list(stage.process(f)) for f in frames]
    assert batch.source_names == NAMES
    assert batch.source.dtype == np.int32 and batch.source.tolist() == [2, 0, 1, 2]
    assert batch.index.tolist() == [0, 1, 2, 3]
    np.testing.assert_array_equal(batch.pts, [0.0, 0.04, np.nan, 0.12])
    assert batch.capture_time.tolist() == [1000.0, 1001.0, 1002.0, 1003.0]
    assert batch.width.tolist() == [w for w, _ in sizes]
    assert batch.height.tolist() == [h for _, h in sizes]
    assert batch.slot.tolist() == [10, 11, 12, 13]
    assert all(image is f.image for image, f in zip(batch.images, frames))
    assert batch.buffers is None  # the CPU path has no device set
    assert batch.letterbox.dtype == np.float32 and batch.letterbox.shape == (4, 6)
    for row, (w, h) in zip(batch.letterbox, sizes):
        expected = letterbox_geometry(w, h, 48, 32)  # the input is (height 32, width 48)
        assert stage.letterbox(w, h) is stage.letterbox(w, h) == expected  # cached
        columns = dict(zip(LETTERBOX_COLUMNS, row.tolist()))
        assert columns == {name: pytest.approx(value, rel=1e-6) for name, value in zip(
            LETTERBOX_COLUMNS, letterbox_row(expected))}
        assert (columns["src_width"], columns["src_height"]) == (w, h)
    np.testing.assert_array_equal(batch.letterbox[0], batch.letterbox[2])


def pitched_planes(picture: av.VideoFrame, pitch: int) -> tuple[np.ndarray, np.ndarray]:
    """The NV12 planes as a decoder surface holds them: rows ``pitch`` bytes apart, UV
    interleaved, (H, W) and (H/2, W/2, 2) views -- the shapes and strides of the DLPack export."""
    nv12 = picture.to_ndarray(format="nv12")
    height, width = picture.height, picture.width
    surface = np.full((height * 3 // 2, pitch), 77, np.uint8)  # padding the pack must skip
    surface[:, :width] = nv12
    uv = surface[height:, :width].reshape(height // 2, width // 2, 2)
    return surface[:height, :width], uv


@pytest.mark.parametrize("pitch", [640, 768, 1024])
def test_packed_nv12_is_the_frame_the_kernel_reads(samples, pitch: int) -> None:
    with av.open(str(samples.bikes)) as container:
        picture = next(container.decode(video=0))
    width, height = picture.width, picture.height
    y, uv = pitched_planes(picture, pitch)
    assert y.strides == (pitch, 1) and uv.strides == (pitch, 2, 1)
    row = np.zeros(width * height * 2, np.uint8)  # a device frame row larger than the frame
    packed = pack_nv12(y, uv, row)
    np.testing.assert_array_equal(packed, picture.to_ndarray(format="nv12"))
    assert not row[packed.size:].any()
    # The same picture as NV12 (GPU decode) and as I420 (CPU decode) gives the same input.
    letterbox = letterbox_geometry(width, height, 416, 416)
    from_nv12 = preprocess_reference(packed, width, height, letterbox, pixel_format="nv12")
    from_i420 = preprocess_reference(picture.to_ndarray(format="yuv420p"), width, height,
                                     letterbox)
    np.testing.assert_array_equal(from_nv12, from_i420)


def test_detect_every_marks_every_nth_frame_of_each_source() -> None:
    schedule = DetectionSchedule([3, 1, 2], [None, None, None])
    stage = BatcherStage("batch", (32, 48), 4, 1000.0, NAMES, schedule=schedule)
    frames = [frame(name, i) for i in range(6) for name in ("a", "b", "c")]
    batches = [b for f in frames for b in stage.process(f)] + list(stage.finish())
    detect = np.concatenate([b.detect for b in batches])
    names = [NAMES[s] for b in batches for s in b.source.tolist()]
    index = np.concatenate([b.index for b in batches])
    expected = [i % {"a": 3, "b": 1, "c": 2}[n] == 0 for n, i in zip(names, index.tolist())]
    assert detect.tolist() == expected
    assert all(b.detect_rows.tolist() == np.flatnonzero(b.detect).tolist() for b in batches)


def test_no_schedule_leaves_detect_none() -> None:
    stage = BatcherStage("batch", (32, 48), 2, 1000.0, NAMES,
                         schedule=DetectionSchedule([1, 1, 1], [None, None, None]))
    (batch,) = [b for f in (frame("a", 0), frame("b", 0)) for b in stage.process(f)]
    assert batch.detect is None and batch.detect_rows.tolist() == [0, 1]


@pytest.mark.parametrize("rate, fps, expected", [
    (25, 10, 10), (30, 10, 10), (25, 5, 5), (30, 30, 30), (25, 40, 25), (12.5, 2.5, 2.5)])
def test_detect_fps_detects_that_many_frames_a_second_evenly(rate, fps, expected) -> None:
    schedule = DetectionSchedule([1], [fps])
    wanted = [schedule.wanted(0, i, i / rate) for i in range(int(rate * 8))]
    assert sum(wanted) == pytest.approx(expected * 8, abs=1)
    per_second = [sum(wanted[int(s * rate):int((s + 1) * rate)]) for s in range(8)]
    assert max(per_second) - min(per_second) <= 1  # even, not in bursts
    gaps = np.diff(np.flatnonzero(wanted))
    assert gaps.max() - gaps.min() <= 1


def test_detect_fps_restarts_when_the_time_jumps_back_or_has_a_gap() -> None:
    schedule = DetectionSchedule([1], [10])
    assert [schedule.wanted(0, i, t) for i, t in enumerate([5.0, 5.04, 5.08, 5.12])] == \
        [True, False, False, True]
    assert schedule.wanted(0, 4, 0.0)  # a reconnected stream starts its pts again
    assert not schedule.wanted(0, 5, 0.04)
    assert schedule.wanted(0, 6, 9.0)  # a gap of seconds: detected at once
    assert not schedule.wanted(0, 7, 9.04)


class SetsInUse:
    """Stands in for the GPU path's ``GpuContext`` in what the batcher asks before closing a
    timed-out batch: whether one of its batch sets is free (``BatchRing.has_free``). Only
    that is asked here: no batch is made (making one needs the GPU; the GPU tests do)."""

    def __init__(self) -> None:
        self.free = False
        self.batches = self

    def has_free(self) -> bool:
        return self.free


def test_a_timed_out_batch_stays_open_while_every_batch_set_is_in_use() -> None:
    stage = batcher(batch_size=8, timeout_ms=10)
    stage.gpu = gpu = SetsInUse()
    stage.process(frame("a", 0))
    time.sleep(0.02)
    assert stage.poll_interval_s == pytest.approx(SET_WAIT_POLL_S)  # look again soon
    assert list(stage.on_idle()) == []  # not closed: the GPU has batches queued
    assert list(stage.process(frame("b", 0))) == []  # past its timeout, it still takes frames
    assert list(stage.process(frame("a", 1))) == []
    gpu.free = True
    assert stage.poll_interval_s == 0.0  # a set is free: it closes now
    stage.gpu = None  # (made on the CPU path: making a GPU batch needs the GPU)
    (batch,) = stage.on_idle()
    assert batch.source.tolist() == [0, 1, 0] and batch.index.tolist() == [0, 0, 1]
