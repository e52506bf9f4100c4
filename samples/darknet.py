"""Convert a darknet YOLO (cfg + weights) into an ONNX detector with the YOLOv8 output layout.

Needs only NumPy and onnx. The model takes ``images`` (batch, 3, S, S) float32 RGB in 0..1 and
returns ``output0`` (batch, 4 + classes, anchors) float32: rows cx, cy, w, h in input pixels,
then one score per class (objectness x class probability), exactly what a YOLOv8 export gives,
so the same postprocess decodes both. The batch dimension is symbolic (``batch``).

Anchor order along the last axis: the ``[yolo]`` heads in cfg order (for yolov3-tiny the 13x13
head, then the 26x26 head), and within a head ``(anchor, y, x)``: index ``a * H * W + y * W + x``.

Supported layers (enough for yolov3-tiny): ``convolutional`` (with or without batch_normalize,
leaky or linear activation), ``maxpool`` (with darknet's padding, which for the stride-1 pool is
one pixel on the right and bottom), ``upsample`` (nearest), ``route`` (one or more layers) and
``yolo``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
BN_EPS = 1e-6  # darknet normalises as (x - mean) / (sqrt(var) + 1e-6)
LEAKY_SLOPE = 0.1


def parse_cfg(path: str | Path) -> list[dict[str, str]]:
    """Read a darknet cfg into a list of sections, the first being ``[net]``.

    Each section is a dict of its ``key=value`` lines (values as strings) plus ``type``, the
    name in brackets.

    Raises:
        ValueError: a line is neither a section header nor ``key=value``, or there is no [net].
    """
    sections: list[dict[str, str]] = []
    for raw in Path(path).read_text().splitlines():
        line = raw.split("#", 1)[0].split(";", 1)[0].strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            sections.append({"type": line[1:-1].strip()})
        elif "=" in line and sections:
            key, value = line.split("=", 1)
            sections[-1][key.strip()] = value.strip()
        else:
            raise ValueError(f"{path}: cannot parse line {raw!r}")
    if not sections or sections[0]["type"] not in ("net", "network"):
        raise ValueError(f"{path}: the first section must be [net]")
    return sections


def read_weights(path: str | Path) -> np.ndarray:
    """Read a darknet weights file: the float32 values after its header, as a flat array."""
    data = Path(path).read_bytes()
    major, minor, _revision = np.frombuffer(data, np.int32, 3)
    header = 20 if major * 10 + minor >= 2 and major < 1000 and minor < 1000 else 16
    return np.frombuffer(data, np.float32, offset=header)


class _Graph:
    """Collects ONNX nodes and initializers; every node has one output named like the node."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def const(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(self, op: str, inputs: list[str], name: str, **attrs: object) -> str:
        self.nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name


def _decode_head(g: _Graph, name: str, x: str, sec: dict[str, str], grid: tuple[int, int],
                 input_size: int) -> tuple[str, int, int]:
    """Add a yolo head's decode; returns (tensor (B, 4 + classes, A*H*W), classes, anchors)."""
    h, w = grid
    mask = [int(v) for v in sec["mask"].split(",")]
    anchors = np.array([float(v) for v in sec["anchors"].split(",")], np.float32).reshape(-1, 2)
    anchors, a, nc, n = anchors[mask], len(mask), int(sec["classes"]), len(mask) * h * w
    t = g.node("Reshape", [x, g.const(f"{name}.shape4", np.array([0, a, 5 + nc, h * w]))],
               f"{name}.reshape")
    t = g.node("Transpose", [t], f"{name}.transpose", perm=[0, 2, 1, 3])
    t = g.node("Reshape", [t, g.const(f"{name}.shape3", np.array([0, 5 + nc, n]))], f"{name}.flat")
    xy, wh, obj, cls = (f"{name}.{part}" for part in ("xy", "wh", "obj", "cls"))
    sizes = g.const(f"{name}.sizes", np.array([2, 2, 1, nc]))
    g.nodes.append(helper.make_node("Split", [t, sizes], [xy, wh, obj, cls], f"{name}.split",
                                    axis=1))
    gy, gx = np.mgrid[0:h, 0:w]
    stride = np.float32(input_size / w)
    offsets = np.tile(np.stack([gx.ravel(), gy.ravel()]), (1, a))[None].astype(np.float32) * stride
    sizes_wh = np.repeat(anchors.T, h * w, axis=1)[None]  # (1, 2, A*H*W), in input pixels
    xy = g.node("Mul", [g.node("Sigmoid", [xy], f"{xy}.sigmoid"),
                        g.const(f"{name}.stride", stride)], f"{xy}.scaled")
    xy = g.node("Add", [xy, g.const(f"{name}.offsets", offsets)], f"{xy}.pixels")
    wh = g.node("Mul", [g.node("Exp", [wh], f"{wh}.exp"), g.const(f"{name}.anchors", sizes_wh)],
                f"{wh}.pixels")
    scores = g.node("Mul", [g.node("Sigmoid", [cls], f"{cls}.sigmoid"),
                            g.node("Sigmoid", [obj], f"{obj}.sigmoid")], f"{name}.scores")
    return g.node("Concat", [xy, wh, scores], f"{name}.out", axis=1), nc, n


