"""Test models in other output layouts, made from a real (B, 4 + K, A) YOLO ONNX model by
appending ONNX ops to its graph (no such exports exist offline):

- ``to_yolov5_layout``: (B, A, 5 + K) rows of cx, cy, w, h, objectness, class probabilities,
  with objectness = the best class score and probability = score / objectness, so that
  objectness x probability gives back the original scores;
- ``to_end2end``: (1, N, 6) rows of x1, y1, x2, y2, score, class after ONNX
  ``NonMaxSuppression`` inside the graph (each anchor's best class only, as the pipeline's
  own decoding does), best score first, zero rows after the last detection. Batch 1, as
  end-to-end exports usually are.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def _load(source: Path) -> tuple[onnx.ModelProto, str, int, int]:
    model = onnx.load(str(source))
    output = model.graph.output[0]
    dims = [d.dim_value for d in output.type.tensor_type.shape.dim]
    return model, output.name, dims[1], dims[2]  # (B, 4 + K, A)


def _const(graph: onnx.GraphProto, name: str, value: np.ndarray) -> str:
    graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    return name


def _save(model: onnx.ModelProto, nodes: list, output: str, shape: list, target: Path) -> Path:
    graph = model.graph
    graph.node.extend(nodes)
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info(output, TensorProto.FLOAT, shape))
    onnx.checker.check_model(model)
    onnx.save(model, str(target))
    return target


def to_yolov5_layout(source: Path, target: Path) -> Path:
    """``source``'s model with a (B, A, 5 + K) output (module docstring)."""
    model, out, rows, anchors = _load(source)
    g = model.graph
    n = helper.make_node
    nodes = [
        n("Transpose", [out], ["v5_t"], perm=[0, 2, 1]),  # (B, A, 4 + K)
        n("Slice", ["v5_t", _const(g, "v5_0", np.array([0])), _const(g, "v5_4", np.array([4])),
                    _const(g, "v5_ax", np.array([2]))], ["v5_box"]),
        n("Slice", ["v5_t", "v5_4", _const(g, "v5_end", np.array([rows])), "v5_ax"],
          ["v5_scores"]),
        n("ReduceMax", ["v5_scores"], ["v5_obj"], axes=[2], keepdims=1),
        n("Max", ["v5_obj", _const(g, "v5_tiny", np.array(1e-12, np.float32))], ["v5_safe"]),
        n("Div", ["v5_scores", "v5_safe"], ["v5_prob"]),
        n("Concat", ["v5_box", "v5_obj", "v5_prob"], ["output_v5"], axis=2),
    ]
    batch = model.graph.input[0].type.tensor_type.shape.dim[0]
    return _save(model, nodes, "output_v5",
                 [batch.dim_param or batch.dim_value, anchors, rows + 1], target)


def to_end2end(source: Path, target: Path, conf: float, iou: float, max_det: int = 300) -> Path:
    """``source``'s model with NMS inside and a (1, max_det, 6) output (module docstring)."""
    model, out, rows, anchors = _load(source)
    g = model.graph
    n = helper.make_node
    c = lambda name, value: _const(g, name, value)  # noqa: E731
    nodes = [
        n("Squeeze", [out, c("e_ax0", np.array([0]))], ["e_p"]),  # (4 + K, A)
        n("Slice", ["e_p", c("e_0", np.array([0])), c("e_4", np.array([4])),
                    c("e_axr", np.array([0]))], ["e_cxcywh"]),  # (4, A)
        n("Slice", ["e_p", "e_4", c("e_nrows", np.array([rows])), "e_axr"], ["e_scores"]),
        # each anchor's best class only (ties keep every tied class, as argmax keeps one)
        n("ReduceMax", ["e_scores"], ["e_best"], axes=[0], keepdims=1),
        n("Equal", ["e_scores", "e_best"], ["e_is_best"]),
        n("Cast", ["e_is_best"], ["e_mask"], to=TensorProto.FLOAT),
        n("Mul", ["e_scores", "e_mask"], ["e_best_scores"]),  # (K, A)
        n("Transpose", ["e_cxcywh"], ["e_boxes_c"], perm=[1, 0]),  # (A, 4) cx, cy, w, h
        n("Split", ["e_boxes_c", c("e_split", np.array([1, 1, 1, 1]))],
          ["e_cx", "e_cy", "e_w", "e_h"], axis=1),
        n("Mul", ["e_w", c("e_half", np.array(0.5, np.float32))], ["e_hw"]),
        n("Mul", ["e_h", "e_half"], ["e_hh"]),
        n("Sub", ["e_cx", "e_hw"], ["e_x1"]), n("Sub", ["e_cy", "e_hh"], ["e_y1"]),
        n("Add", ["e_cx", "e_hw"], ["e_x2"]), n("Add", ["e_cy", "e_hh"], ["e_y2"]),
        n("Concat", ["e_x1", "e_y1", "e_x2", "e_y2"], ["e_xyxy"], axis=1),  # (A, 4)
        n("Unsqueeze", ["e_xyxy", "e_ax0"], ["e_nms_boxes"]),  # (1, A, 4)
        n("Unsqueeze", ["e_best_scores", "e_ax0"], ["e_nms_scores"]),  # (1, K, A)
        n("NonMaxSuppression", ["e_nms_boxes", "e_nms_scores",
                                c("e_max", np.array([max_det], np.int64)),
                                c("e_iou", np.array([iou], np.float32)),
                                c("e_conf", np.array([conf], np.float32))], ["e_sel"]),
        n("Gather", ["e_sel", c("e_i1", np.array(1))], ["e_cls"], axis=1),  # (M,)
        n("Gather", ["e_sel", c("e_i2", np.array(2))], ["e_box"], axis=1),
        n("Gather", ["e_xyxy", "e_box"], ["e_sel_xyxy"], axis=0),  # (M, 4)
        n("Mul", ["e_cls", c("e_a", np.array(anchors, np.int64))], ["e_off"]),
        n("Add", ["e_off", "e_box"], ["e_flat_i"]),
        n("Reshape", ["e_best_scores", c("e_flat", np.array([-1]))], ["e_flat_s"]),
        n("Gather", ["e_flat_s", "e_flat_i"], ["e_score"]),  # (M,)
        n("Cast", ["e_cls"], ["e_cls_f"], to=TensorProto.FLOAT),
        n("Unsqueeze", ["e_score", c("e_ax1", np.array([1]))], ["e_score_c"]),
        n("Unsqueeze", ["e_cls_f", "e_ax1"], ["e_cls_c"]),
        n("Concat", ["e_sel_xyxy", "e_score_c", "e_cls_c"], ["e_rows"], axis=1),  # (M, 6)
        n("Shape", ["e_score"], ["e_m"]),
        n("Min", ["e_m", c("e_cap", np.array([max_det], np.int64))], ["e_k"]),
        n("TopK", ["e_score", "e_k"], ["e_top", "e_order"], axis=0, largest=1, sorted=1),
        n("Gather", ["e_rows", "e_order"], ["e_sorted"], axis=0),  # (k, 6)
        n("Sub", ["e_cap", "e_k"], ["e_missing"]),
        n("Concat", [c("e_zero", np.array([0], np.int64)), "e_zero", "e_missing", "e_zero"],
          ["e_pads"], axis=0),
        n("Pad", ["e_sorted", "e_pads"], ["e_padded"]),  # (max_det, 6)
        n("Unsqueeze", ["e_padded", "e_ax0"], ["output_e2e"]),
    ]
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 1  # batch 1
    return _save(model, nodes, "output_e2e", [1, max_det, 6], target)
