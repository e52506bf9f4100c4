"""The torch backend: onnx2torch conversion, the capture-safe rewrite, CUDA graphs.

On the CPU: the converted model against onnxruntime on real frames, and the capture-safe
rewrite (same outputs as onnx2torch's module; a forward on the ``meta`` device, where reading
any device value on the host raises, succeeds). The @pytest.mark.gpu tests run FP16 CUDA
graphs on CuPy streams against FP32 eager on a real GPU.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

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
from stages.backends.torch import (  # noqa: E402
    CompileKey,
    SizeListReshape,
    TorchBackend,
    compile_cache_key,
    make_capture_safe,
    make_compile_friendly,
    prepare_module,
)

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


def test_a_module_prepared_ahead_gives_what_one_converted_here_gives(samples, frames) -> None:
    """A standby engine's module (converted before any GPU work) builds the same backend."""
    info = read_model_info(samples.model)
    prepared = prepare_module(samples.model, compile=False)
    ahead = TorchBackend(samples.model, info, 2, "fp32", None, device="cpu", cuda_graphs=False,
                         module=prepared)
    here = TorchBackend(samples.model, info, 2, "fp32", None, device="cpu", cuda_graphs=False)
    assert ahead.module is prepared and ahead.build_seconds["convert"] < 0.05
    np.testing.assert_array_equal(ahead.infer(frames[:2]), here.infer(frames[:2]))


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


# --- compile: cache key, defaults, the compile-friendly rewrite (CPU, nothing compiled) -------


def test_compile_cache_key_changes_with_every_field(tmp_path) -> None:
    first = tiny_model(tmp_path / "a.onnx")
    second = tiny_model(tmp_path / "b.onnx", split_from="constant")  # other bytes
    key = compile_cache_key(first, "NVIDIA H200 sm_90", "fp16", 64, True)
    assert key == compile_cache_key(first, "NVIDIA H200 sm_90", "fp16", 64, True)
    assert key.torch_version == torch.__version__
    assert key.folder(tmp_path) == tmp_path / f"torch-{key.digest()}"
    variants = [compile_cache_key(second, "NVIDIA H200 sm_90", "fp16", 64, True),
                dataclasses.replace(key, gpu="NVIDIA H100 sm_90"),
                dataclasses.replace(key, gpu="NVIDIA H200 sm_100"),
                dataclasses.replace(key, torch_version="2.12.0+cu130"),
                dataclasses.replace(key, precision="fp32"),
                dataclasses.replace(key, max_batch=32),
                dataclasses.replace(key, channels_last=False)]
    assert {f.name for f in dataclasses.fields(CompileKey)} == {
        "model_sha256", "gpu", "torch_version", "precision", "max_batch", "channels_last"}
    digests = {key.digest(), *(v.digest() for v in variants)}
    assert len(digests) == len(variants) + 1
    assert all(len(d) == 16 for d in digests)


def test_channels_last_defaults_to_compile(tmp_path) -> None:
    path = tiny_model(tmp_path / "tiny.onnx")
    info = read_model_info(path)
    compiled = TorchBackend(path, info, 2, "fp32", None, device="cpu", compile=True,
                            cache_dir=tmp_path / "cache")  # compiles lazily: nothing runs here
    plain = TorchBackend(path, info, 2, "fp32", None, device="cpu")
    forced = TorchBackend(path, info, 2, "fp32", None, device="cpu", compile=True,
                          channels_last=False)
    assert (compiled.channels_last, plain.channels_last, forced.channels_last) == (
        True, False, False)
    assert compiled.cache_key.folder(tmp_path / "cache").is_dir()
    assert plain.cache_key is None and not plain.compiled


@torch.inference_mode()
def test_compile_friendly_rewrite_keeps_outputs(model_and_input) -> None:
    path, x = model_and_input
    safe = make_capture_safe(onnx2torch.convert(str(path)).eval())
    expected = safe(torch.from_numpy(x))
    assert torch.equal(make_compile_friendly(safe)(torch.from_numpy(x)), expected)


# onnx2torch modules that read sizes from tensors (a dynamo graph break each, where constant).
SIZE_READING_MODULES = ("OnnxReshape", "OnnxSplit13", "OnnxResize", "OnnxResizeV10", "OnnxSlice")
SAMPLE_MODELS = {"yolov3-tiny": 416, "yolov8s-fall": 640}  # model name: input size


