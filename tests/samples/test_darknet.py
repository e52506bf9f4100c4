"""The converted yolov3-tiny ONNX, checked against an independent NumPy forward of the cfg.

OpenCV 5 dropped its darknet importer (cv2.dnn.readNetFromDarknet), so the reference is a
plain NumPy implementation of darknet's layers written here, sharing no code with the
converter: its own cfg and weights reading, unfused batch norm, im2col convolution.
"""

from __future__ import annotations

import av
import cv2
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from samples.darknet import convert_darknet
from stages.backends.base import read_model_info

SIZE = 416
FRAMES = (34, 100, 125, 158)


def letterbox(rgb: np.ndarray) -> tuple[np.ndarray, float, np.ndarray]:
    """(H, W, 3) uint8 RGB -> (3, 416, 416) float32 in 0..1 padded with grey, scale, (left, top)."""
    h, w = rgb.shape[:2]
    scale = SIZE / max(h, w)
    nh, nw = round(h * scale), round(w * scale)
    top, left = (SIZE - nh) // 2, (SIZE - nw) // 2
    out = np.full((SIZE, SIZE, 3), 114, np.uint8)
    out[top:top + nh, left:left + nw] = cv2.resize(rgb, (nw, nh), interpolation=cv2.INTER_LINEAR)
    return out.transpose(2, 0, 1).astype(np.float32) / 255, scale, np.array([left, top])


@pytest.fixture(scope="module")
def frames(samples) -> dict[int, tuple[np.ndarray, float, np.ndarray]]:
    """Letterboxed frames of bikes.mp4 by index: ((3, 416, 416) float32, scale, (left, top))."""
    out = {}
    with av.open(str(samples.bikes)) as container:
        for i, frame in enumerate(container.decode(video=0)):
            if i in FRAMES:
                out[i] = letterbox(frame.to_ndarray(format="rgb24"))
            if i >= max(FRAMES):
                return out
    raise AssertionError(f"bikes.mp4 has fewer than {max(FRAMES) + 1} frames")


@pytest.fixture(scope="module")
def session(samples) -> ort.InferenceSession:
    return ort.InferenceSession(str(samples.model), providers=["CPUExecutionProvider"])


def run(session: ort.InferenceSession, batch: np.ndarray) -> np.ndarray:
    return session.run(["output0"], {"images": batch})[0]


# ---- the independent reference ---------------------------------------------------------------

def read_cfg(path) -> list[dict[str, str]]:
    sections = []
    for line in open(path).read().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("["):
            sections.append({"type": line[1:-1]})
        elif "=" in line:
            key, value = line.split("=")
            sections[-1][key.strip()] = value.strip()
    return sections[1:]


def reference_forward(cfg, weights, image: np.ndarray) -> np.ndarray:
    """Darknet's forward of one (3, H, W) image; returns (4 + classes, anchors) like output0."""
    sigmoid = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    values = np.fromfile(weights, np.float32, offset=20)  # header: 3 int32 + int64 "seen"
    pos, x, outputs, decoded = 0, image.astype(np.float32), [], []

    def take(n: int) -> np.ndarray:
        nonlocal pos
        pos += n
        return values[pos - n:pos]

    for i, layer in enumerate(read_cfg(cfg)):
        kind = layer["type"]
        if kind == "convolutional":
            c, n, k = x.shape[0], int(layer["filters"]), int(layer["size"])
            bn = layer.get("batch_normalize") == "1"
            bias = take(n)
            gamma, mean, var = (take(n), take(n), take(n)) if bn else (None, None, None)
            w = take(n * c * k * k).reshape(n, c * k * k)
            p = k // 2
            padded = np.pad(x, ((0, 0), (p, p), (p, p)))
            windows = np.lib.stride_tricks.sliding_window_view(padded, (k, k), axis=(1, 2))
            cols = windows.transpose(0, 3, 4, 1, 2).reshape(c * k * k, -1)  # stride is 1 here
            y = (w @ cols).reshape(n, x.shape[1], x.shape[2])
            if bn:
                y = (y - mean[:, None, None]) / (np.sqrt(var)[:, None, None] + 1e-6)
                y = y * gamma[:, None, None]
            y = y + bias[:, None, None]
            x = np.where(y > 0, y, 0.1 * y) if layer["activation"] == "leaky" else y
        elif kind == "maxpool":
            k, s = int(layer["size"]), int(layer["stride"])
            padded = np.pad(x, ((0, 0), (0, k - 1), (0, k - 1)), constant_values=-np.inf)
            windows = np.lib.stride_tricks.sliding_window_view(padded, (k, k), axis=(1, 2))
            x = windows[:, ::s, ::s].max(axis=(3, 4))
        elif kind == "upsample":
            x = x.repeat(2, axis=1).repeat(2, axis=2)
        elif kind == "route":
            picked = [int(j) if int(j) >= 0 else i + int(j) for j in layer["layers"].split(",")]
            x = np.concatenate([outputs[j] for j in picked])
        elif kind == "yolo":
            anchors = np.array(layer["anchors"].split(","), np.float32).reshape(-1, 2)
            h, w = x.shape[1:]
            stride = SIZE / w
            for a, m in enumerate(int(v) for v in layer["mask"].split(",")):
                t = x[a * 85:(a + 1) * 85]
                gy, gx = np.mgrid[0:h, 0:w]
                box = [(sigmoid(t[0]) + gx) * stride, (sigmoid(t[1]) + gy) * stride,
                       np.exp(t[2]) * anchors[m, 0], np.exp(t[3]) * anchors[m, 1]]
                scores = sigmoid(t[5:]) * sigmoid(t[4])
                decoded.append(np.concatenate([np.stack(box), scores]).reshape(84, h * w))
        outputs.append(x)
    assert pos == values.size, "the cfg did not use every weight"
    return np.concatenate(decoded, axis=1)


