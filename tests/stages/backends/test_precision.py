"""FP16 conversion and INT8 Q/DQ calibration of the sample model, run with onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from benchmarks.int8_accuracy import detect, match_detections
from kernels.preprocess import PAD_VALUE
from stages.backends.precision import (
    CalibrationSettings,
    calibration_frames,
    convert_fp16,
    quantize_int8,
)


@pytest.fixture(scope="module")
def frames(samples) -> np.ndarray:
    """(16, 3, 416, 416) float32 frames spread over bikes.mp4, preprocessed like the pipeline."""
    return calibration_frames(samples.bikes, 16, 416, 416)


def run(model: Path, images: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return session.run(None, {"images": images})[0]


def io_types(model: onnx.ModelProto) -> list[int]:
    return [v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.output)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"method": "kl"}, "calibration method must be one of entropy, minmax, percentile"),
        ({"frames": 0}, "calibration frames must be at least 1"),
    ],
)
def test_calibration_settings_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CalibrationSettings(Path("scene.mp4"), **kwargs)


def test_calibration_frames_spread_over_the_video(frames, samples):
    assert frames.shape == (16, 3, 416, 416) and frames.dtype == np.float32
    assert 0.0 <= frames.min() and frames.max() <= 1.0
    # 640x272 letterboxed into 416x416: pad rows above and below the picture.
    np.testing.assert_array_equal(frames[:, :, :5], np.float32(PAD_VALUE))
    # Spread over 250 frames (every 15th), so consecutive samples differ clearly.
    assert min(np.abs(frames[i + 1] - frames[i]).mean() for i in range(15)) > 0.005
    short = calibration_frames(samples.carphone, 500, 416, 416)  # a 120-frame video
    assert len(short) == 120


def test_calibration_frames_missing_video_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="calibration video .*nope.mp4 does not exist"):
        calibration_frames(tmp_path / "nope.mp4", 4, 416, 416)


def test_fp16_keeps_float32_io_and_matches_fp32(samples, frames, tmp_path):
    out = convert_fp16(samples.model, tmp_path / "fp16.onnx")
    model = onnx.load(str(out))
    assert io_types(model) == [onnx.TensorProto.FLOAT] * 2
    weights = [i for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT16]
    assert len(weights) >= 13  # every convolution's weights at least
    ref, got = run(samples.model, frames[:4]), run(out, frames[:4])
    assert got.dtype == np.float32
    np.testing.assert_allclose(got[:, 4:], ref[:, 4:], atol=0.01)  # class scores
    np.testing.assert_allclose(got[:, :4], ref[:, :4], atol=2.0)  # boxes, input pixels


# Entropy needs more frames: with 16 its clipping keeps only 17 of these 31 detections.
@pytest.mark.parametrize(("method", "count"), [
    pytest.param("entropy", 32, marks=pytest.mark.slow),  # 16 frames are too few for entropy
    ("minmax", 8), ("percentile", 8)])
def test_int8_qdq_model_is_symmetric_and_agrees_with_fp32(samples, frames, tmp_path, method,
                                                           count):
    out = quantize_int8(samples.model, tmp_path / "int8.onnx",
                        CalibrationSettings(samples.bikes, method, frames=count))
    model = onnx.load(str(out))
    ops = [n.op_type for n in model.graph.node]
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    # One Q per distinct convolution input (convs reading the same tensor share it); no Q
    # after a convolution's output.
    assert len(convs) == 13 and ops.count("QuantizeLinear") == len({c.input[0] for c in convs})
    assert io_types(model) == [onnx.TensorProto.FLOAT] * 2
    zero_points = [numpy_helper.to_array(i) for i in model.graph.initializer
                   if i.name.endswith("zero_point")]
    assert zero_points and all(z.dtype == np.int8 and not z.any() for z in zero_points)
    producers = {o: n.op_type for n in model.graph.node for o in n.output}
    for conv in convs:
        assert [producers.get(i) for i in conv.input[:2]] == ["DequantizeLinear"] * 2
    # Most FP32 detections (31 on these frames) survive in INT8: same class, IoU > 0.5.
    reference, candidate = detect(samples.model, frames), detect(out, frames)
    matched = sum(len(match_detections(r, c)) for r, c in zip(reference, candidate))
    total = sum(len(r[0]) for r in reference)
    assert total >= 20 and matched >= 0.8 * total, (matched, total)
