"""The torch backend: onnx2torch conversion, the capture-safe rewrite, CUDA graphs.

On the CPU: the converted model against onnxruntime on real frames, and the capture-safe
rewrite (same outputs as onnx2torch's module; a forward on the ``meta`` device, where reading
any device value on the host raises, succeeds). The @pytest.mark.gpu tests run FP16 CUDA
graphs on CuPy streams against FP32 eager on a real GPU.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import av
import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from kernels.preprocess import letterbox_geometry, preprocess_reference
from stages.backends.base import read_model_info

torch = pytest.importorskip("torch", reason="torch is not installed (extra: torch)")
onnx2torch = pytest.importorskip("onnx2torch", reason="onnx2torch is not installed (extra: torch)")
from stages.backends.torch import TorchBackend, make_capture_safe  # noqa: E402

warnings.filterwarnings("ignore", module="onnx2torch")  # its Resize warns about nearest modes
FIRST_FRAME = 100


@pytest.fixture(scope="module")
def frames(samples) -> np.ndarray:
    """(4, 3, 416, 416) float32: frames 100..103 of bikes.mp4, letterboxed like the pipeline."""
    info = read_model_info(samples.model)
    out = []
    with av.open(str(samples.bikes)) as container:
        for index, frame in enumerate(container.decode(video=0)):
            if index >= FIRST_FRAME:
                lb = letterbox_geometry(frame.width, frame.height, info.input_width,
                                        info.input_height)
                out.append(preprocess_reference(frame.to_ndarray(format="yuv420p"), frame.width,
                                                frame.height, lb))
            if len(out) == 4:
                return np.stack(out)
    raise AssertionError("bikes.mp4 is shorter than expected")


def tiny_model(path: Path, split_from: str = "initializer", reshape_from: str = "initializer",
               height_as_data: bool = False, batch: int | str = "batch") -> Path:
    """A YOLO-layout ONNX model (B,3,8,8) -> (B, 6, 64) with a Split of constant sizes.

    Conv -> Split [2, 4] on channels -> Mul(first part, 2.0) -> Concat -> Reshape (B, 6, 64).
    ``split_from``: the sizes as an "initializer" or a "constant" node; ``reshape_from``: the
    Reshape's shape as an "initializer" or from the input's "shape" (Shape, Gather, Unsqueeze,
    Concat); ``height_as_data``: also divide by the height read with Shape (a Shape feeding
    data); ``batch``: a symbolic batch or a fixed one (then the reshape hard-codes it).
    """
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=(6, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(np.float32(2.0), "two"),
             numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([6, -1], np.int64), "tail")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])]
    if split_from == "initializer":
        inits.append(numpy_helper.from_array(np.array([2, 4], np.int64), "sizes"))
    else:
        nodes.append(helper.make_node("Constant", [], ["sizes"], value_ints=[2, 4]))
    nodes += [helper.make_node("Split", ["y", "sizes"], ["a", "b"], axis=1),
              helper.make_node("Mul", ["a", "two"], ["a2"]),
              helper.make_node("Concat", ["b", "a2"], ["c"], axis=1)]
    if reshape_from == "initializer":
        inits.append(numpy_helper.from_array(
            np.array([batch if isinstance(batch, int) else 0, 6, -1], np.int64), "shape"))
    else:
        nodes += [helper.make_node("Shape", ["c"], ["c_shape"]),
                  helper.make_node("Gather", ["c_shape", "zero"], ["n"], axis=0),
                  helper.make_node("Concat", ["n", "tail"], ["shape"], axis=0)]
    nodes.append(helper.make_node("Reshape", ["c", "shape"], ["r" if height_as_data else "out"]))
    if height_as_data:
        inits.append(numpy_helper.from_array(np.array(2, np.int64), "two_i"))
        nodes += [helper.make_node("Shape", ["y"], ["y_shape"]),
                  helper.make_node("Gather", ["y_shape", "two_i"], ["h"], axis=0),
                  helper.make_node("Cast", ["h"], ["h_f"], to=TensorProto.FLOAT),
                  helper.make_node("Div", ["r", "h_f"], ["out"])]
    graph = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 8, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [batch, 6, 64])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return path


TINY_VARIANTS = {
    "split-initializer": {},
    "split-constant-node": {"split_from": "constant"},
    "reshape-from-shape": {"reshape_from": "shape"},
    "shape-feeds-data": {"reshape_from": "shape", "height_as_data": True},
}


@pytest.fixture(params=[*TINY_VARIANTS, "yolov3-tiny"])
def model_and_input(request, tmp_path, samples, frames) -> tuple[Path, np.ndarray]:
    """(ONNX path, a real-valued input batch) for each tiny variant and the sample model."""
    if request.param == "yolov3-tiny":
        return samples.model, frames[:2]
    x = np.random.default_rng(1).random((3, 3, 8, 8), dtype=np.float32)
    return tiny_model(tmp_path / "tiny.onnx", **TINY_VARIANTS[request.param]), x


@torch.inference_mode()
def test_capture_safe_rewrite_keeps_outputs(model_and_input) -> None:
    path, x = model_and_input
    raw = onnx2torch.convert(str(path)).eval()
    safe = make_capture_safe(copy.deepcopy(raw))
    session = onnxruntime.InferenceSession(str(path))
    expected = session.run(None, {session.get_inputs()[0].name: x})[0]
    got = safe(torch.from_numpy(x))
    assert torch.equal(got, raw(torch.from_numpy(x)))
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@torch.inference_mode()
def test_capture_safe_forward_reads_no_device_value(model_and_input) -> None:
    """On ``meta`` every host read of a device tensor raises, as it fails in a CUDA capture."""
    path, x = model_and_input
    raw = onnx2torch.convert(str(path)).eval()
    safe = make_capture_safe(copy.deepcopy(raw)).to("meta")
    x_meta = torch.empty(x.shape, device="meta")
    assert safe(x_meta).shape[0] == x.shape[0]
    with pytest.raises(RuntimeError, match="meta"):  # each model here has a Split, at least
        raw.to("meta")(x_meta)


@pytest.mark.parametrize("channels_last", [False, True])
def test_backend_matches_onnxruntime_on_real_frames(samples, frames, channels_last) -> None:
    info = read_model_info(samples.model)
    backend = TorchBackend(samples.model, info, 2, "fp32", None, device="cpu", cuda_graphs=False,
                           channels_last=channels_last)
    assert backend.warmup().shape == (2, 84, 2535)
    expected = onnxruntime.InferenceSession(str(samples.model)).run(None, {"images": frames[:2]})[0]
    got = backend.infer(frames[:2])
    assert got.shape == (2, 84, 2535) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    assert (got[:, 4:].max(axis=(1, 2)) > 0.1).all()  # objects found, not noise


def test_fixed_batch_model_runs_image_by_image(tmp_path) -> None:
    path = tiny_model(tmp_path / "tiny.onnx", batch=1)
    info = read_model_info(path)
    assert not info.dynamic_batch
    backend = TorchBackend(path, info, 3, "fp32", None, device="cpu")
    x = np.random.default_rng(2).random((3, 3, 8, 8), dtype=np.float32)
    session = onnxruntime.InferenceSession(str(path))
    expected = np.concatenate([session.run(None, {"x": x[i:i + 1]})[0] for i in range(3)])
    np.testing.assert_allclose(backend.infer(x), expected, rtol=1e-5, atol=1e-5)


def test_fp16_input_dtype_and_buffer(tmp_path) -> None:
    path = tiny_model(tmp_path / "tiny.onnx")
    info = read_model_info(path)
    half = TorchBackend(path, info, 2, "fp16", None, device="cpu")
    full = TorchBackend(path, info, 2, "fp32", None, device="cpu")
    assert (half.input_dtype, full.input_dtype) == (np.float16, np.float32)
    buffer = half.input_buffer(2)
    assert buffer.shape == (2, 3, 8, 8) and buffer.dtype == np.float16
    x = np.random.default_rng(3).random((2, 3, 8, 8), dtype=np.float32)
    buffer[...] = x
    got = half.infer(buffer)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got, full.infer(x), rtol=1e-2, atol=2e-2)
    np.testing.assert_array_equal(half.infer(x), got)  # float32 input is cast the same way


@pytest.mark.parametrize(("precision", "device", "message"), [
    ("int8", "cpu", "int8' needs the tensorrt backend"),
    ("bf16", "cpu", "precision must be one of"),
    ("fp16", "tpu", "device 'cuda' or 'cpu'"),
])
def test_rejects_bad_settings(samples, precision, device, message) -> None:
    with pytest.raises(ValueError, match=message):
        TorchBackend(samples.model, read_model_info(samples.model), 1, precision, None,
                     device=device)


def test_rejects_bad_batch(tmp_path) -> None:
    path = tiny_model(tmp_path / "tiny.onnx")
    backend = TorchBackend(path, read_model_info(path), 2, "fp32", None, device="cpu")
    for shape in [(3, 3, 8, 8), (0, 3, 8, 8), (1, 3, 8, 9)]:
        with pytest.raises(ValueError, match=r"images must be \(1..2, 3, 8, 8\)"):
            backend.infer(np.zeros(shape, np.float32))


# --- real GPU: FP16 CUDA graphs on CuPy streams ---------------------------------------------


@pytest.fixture(scope="module")
def gpu():
    """The pipeline's GpuContext on device 0, or skip with the reason."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    from pipeline.gpu import GpuContext

    return GpuContext(0), cupy