def detect(output: np.ndarray, threshold: float, scale: float, offset: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray]:
    """(84, anchors) -> class ids (N,) and frame xyxy boxes (N, 4) of anchors above threshold."""
    keep = output[4:].max(axis=0) > threshold
    classes, (cx, cy, w, h) = output[4:, keep].argmax(axis=0), output[:4, keep]
    xyxy = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1)
    return classes, (xyxy - np.tile(offset, 2)) / scale


def iou(boxes: np.ndarray, box: tuple[int, int, int, int]) -> np.ndarray:
    """IoU of xyxy boxes (N, 4) with one box."""
    wh = np.clip(np.minimum(boxes[:, 2:], box[2:]) - np.maximum(boxes[:, :2], box[:2]), 0, None)
    inter = wh.prod(axis=1)
    area = (boxes[:, 2:] - boxes[:, :2]).prod(axis=1)
    return inter / (area + (box[2] - box[0]) * (box[3] - box[1]) - inter)


# ---- tests -----------------------------------------------------------------------------------

def test_io_names_dtypes_and_symbolic_batch(samples):
    model = onnx.load(str(samples.model))
    dims = [[d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in (model.graph.input[0], model.graph.output[0])]
    assert [v.name for v in model.graph.input] == ["images"]
    assert [v.name for v in model.graph.output] == ["output0"]
    assert dims == [["batch", 3, SIZE, SIZE], ["batch", 84, 2535]]
    assert {v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.output)} == {
        onnx.TensorProto.FLOAT}
    assert model.opset_import[0].version == 17
    info = read_model_info(samples.model)
    assert (info.num_classes, info.dynamic_batch, info.input_height) == (80, True, SIZE)


def test_matches_numpy_reference(samples, frames, session):
    expected = reference_forward(samples.cfg, samples.weights, frames[125][0])
    got = run(session, frames[125][0][None])[0]
    np.testing.assert_allclose(got[:4], expected[:4], rtol=1e-5, atol=1e-3)  # pixels
    np.testing.assert_allclose(got[4:], expected[4:], rtol=1e-4, atol=1e-5)  # scores


# Objects seen by eye in bikes.mp4 (no frame shows all three classes clearly at once).
@pytest.mark.parametrize("frame, name, box", [
    (34, "person", (215, 0, 440, 272)),  # man in a suit, centre
    (34, "car", (0, 95, 230, 272)),  # car on the left
    (125, "person", (380, 0, 490, 272)),  # cyclist in black
    (125, "bicycle", (380, 170, 525, 272)),  # his bicycle
])
def test_detects_objects_where_they_are(samples, frames, session, frame, name, box):
    image, scale, offset = frames[frame]
    classes, boxes = detect(run(session, image[None])[0], 0.3, scale, offset)
    names = np.array(samples.names.read_text().splitlines())
    assert iou(boxes[names[classes] == name], box).max(initial=0) > 0.5, (names[classes], boxes)


def test_batch_of_four_equals_four_batches_of_one(frames, session):
    batch = np.stack([frames[i][0] for i in FRAMES])
    singles = np.concatenate([run(session, image[None]) for image in batch])
    together = run(session, batch)
    assert together.shape == (4, 84, 2535) and together.dtype == np.float32
    np.testing.assert_allclose(together, singles, rtol=1e-5, atol=1e-4)


def same(value):
    return value


@pytest.mark.parametrize("edit_cfg, edit_weights, message", [
    pytest.param(lambda cfg: cfg.replace("[upsample]", "[shortcut]"), same,
                 "[shortcut] is not supp", id="unknown-layer"),
    pytest.param(lambda cfg: cfg.replace("activation=leaky", "activation=mish", 1), same,
                 "'mish' is not supp", id="unknown-activation"),
    pytest.param(same, lambda w: w[:-4000], "too short", id="short-weights"),
    pytest.param(same, lambda w: w + bytes(8), "2 values left over", id="long-weights"),
])
def test_converter_rejects_what_it_cannot_convert(samples, tmp_path, edit_cfg, edit_weights,
                                                  message):
    cfg, weights = tmp_path / "m.cfg", tmp_path / "m.weights"
    cfg.write_text(edit_cfg(samples.cfg.read_text()))
    weights.write_bytes(edit_weights(samples.weights.read_bytes()))
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        convert_darknet(cfg, weights, tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()