@pytest.fixture(params=SAMPLE_MODELS)
def sample_model(request, samples) -> tuple[Path, int]:
    """(ONNX path, input size) of yolov3-tiny and of yolov8s-fall (a real Ultralytics export,
    dynamic batch, 4 Reshapes with a 0 for the batch, Slices, Resizes; fetched only for the
    benchmarks, so skipped where it is missing)."""
    path = samples.model.parent / f"{request.param}.onnx"
    if not path.exists():
        pytest.skip(f"{path} is missing (samples/yolov8.py fetches it)")
    return path, SAMPLE_MODELS[request.param]


def explain(module: torch.nn.Module, x: torch.Tensor, dynamic_batch: bool) -> Any:
    """``torch._dynamo.explain`` of a forward, the batch dimension marked dynamic as the backend
    does for batches > 1."""
    torch._dynamo.reset()
    if dynamic_batch:
        torch._dynamo.mark_dynamic(x, 0)
    with torch.inference_mode():
        return torch._dynamo.explain(module)(x)


@pytest.mark.slow
@torch.inference_mode()
def test_compile_friendly_sample_models_equal_onnx2torch(sample_model) -> None:
    """Constant sizes baked into the graph: the same outputs, bit for bit, at batch 1 and 3."""
    path, size = sample_model
    raw = onnx2torch.convert(str(path)).eval()
    friendly = make_compile_friendly(make_capture_safe(copy.deepcopy(raw)))
    left = {type(m).__name__ for m in friendly.modules()} & {*SIZE_READING_MODULES,
                                                            SizeListReshape.__name__}
    assert not left, f"not baked: {left}"
    x = torch.from_numpy(np.random.default_rng(5).random((3, 3, size, size), dtype=np.float32))
    for batch in (1, 3):
        assert torch.equal(friendly(x[:batch]), raw(x[:batch]))


@pytest.mark.slow
@pytest.mark.parametrize("dynamic_batch", [True, False], ids=["dynamic-batch", "batch-1"])
def test_compile_friendly_sample_models_have_no_graph_breaks(sample_model, dynamic_batch) -> None:
    """dynamo traces the whole model as one graph, for the dynamic batch (2..max_batch) and for
    batch 1 (specialised), as the backend compiles it; the capture-safe module alone breaks at
    every size-reading module (5 for yolov3-tiny, 15 for yolov8s-fall)."""
    path, size = sample_model
    module = make_compile_friendly(make_capture_safe(onnx2torch.convert(str(path)).eval()))
    x = torch.rand(3 if dynamic_batch else 1, 3, size, size)
    result = explain(module, x, dynamic_batch)
    assert (result.graph_count, result.graph_break_count) == (1, 0), [
        r.reason for r in result.break_reasons]


@pytest.mark.parametrize(("variant", "breaks"), [
    ("split-initializer", 0),
    ("split-constant-node", 0),
    # The Reshape's shape comes from a Shape at run time (Shape, Gather, Concat): SizeListReshape
    # reads it with tolist(), a data-dependent graph break, as before the rewrite. One break
    # where the Reshape ends the model (2 graphs); 2 where ops follow it (3 graphs: before it,
    # the Reshape, after it). The sample models have no such Reshape.
    ("reshape-from-shape", 1),
    ("shape-feeds-data", 2),
])
def test_compile_friendly_tiny_graph_breaks(tmp_path, variant, breaks) -> None:
    path = tiny_model(tmp_path / "tiny.onnx", **TINY_VARIANTS[variant])
    module = make_compile_friendly(make_capture_safe(onnx2torch.convert(str(path)).eval()))
    result = explain(module, torch.rand(3, 3, 8, 8), dynamic_batch=True)
    assert result.graph_break_count <= breaks, [r.reason for r in result.break_reasons]
    assert all(r.user_stack[-1].name == "forward" and "tolist" in r.user_stack[-1].line
               for r in result.break_reasons), [r.user_stack for r in result.break_reasons]


