"""Reduced-precision ONNX models for TensorRT's strongly typed networks.

TensorRT 11 removed the precision builder flags (FP16, INT8) and the INT8 calibrator classes,
and TensorRT-RTX never had them: the precision of every tensor now lives in the ONNX graph.
This module writes those graphs, so one strongly typed build path serves every TensorRT:

- FP16: float tensors and weights converted to float16, with the model's inputs and outputs
  kept float32 (the pipeline's buffers stay the same) and the ops onnxruntime's converter
  blocks (Resize/Upsample scales, Range, TopK, ...) kept float32 behind Cast nodes.
- INT8: explicit quantisation. Post-training static quantisation with onnxruntime writes
  QuantizeLinear/DequantizeLinear (Q/DQ) pairs, symmetric int8 (zero point 0, which is what
  TensorRT accepts), per-channel weights, calibrated on frames of the user's own video
  preprocessed exactly as the pipeline does (``kernels.preprocess.preprocess_reference``).

Why onnxruntime's quantisation tools and not NVIDIA ModelOpt: onnxruntime is already a
dependency and runs on any CPU, so CI builds and runs the very Q/DQ model users deploy;
ModelOpt's ONNX PTQ calibrates through onnxruntime as well, but pulls in a large extra
dependency stack for no difference in the Q/DQ graph TensorRT receives.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stages.backends.base import read_model_info

CALIBRATION_METHODS = ("entropy", "minmax", "percentile")
# Only convolutions get Q/DQ: they are nearly all of YOLO's compute, while the decode head
# (sigmoid, exp, box arithmetic in pixels, class scores) must stay in float to stay exact.
QUANTIZED_OP_TYPES = ["Conv"]


@dataclass(frozen=True)
class CalibrationSettings:
    """How INT8 quantisation scales are calibrated.

    Attributes:
        video: a video of the deployment scene, any file PyAV opens; its frames are the
            calibration data.
        method: ``entropy`` (minimise KL divergence, TensorRT's classic calibrator),
            ``minmax`` (full observed range) or ``percentile`` (99.999th percentile).
        frames: how many frames to use, spread evenly over the video.
    """

    video: Path
    method: str = "entropy"
    frames: int = 64

    def __post_init__(self) -> None:
        if self.method not in CALIBRATION_METHODS:
            raise ValueError(
                f"calibration method must be one of {', '.join(CALIBRATION_METHODS)}, "
                f"got {self.method!r}"
            )
        if self.frames < 1:
            raise ValueError(f"calibration frames must be at least 1, got {self.frames}")


def convert_fp16(model_path: Path, out_path: Path) -> Path:
    """Write an FP16 copy of an ONNX model with float32 inputs and outputs.

    Args:
        model_path: the FP32 ONNX model.
        out_path: where the FP16 model goes (its folder must exist).

    Returns:
        ``out_path``.
    """
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(str(model_path))
    converted = convert_float_to_float16(model, keep_io_types=True)
    onnx.save(converted, str(out_path))
    return out_path


def calibration_frames(video: Path, count: int, width: int, height: int) -> np.ndarray:
    """Decode ``count`` frames spread over a video and preprocess them like the pipeline.

    Args:
        video: path of a video file PyAV can open.
        count: frames wanted; fewer come back when the video is shorter.
        width, height: the model's input size in pixels.

    Returns:
        (n, 3, height, width) float32 host array, RGB in 0..1, letterboxed; n <= count.

    Raises:
        ValueError: the video is missing, unreadable or has no frames.
    """
    import av

    from kernels.preprocess import letterbox_geometry, preprocess_reference

    if not Path(video).is_file():
        raise ValueError(f"calibration video {video} does not exist")
    out = []
    try:
        with av.open(str(video)) as container:
            stream = container.streams.video[0]
            step = max(1, (stream.frames or count) // count)
            for i, frame in enumerate(container.decode(stream)):
                if i % step:
                    continue
                box = letterbox_geometry(frame.width, frame.height, width, height)
                yuv = frame.to_ndarray(format="yuv420p")
                out.append(preprocess_reference(yuv, frame.width, frame.height, box))
                if len(out) == count:
                    break
    except (av.FFmpegError, IndexError) as error:
        raise ValueError(f"calibration video {video} could not be decoded: {error}") from error
    if not out:
        raise ValueError(f"calibration video {video} has no frames")
    return np.stack(out)


def quantize_int8(model_path: Path, out_path: Path, calibration: CalibrationSettings) -> Path:
    """Write a Q/DQ INT8 copy of an ONNX model, calibrated on frames of a video.

    Needs onnxruntime 1.30 or later (``quantize_static(calibration_cache_path=...)``).

    Args:
        model_path: the FP32 ONNX model (YOLO layout, see ``read_model_info``).
        out_path: where the Q/DQ model goes (its folder must exist).
        calibration: the video, method and frame count.

    Returns:
        ``out_path``.
    """
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.calibrate import create_calibrator, save_tensors_data
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Batches(CalibrationDataReader):
        def __init__(self, batches: list[dict[str, np.ndarray]]) -> None:
            self.batches = iter(batches)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.batches, None)

    info = read_model_info(model_path)
    frames = calibration_frames(calibration.video, calibration.frames,
                                info.input_width, info.input_height)
    method = {"entropy": CalibrationMethod.Entropy, "minmax": CalibrationMethod.MinMax,
              "percentile": CalibrationMethod.Percentile}[calibration.method]
    # quantize_static cannot pass histogram sizes to its calibrator, and onnxruntime's default
    # for entropy (128 bins for 128 quantised bins) leaves one candidate threshold: the
    # maximum, i.e. plain minmax. So calibrate here with TensorRT's classic entropy setting
    # (2048 bins searched for the best 128-bin quantisation) and hand the ranges over.
    options = {"symmetric": True, "num_bins": 2048, "num_quantized_bins": 128}
    with tempfile.TemporaryDirectory(prefix="int8-") as work:
        prepared, ranges = Path(work) / "prepared.onnx", Path(work) / "ranges.json"
        quant_pre_process(str(model_path), str(prepared), skip_symbolic_shape=True)
        calibrator = create_calibrator(prepared, QUANTIZED_OP_TYPES, Path(work) / "augmented.onnx",
                                       method, extra_options=options)
        batch = 8 if info.dynamic_batch else 1
        for start in range(0, len(frames), batch):  # a batch at a time bounds the memory held
            calibrator.collect_data(Batches([{info.input_name: frames[start:start + batch]}]))
        save_tensors_data(calibrator.compute_data(), ranges)
        quantize_static(
            prepared, out_path, None,
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QInt8,
            weight_type=QuantType.QInt8,
            per_channel=True,
            op_types_to_quantize=QUANTIZED_OP_TYPES,
            calibrate_method=method,
            calibration_cache_path=ranges,
            # TensorRT takes symmetric int8 only and keeps biases in float itself; Q/DQ go on
            # a convolution's inputs, not its output (TensorRT's recommended placement), which
            # also leaves the raw head outputs that feed the box decode unquantised.
            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True,
                           "QuantizeBias": False, "OpTypesToExcludeOutputQuantization": ["Conv"]},
        )
    return out_path