@pytest.fixture(scope="module")
def gpu_backends(gpu, samples):
    """(fp16 CUDA-graph backend warmed up at max_batch 4, fp32 eager backend)."""
    context, _ = gpu
    info = read_model_info(samples.model)
    half = TorchBackend(samples.model, info, 4, "fp16", context)
    assert half.warmup().shape == (4, 84, 2535)
    full = TorchBackend(samples.model, info, 4, "fp32", context, cuda_graphs=False)
    full.warmup()
    return half, full


def assert_fp16_close(got: np.ndarray, expected: np.ndarray) -> None:
    """Scores within 0.02, boxes (pixels, up to ~416) within 1% + 2 px of the FP32 result."""
    np.testing.assert_allclose(got[:, 4:], expected[:, 4:], atol=0.02)
    np.testing.assert_allclose(got[:, :4], expected[:, :4], rtol=0.01, atol=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [pytest.param(4, id="4-captured-by-warmup"),
                                   pytest.param(1, id="1-captured-lazily"),
                                   pytest.param(4, id="4-replayed-after-1")])
def test_fp16_graphs_match_fp32_eager(gpu, gpu_backends, frames, batch) -> None:
    context, cupy = gpu
    half, full = gpu_backends
    stream = context.compute_stream
    with stream:
        x = cupy.asarray(frames[:batch])
        expected = cupy.asnumpy(full.infer(x, stream))
        buffer = half.input_buffer(batch)
        buffer[...] = x  # preprocess writes fp16 straight into the graph's input
        out = half.infer(buffer, stream)
        got = cupy.asnumpy(out)
    assert out.shape == (batch, 84, 2535) and out.dtype == np.float16
    assert_fp16_close(got.astype(np.float32), expected)
    assert (got[:, 4:].max(axis=(1, 2)) > 0.1).all()