def convert_darknet(cfg_path: str | Path, weights_path: str | Path, onnx_path: str | Path,
                    input_size: int = 416, names: list[str] | None = None) -> onnx.ModelProto:
    """Convert a darknet cfg + weights into an ONNX model (see the module docstring for its I/O).

    Args:
        cfg_path: darknet ``.cfg`` file.
        weights_path: darknet ``.weights`` file matching the cfg.
        onnx_path: where to write the model.
        input_size: side of the square input in pixels (a multiple of the network's stride).
        names: class names, stored in the model metadata as Ultralytics does (``names``).

    Returns:
        The model that was written.

    Raises:
        ValueError: an unsupported layer or activation, or weights that do not match the cfg.
    """
    sections = parse_cfg(cfg_path)
    weights = read_weights(weights_path)
    g, pos = _Graph(), 0
    layers: list[tuple[str, int, int, int]] = []  # per layer: output tensor, channels, h, w
    heads: list[tuple[str, int, int]] = []
    for i, sec in enumerate(sections[1:]):
        kind, name = sec["type"], f"l{i:03d}_{sec['type']}"
        x, c, h, w = layers[-1] if layers else ("images", 3, input_size, input_size)
        if kind == "convolutional":
            n, k, s = int(sec["filters"]), int(sec["size"]), int(sec.get("stride", 1))
            p = k // 2 if int(sec.get("pad", 0)) else int(sec.get("padding", 0))
            bn, act = int(sec.get("batch_normalize", 0)), sec.get("activation", "logistic")
            if act not in ("leaky", "linear"):
                raise ValueError(f"{cfg_path}: layer {i}: activation {act!r} is not supported")
            sizes = [n] * (4 if bn else 1) + [n * c * k * k]
            if pos + sum(sizes) > weights.size:
                raise ValueError(f"{weights_path}: too short for {cfg_path} (layer {i})")
            chunk, pos = weights[pos:pos + sum(sizes)], pos + sum(sizes)
            bias, *bn_params, kernel = np.split(chunk, np.cumsum(sizes)[:-1])
            kernel = kernel.reshape(n, c, k, k)
            if bn:
                gamma, mean, var = bn_params
                scale = gamma / (np.sqrt(var) + np.float32(BN_EPS))
                kernel, bias = kernel * scale[:, None, None, None], bias - mean * scale
            params = [g.const(f"{name}.weight", kernel), g.const(f"{name}.bias", bias)]
            y = g.node("Conv", [x, *params], name, kernel_shape=[k, k], strides=[s, s],
                       pads=[p] * 4)
            if act == "leaky":
                y = g.node("LeakyRelu", [y], f"{name}.leaky", alpha=LEAKY_SLOPE)
            c, h, w = n, (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
        elif kind == "maxpool":
            k, s = int(sec["size"]), int(sec.get("stride", 1))
            pad = int(sec.get("padding", k - 1))  # darknet pads pad // 2 before, the rest after
            y = g.node("MaxPool", [x], name, kernel_shape=[k, k], strides=[s, s],
                       pads=[pad // 2, pad // 2, pad - pad // 2, pad - pad // 2])
            h, w = (h + pad - k) // s + 1, (w + pad - k) // s + 1
        elif kind == "upsample":
            s = int(sec.get("stride", 2))
            scales = g.const(f"{name}.scales", np.array([1, 1, s, s], np.float32))
            y = g.node("Resize", [x, "", scales], name, mode="nearest",
                       coordinate_transformation_mode="asymmetric", nearest_mode="floor")
            h, w = h * s, w * s
        elif kind == "route":
            sources = [layers[j if j >= 0 else i + j] for j in map(int, sec["layers"].split(","))]
            y = (sources[0][0] if len(sources) == 1
                 else g.node("Concat", [src[0] for src in sources], name, axis=1))
            c, h, w = sum(src[1] for src in sources), sources[0][2], sources[0][3]
        elif kind == "yolo":
            heads.append(_decode_head(g, name, x, sec, (h, w), input_size))
            y = x
        else:
            raise ValueError(f"{cfg_path}: layer {i} [{kind}] is not supported")
        layers.append((y, c, h, w))
    if pos != weights.size:
        raise ValueError(f"{weights_path}: {weights.size - pos} values left over after {cfg_path}")
    if not heads or len({nc for _, nc, _ in heads}) != 1:
        raise ValueError(f"{cfg_path}: needs [yolo] heads that agree on the number of classes")
    nc, total = heads[0][1], sum(n for _, _, n in heads)
    g.node("Concat", [t for t, _, _ in heads], "output0", axis=2)
    graph = helper.make_graph(
        g.nodes, Path(cfg_path).stem,
        [helper.make_tensor_value_info("images", TensorProto.FLOAT,
                                       ["batch", 3, input_size, input_size])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["batch", 4 + nc, total])],
        g.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="streamdet.samples.darknet")
    model.ir_version = 8  # the IR of opset 17, readable by older runtimes and TensorRT
    metadata = {"imgsz": str([input_size, input_size])}
    if names is not None:
        metadata["names"] = str(dict(enumerate(names)))
    onnx.helper.set_model_props(model, metadata)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(onnx_path))
    return model
