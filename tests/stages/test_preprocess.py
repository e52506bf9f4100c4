"""PreprocessStage: batching by size and by time, order, end-of-stream flushing."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kernels.preprocess import letterbox_geometry, preprocess_reference
from pipeline.records import Batch, EndOfStream, Frame
from stages.preprocess import PreprocessStage


def frame(index: int, source: str = "a", width: int = 64, height: int = 48) -> Frame:
    rng = np.random.default_rng(index)
    image = rng.integers(0, 256, (height * 3 // 2, width), dtype=np.uint8)
    return Frame(source, index, None, time.time(), width, height, image=image)


def stage(batch_size: int = 3, timeout_ms: float = 1000.0) -> PreprocessStage:
    return PreprocessStage("pre", (32, 32), np.float32, batch_size, timeout_ms)


def test_full_batch_is_emitted_with_reference_images() -> None:
    pre = stage(batch_size=2)
    frames = [frame(0), frame(1, width=80, height=40)]
    assert list(pre.process(frames[0])) == []
    (batch,) = pre.process(frames[1])
    assert isinstance(batch, Batch) and batch.frames == frames
    assert batch.images.shape == (2, 3, 32, 32) and batch.images.dtype == np.float32
    for image, f in zip(batch.images, frames):
        expected = preprocess_reference(f.image, f.width, f.height,
                                        letterbox_geometry(f.width, f.height, 32, 32))
        np.testing.assert_array_equal(image, expected)
    assert batch.letterboxes[1] == letterbox_geometry(80, 40, 32, 32)


def test_partial_batch_runs_after_the_timeout() -> None:
    pre = stage(batch_size=8, timeout_ms=20)
    assert list(pre.process(frame(0))) == []
    assert 0 < pre.poll_interval_s <= 0.02
    assert list(pre.on_idle()) and pre.poll_interval_s is None
    # a frame arriving after the deadline closes its batch at once
    pre.process(frame(1))
    time.sleep(0.03)
    (batch,) = pre.process(frame(2))
    assert [f.index for f in batch.frames] == [1, 2]


@pytest.mark.parametrize("hook", ["end_of_stream", "finish"])
def test_pending_frames_leave_before_the_end(hook: str) -> None:
    pre = stage(batch_size=8)
    pre.process(frame(0))
    pre.process(frame(1, source="b"))
    eos = EndOfStream("a", 1)
    out = list(pre.end_of_stream(eos) if hook == "end_of_stream" else pre.finish())
    assert isinstance(out[0], Batch) and [f.index for f in out[0].frames] == [0, 1]
    assert out[1:] == ([eos] if hook == "end_of_stream" else [])
    assert list(pre.finish()) == []