def slice_resize_model(path: Path) -> Path:
    """(2,3,8,8) -> Slice (reversed, every 2nd column; rows 1..6) -> Resize to sizes (2,3,12,8)
    -> Slice (channels 1.., a negative axis) -> Resize by scales 2: the rarer Slice and Resize
    forms the sample models do not have."""
    inits = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in [
        ("starts", [-1, 1]), ("ends", [-(2 ** 63), 7]), ("axes", [-1, 2]), ("steps", [-2, 1]),
        ("sizes", [2, 3, 12, 8]), ("starts2", [1]), ("ends2", [2 ** 63 - 1]), ("axes2", [-3])]]
    inits.append(numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"))
    nodes = [helper.make_node("Slice", ["x", "starts", "ends", "axes", "steps"], ["a"]),
             helper.make_node("Resize", ["a", "", "", "sizes"], ["b"], mode="nearest",
                              coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
             helper.make_node("Slice", ["b", "starts2", "ends2", "axes2"], ["c"]),
             helper.make_node("Resize", ["c", "", "scales"], ["out"], mode="nearest",
                              coordinate_transformation_mode="asymmetric", nearest_mode="floor")]
    graph = helper.make_graph(
        nodes, "slices", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 2, 24, 16])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return path


@torch.inference_mode()
def test_compile_friendly_bakes_slices_and_resizes(tmp_path) -> None:
    """Negative steps and axes, INT64 bounds, Resize to sizes and by scales: baked, equal to
    onnx2torch and onnxruntime, no graph break."""
    path = slice_resize_model(tmp_path / "slices.onnx")
    raw = onnx2torch.convert(str(path)).eval()
    friendly = make_compile_friendly(make_capture_safe(copy.deepcopy(raw)))
    left = {type(m).__name__ for m in friendly.modules()} & set(SIZE_READING_MODULES)
    assert not left, f"not baked: {left}"
    x = np.random.default_rng(6).random((2, 3, 8, 8), dtype=np.float32)
    got = friendly(torch.from_numpy(x))
    assert got.shape == (2, 2, 24, 16)
    assert torch.equal(got, raw(torch.from_numpy(x)))
    expected = onnxruntime.InferenceSession(str(path)).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got.numpy(), expected)
    result = explain(friendly, torch.from_numpy(x), dynamic_batch=False)
    assert (result.graph_count, result.graph_break_count) == (1, 0)


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
    """(fp16 CUDA-graph backend warmed up at max_batch 4: buckets 2, 4; fp32 eager)."""
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
@pytest.mark.parametrize("batch", [pytest.param(4, id="4-a-bucket"),
                                   pytest.param(3, id="3-padded-to-4"),
                                   pytest.param(1, id="1-padded-to-2")])
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


@pytest.mark.gpu
def test_a_padded_batch_gives_the_exact_batch_rows(gpu, samples, frames) -> None:
    """A batch of 2 runs in bucket 3's graph: its rows equal those of a batch of 3 with the
    same first frames, whatever the padding row holds (noise here), and only 2 rows return."""
    context, cupy = gpu
    backend = TorchBackend(samples.model, read_model_info(samples.model), 4, "fp16", context,
                           buckets=[3])
    assert backend.buckets == [3, 4]
    backend.warmup()
    stream = context.compute_stream
    noise = np.random.default_rng(5).random(frames[0].shape, dtype=np.float32)
    with stream:
        exact = backend.input_buffer(3)
        exact[...] = cupy.asarray(np.stack([frames[0], frames[1], frames[2]]))
        expected = cupy.asnumpy(backend.infer(exact, stream))[:2]
        backend.input_buffer(3)[2] = cupy.asarray(noise)  # the padding row
        padded = backend.input_buffer(2)
        padded[...] = cupy.asarray(frames[:2])
        out = backend.infer(padded, stream)
        got = cupy.asnumpy(out)
    assert out.shape[0] == 2 and sorted(backend._graphs) == [3, 4]
    np.testing.assert_allclose(got.astype(np.float32), expected.astype(np.float32), atol=1e-3)
    assert (got[:, 4:].max(axis=(1, 2)) > 0.1).all()


def test_rejects_buckets_past_max_batch(samples) -> None:
    with pytest.raises(ValueError, match="buckets must be batch sizes 1..4"):
        TorchBackend(samples.model, read_model_info(samples.model), 4, "fp32", None,
                     device="cpu", buckets=[2, 8])


# --- real GPU: torch.compile (inductor, default mode) inside our CUDA graphs -----------------

COMPILED_MAX_BATCH = 8


