"""The TensorRT backend: real engine builds with TensorRT-RTX on the CPU, the engine cache,
and (on a GPU TensorRT can run on) the execute path."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from structlog.testing import capture_logs

from stages.backends.precision import CalibrationSettings, calibration_frames
from stages.backends.tensorrt import (
    NO_GPU,
    EngineBuildError,
    TensorRt,
    build_engine_cli,
    ensure_engine,
    gpu_target,
    import_tensorrt,
)

pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx-cu13 is not installed")


@pytest.fixture(scope="module")
def rtx() -> TensorRt:
    return import_tensorrt(("tensorrt_rtx",))


def tiny_model(path: Path, seed: int = 0, batch: int | str = "batch") -> Path:
    """A two-convolution model with the YOLO layout: images (B,3,32,32) -> (B,84,256)."""
    rng = np.random.default_rng(seed)
    weights = [numpy_helper.from_array(rng.normal(0, 0.1, shape).astype(np.float32), name)
               for name, shape in (("w1", (8, 3, 3, 3)), ("w2", (84, 8, 1, 1)))]
    weights.append(numpy_helper.from_array(np.array([0, 84, -1], np.int64), "shape"))
    nodes = [helper.make_node("Conv", ["images", "w1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"]),
             helper.make_node("Reshape", ["c2", "shape"], ["output0"])]
    graph = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info("images", TensorProto.FLOAT, [batch, 3, 32, 32])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, [batch, 84, 256])], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def text(logs: list[dict]) -> str:
    """Captured structlog events as one string, to search."""
    return "\n".join(" ".join([e["event"], *(f"{k}={v}" for k, v in e.items() if k != "event")])
                     for e in logs)


def record(engine: Path) -> dict:
    return json.loads(engine.with_suffix(".json").read_text())


@pytest.fixture(scope="module")
def sample_engines(samples, rtx, tmp_path_factory) -> dict[str, Path]:
    cache = tmp_path_factory.mktemp("engines")
    return {p: ensure_engine(rtx, samples.model, 4, p, cache) for p in ("fp32", "fp16")}


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_sample_engine_io_and_profile(sample_engines, rtx, precision):
    engine = sample_engines[precision]
    assert engine.stat().st_size > 1_000_000
    # The engine's own validity check parses it; without a GPU it can only complain about
    # the missing device, never about a malformed engine.
    malformed = int(rtx.module.EngineInvalidityDiagnostics.MALFORMED_ENGINE)
    runtime = rtx.module.Runtime(rtx.module.Logger(rtx.module.Logger.ERROR))
    assert not runtime.get_engine_validity(engine.read_bytes())[1] & malformed
    assert runtime.get_engine_validity(b"\0" * 4096)[1] & malformed
    io = record(engine)["io"]
    assert io == [
        {"name": "images", "mode": "input", "shape": [-1, 3, 416, 416], "dtype": "float32",
         "profile": [[1, 3, 416, 416], [4, 3, 416, 416], [4, 3, 416, 416]]},
        {"name": "output0", "mode": "output", "shape": [-1, 84, 2535], "dtype": "float32"},
    ]


def test_fp16_engine_holds_half_the_weights(sample_engines):
    ratio = sample_engines["fp16"].stat().st_size / sample_engines["fp32"].stat().st_size
    assert 0.4 < ratio < 0.6, ratio


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_deserialised_engine_io(sample_engines, rtx, precision):
    if gpu_target() == NO_GPU:
        pytest.skip("no GPU: TensorRT cannot deserialise an engine without a CUDA device")
    m = rtx.module
    runtime = m.Runtime(m.Logger(m.Logger.ERROR))
    engine = runtime.deserialize_cuda_engine(sample_engines[precision].read_bytes())
    if engine is None:
        pytest.skip(f"{rtx.flavour} cannot run on {gpu_target()}")
    io = [(engine.get_tensor_name(i), engine.get_tensor_mode(engine.get_tensor_name(i)),
           tuple(engine.get_tensor_shape(engine.get_tensor_name(i))),
           engine.get_tensor_dtype(engine.get_tensor_name(i))) for i in range(engine.num_io_tensors)]
    assert io == [("images", m.TensorIOMode.INPUT, (-1, 3, 416, 416), m.DataType.FLOAT),
                  ("output0", m.TensorIOMode.OUTPUT, (-1, 84, 2535), m.DataType.FLOAT)]


def test_cache_hit_reuses_the_engine(rtx, tmp_path):
    model = tiny_model(tmp_path / "tiny.onnx")
    first = ensure_engine(rtx, model, 4, "fp32", tmp_path / "cache")
    stamp = first.stat().st_mtime_ns
    with capture_logs() as logs:
        again = ensure_engine(rtx, model, 4, "fp32", tmp_path / "cache")
    assert again == first and again.stat().st_mtime_ns == stamp
    assert "using cached TensorRT engine" in text(logs) and "building" not in text(logs)
    assert [e["log_level"] for e in logs] == ["info"]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"max_batch": 2}, "batch_profile '1..4' -> '1..2'"),
        ({"precision": "fp16"}, "precision 'fp32' -> 'fp16'"),
        ({"seed": 1}, "model_sha256 '"),
        ({"version": "1.0.0"}, "version '"),
    ],
)
def test_cache_miss_rebuilds_and_says_why(rtx, tmp_path, change, reason):
    ensure_engine(rtx, tiny_model(tmp_path / "tiny.onnx"), 4, "fp32", tmp_path / "cache")
    model = tiny_model(tmp_path / "tiny.onnx", seed=change.get("seed", 0))
    trt = TensorRt(rtx.module, rtx.flavour, change.get("version", rtx.version))
    with capture_logs() as logs:
        engine = ensure_engine(trt, model, change.get("max_batch", 4),
                               change.get("precision", "fp32"), tmp_path / "cache")
    assert reason in text(logs) and "changed since the last build" in text(logs)
    assert len(list((tmp_path / "cache").glob("*.engine"))) == 2 and engine.exists()


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda e: e.write_bytes(e.read_bytes()[: e.stat().st_size // 2]), "checksum mismatch"),
        (lambda e: e.write_bytes(b"not an engine"), "checksum mismatch"),
        (lambda e: e.unlink(), "FileNotFoundError"),
        (lambda e: e.with_suffix(".json").write_text("{truncated"), "JSONDecodeError"),
        (lambda e: e.with_suffix(".json").unlink(), "FileNotFoundError"),
    ],
)
def test_corrupt_cache_file_is_rebuilt(rtx, tmp_path, damage, reason):
    model = tiny_model(tmp_path / "tiny.onnx")
    engine = ensure_engine(rtx, model, 4, "fp32", tmp_path / "cache")
    damage(engine)
    with capture_logs() as logs:
        assert ensure_engine(rtx, model, 4, "fp32", tmp_path / "cache") == engine
    assert "cached TensorRT engine is corrupt; rebuilding it" in text(logs)
    assert reason in text(logs) and logs[0]["log_level"] == "warning"
    with capture_logs() as logs:
        ensure_engine(rtx, model, 4, "fp32", tmp_path / "cache")
    assert "using cached TensorRT engine" in text(logs)


def test_rtx_on_a_gpu_falls_back_to_the_portable_engine(rtx, tmp_path):
    model = tiny_model(tmp_path / "tiny.onnx")
    portable = ensure_engine(rtx, model, 4, "fp32", tmp_path / "cache", target=NO_GPU)
    with capture_logs() as logs:
        found = ensure_engine(rtx, model, 4, "fp32", tmp_path / "cache",
                              target="NVIDIA GeForce RTX 4090 sm_89")
    assert found == portable and "using the portable TensorRT-RTX engine" in text(logs)


def test_parser_errors_name_the_node(rtx, tmp_path):
    graph = helper.make_graph(
        [helper.make_node("NoSuchOp", ["images"], ["output0"], name="mystery", domain="custom")],
        "bad", [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["b", 3, 8, 8])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["b", 5, 64])])
    bad = tmp_path / "bad.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                      helper.make_opsetid("custom", 1)]), str(bad))
    with pytest.raises(EngineBuildError, match=r"(?s)parser rejected .*bad.onnx.*mystery.*NoSuchOp"):
        ensure_engine(rtx, bad, 4, "fp32", tmp_path / "cache")
    garbage = tmp_path / "garbage.onnx"
    for data, message in [(b"\xff" * 64, "Failed to parse the ONNX model"),
                          (b"\x08\x07", "0 inputs and 0 outputs")]:  # a valid empty protobuf
        garbage.write_bytes(data)
        with pytest.raises(EngineBuildError, match=f"(?s)parser rejected .*garbage.onnx.*{message}"):
            ensure_engine(rtx, garbage, 4, "fp32", tmp_path / "cache")


@pytest.mark.parametrize(
    ("trt_flavour", "precision", "batch", "error", "message"),
    [
        ("tensorrt_rtx", "int4", "batch", ValueError, "precision must be one of fp32, fp16, int8"),
        ("tensorrt_rtx", "int8", "batch", ValueError, "int8 needs calibration settings"),
        ("tensorrt_rtx", "fp32", 1, EngineBuildError, "fixed batch of 1, so the batch size must"),
        ("tensorrt", "fp32", "batch", EngineBuildError, "sees none: build on the deployment"),
    ],
)
def test_bad_settings_are_clear_errors(rtx, tmp_path, trt_flavour, precision, batch, error,
                                       message):
    model = tiny_model(tmp_path / "tiny.onnx", batch=batch)
    trt = TensorRt(rtx.module, trt_flavour, "10.9.0")
    with pytest.raises(error, match=message):
        ensure_engine(trt, model, 4, precision, tmp_path / "cache")


def test_int8_with_a_missing_calibration_video_is_a_clear_error(rtx, tmp_path):
    calibration = CalibrationSettings(tmp_path / "scene.mp4", "minmax", 8)
    with pytest.raises(ValueError, match="calibration video .*scene.mp4 does not exist"):
        ensure_engine(rtx, tiny_model(tmp_path / "tiny.onnx"), 4, "int8", tmp_path, calibration)


def test_import_tensorrt_says_what_to_install():
    with pytest.raises(ImportError, match=re.escape("pip install -e '.[tensorrt]'")):
        import_tensorrt(("no_such_tensorrt",))


def test_build_engine_cli_int8_from_qdq_with_progress(samples, tmp_path):
    with capture_logs() as logs:
        engine = build_engine_cli(samples.model, 2, "int8", tmp_path, samples.bikes,
                                  calibration_method="minmax", calibration_frames=8)
    meta = record(engine)
    assert meta["key"]["precision"] == "int8" and meta["key"]["gpu"] == gpu_target()
    assert meta["key"]["calibration"].startswith("minmax, 8 frames of sha256:")
    qdq = onnx.load(str(tmp_path / meta["onnx"]))
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in qdq.graph.node}
    assert "using TensorRT flavour=tensorrt_rtx" in text(logs)
    assert "calibrating INT8 method=minmax frames=8" in text(logs)
    assert "TensorRT phase started phase=Building engine" in text(logs)
    assert "TensorRT phase done phase=Building engine" in text(logs)


@pytest.mark.gpu
def test_backend_matches_onnxruntime_on_the_gpu(samples, tmp_path):
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    if gpu_target() == NO_GPU:
        pytest.skip("no CUDA GPU visible")
    from stages.backends.tensorrt import TensorRtBackend

    gpu = SimpleNamespace(device_id=0, compute_stream=cupy.cuda.Stream(non_blocking=True))
    try:
        backend = TensorRtBackend(samples.model, 4, "fp32", tmp_path, gpu)
    except EngineBuildError as error:
        pytest.skip(f"TensorRT cannot run on {gpu_target()}: {error}")
    backend.warmup()
    frames = calibration_frames(samples.bikes, 4, 416, 416)
    with gpu.compute_stream:
        images = cupy.asarray(frames[:3])
        out = backend.infer(images, gpu.compute_stream)
        assert out.shape == (3, 84, 2535) and out.data.ptr == backend.output.data.ptr
        got = cupy.asnumpy(out)
    import onnxruntime as ort

    ref = ort.InferenceSession(str(samples.model)).run(None, {"images": frames[:3]})[0]
    np.testing.assert_allclose(got[:, 4:], ref[:, 4:], atol=1e-2)
    np.testing.assert_allclose(got[:, :4], ref[:, :4], atol=1.0)
    with pytest.raises(ValueError, match="non-default stream"):
        backend.infer(images, cupy.cuda.Stream.null)
    backend.close()