@pytest.mark.gpu
def test_graph_replays_on_the_stream_without_copies(gpu, gpu_backends, frames, monkeypatch) -> None:
    """The input buffer path copies nothing; a foreign float32 array is copied once and cast."""
    context, cupy = gpu
    half, _ = gpu_backends
    stream = cupy.cuda.Stream(non_blocking=True)  # any stream of the pipeline's, not only compute
    copies = []
    original = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda t, *a, **k: copies.append(1)
                        or original(t, *a, **k))
    with stream:
        buffer = half.input_buffer(2)
        buffer[...] = cupy.asarray(frames[:2])
        first = half.infer(buffer, stream)
        from_buffer = cupy.asnumpy(first)
        assert copies == []
        second = half.infer(cupy.asarray(frames[:2]), stream)  # float32, not the buffer
        from_copy = cupy.asnumpy(second)
    assert copies == [1]
    assert first.data.ptr == second.data.ptr  # the graph's static output, no allocation
    np.testing.assert_array_equal(from_copy, from_buffer)


@pytest.mark.gpu
def test_eager_fp16_matches_graph(gpu, gpu_backends, samples, frames) -> None:
    context, cupy = gpu
    half, _ = gpu_backends
    eager = TorchBackend(samples.model, read_model_info(samples.model), 4, "fp16", context,
                         cuda_graphs=False)
    stream = context.compute_stream
    with stream:
        x = cupy.asarray(frames[:3].astype(np.float16))
        got = cupy.asnumpy(eager.infer(x, stream)).astype(np.float32)
        graph = cupy.asnumpy(half.infer(x, stream)).astype(np.float32)
    np.testing.assert_allclose(got, graph, rtol=1e-2, atol=0.05)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", TINY_VARIANTS)
def test_graphs_capture_every_rewritten_case(gpu, tmp_path, variant) -> None:
    """Constants, Constant nodes, a Shape read as sizes and a Shape feeding data all capture."""
    context, cupy = gpu
    path = tiny_model(tmp_path / "tiny.onnx", **TINY_VARIANTS[variant])
    backend = TorchBackend(path, read_model_info(path), 3, "fp32", context)
    x = np.random.default_rng(4).random((3, 3, 8, 8), dtype=np.float32)
    expected = onnxruntime.InferenceSession(str(path)).run(None, {"x": x})[0]
    stream = context.compute_stream
    with stream:
        got = [cupy.asnumpy(backend.infer(cupy.asarray(x[:b]), stream)) for b in (3, 2, 3)]
    assert backend.cuda_graphs  # no capture fell back to eager
    for b, out in zip((3, 2, 3), got):  # fp32 convolutions may run in TF32 on the GPU
        np.testing.assert_allclose(out, expected[:b], rtol=1e-2, atol=1e-2)