@pytest.fixture(scope="module")
def compiled_backend(gpu, samples, tmp_path_factory):
    """fp16 compiled backend, max_batch 8, warmed up (the buckets 2, 4, 8 captured)."""
    context, _ = gpu
    backend = TorchBackend(samples.model, read_model_info(samples.model), COMPILED_MAX_BATCH,
                           "fp16", context, compile=True,
                           cache_dir=tmp_path_factory.mktemp("compile-cache"))
    assert backend.warmup().shape == (COMPILED_MAX_BATCH, 84, 2535)
    assert backend.compiled, "compilation failed and fell back to eager: see the log"
    assert backend.channels_last and backend.cuda_graphs
    assert sorted(backend._graphs) == [2, 4, COMPILED_MAX_BATCH]
    assert sorted(backend.capture_seconds) == [2, 4, COMPILED_MAX_BATCH]
    return backend


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 5, COMPILED_MAX_BATCH])
def test_compiled_matches_eager(gpu, gpu_backends, compiled_backend, samples, frames,
                                batch) -> None:
    """Compiled fp16 graphs against the eager fp16 module (no graphs) and fp32; nothing compiles
    or captures after warm-up."""
    from torch._dynamo.utils import counters

    context, cupy = gpu
    _, full = gpu_backends
    eager = TorchBackend(samples.model, read_model_info(samples.model), COMPILED_MAX_BATCH,
                         "fp16", context, cuda_graphs=False)
    images = np.concatenate([frames, frames[::-1]])[:batch]  # real frames, up to 8
    stream = context.compute_stream
    graphs, frames_compiled = dict(compiled_backend._graphs), counters["stats"]["unique_graphs"]
    with stream:
        x = cupy.asarray(images)
        expected = cupy.asnumpy(eager.infer(x, stream)).astype(np.float32)
        reference = cupy.asnumpy(full.infer(x[:min(batch, 4)], stream))
        buffer = compiled_backend.input_buffer(batch)
        buffer[...] = x
        out = compiled_backend.infer(buffer, stream)
        got = cupy.asnumpy(out).astype(np.float32)
    assert out.shape == (batch, 84, 2535) and out.dtype == np.float16
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=0.05)
    assert_fp16_close(got[:4], reference)
    assert (got[:, 4:].max(axis=(1, 2)) > 0.1).all()
    assert compiled_backend._graphs == graphs  # replayed, not captured again
    assert counters["stats"]["unique_graphs"] == frames_compiled  # nothing compiled


@pytest.mark.gpu
def test_compiled_graph_reads_the_input_buffer_without_copies(gpu, compiled_backend, frames,
                                                              monkeypatch) -> None:
    context, cupy = gpu
    copies = []
    original = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda t, *a, **k: copies.append(1)
                        or original(t, *a, **k))
    stream = context.compute_stream
    with stream:
        buffer = compiled_backend.input_buffer(3)
        buffer[...] = cupy.asarray(frames[:3])
        first = compiled_backend.infer(buffer, stream)
        second = compiled_backend.infer(buffer, stream)
        stream.synchronize()
    assert copies == []
    assert first.data.ptr == second.data.ptr  # the graph's static output


READY_SCRIPT = """
import json, sys, warnings
warnings.filterwarnings("ignore")
from stages.backends.base import read_model_info
from stages.backends.torch import TorchBackend
model, cache = sys.argv[1], sys.argv[2]
backend = TorchBackend(model, read_model_info(model), 8, "fp16", None, compile=True,
                       cache_dir=cache)
backend.warmup()
print("RESULT " + json.dumps({"hit": backend.cache_hit, "compiled": backend.compiled,
                              "seconds": backend.ready_seconds}))
"""


def _start_backend_process(repo_root: Path, model: Path, cache: Path) -> dict:
    """Build and warm up a compiled backend in a new Python process; its result line."""
    path = os.pathsep.join(filter(None, [str(repo_root), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-c", READY_SCRIPT, str(model), str(cache)],
                          cwd=repo_root, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.gpu
def test_second_start_hits_the_compile_cache(gpu, repo_root, samples, tmp_path) -> None:
    """Two fresh processes with one cache_dir: the first compiles, the second loads (faster)."""
    cold = _start_backend_process(repo_root, samples.model, tmp_path / "cache")
    warm = _start_backend_process(repo_root, samples.model, tmp_path / "cache")
    print(f"\ncompiled backend ready: cold start {cold['seconds']:.1f} s (cache hit "
          f"{cold['hit']}), warm start {warm['seconds']:.1f} s (cache hit {warm['hit']})")
    assert cold["compiled"] and warm["compiled"]
    assert cold["hit"] is False and warm["hit"] is True
    assert warm["seconds"] < cold["seconds"]
    assert len(list((tmp_path / "cache").glob("torch-*/key.json"))) == 1


@pytest.mark.gpu
def test_compile_off_runs_the_eager_module(gpu_backends) -> None:
    half, _ = gpu_backends  # built with the defaults: compile=False
    assert not half.compiled and half.cache_hit is False and not half.channels_last
    assert half.cuda_graphs and sorted(half._graphs) == [2, 4]
