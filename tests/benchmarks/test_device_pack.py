"""benchmarks.device_pack: a model stored with float16 weights comes back float32, its
weights the originals rounded to float16, and detects as the original does; a pack unpacks
into its site and assets folders. (``build`` downloads wheels: not run here.)"""

from __future__ import annotations

import shutil
import sys
import tarfile

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from benchmarks.device_pack import grow_model, shrink_model, unpack
from benchmarks.overlap_benchmark import CLIP_NAME


def outputs(model_path, images: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: images})[0]


def test_a_shrunk_model_grows_back_to_its_weights_rounded_to_float16(samples, tmp_path):
    shrunk, grown = tmp_path / "m.f16.onnx", tmp_path / "m.onnx"
    shrink_model(samples.model, shrunk)
    assert shrunk.stat().st_size < 0.55 * samples.model.stat().st_size
    grow_model(shrunk, grown)
    original = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(samples.model))
                .graph.initializer}
    back = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(grown)).graph.initializer}
    assert back.keys() == original.keys()
    for name, weights in original.items():
        assert back[name].dtype == weights.dtype, name
        expected = weights.astype(np.float16).astype(np.float32) \
            if weights.dtype == np.float32 else weights
        np.testing.assert_array_equal(back[name], expected, err_msg=name)
    images = np.random.default_rng(0).random((1, 3, 416, 416), dtype=np.float32)
    before, after = outputs(samples.model, images), outputs(grown, images)
    assert before.shape == after.shape
    assert np.abs(after - before).max() <= 0.01 * np.abs(before).max()


def test_a_pack_unpacks_its_site_models_and_videos(samples, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # unpack puts the site first
    pack = tmp_path / "pack"
    pack.mkdir()
    (tmp_path / "site" / "somelib").mkdir(parents=True)
    (tmp_path / "site" / "somelib" / "__init__.py").write_text("")
    with tarfile.open(pack / "site.tar.xz", "w:xz") as tar:
        tar.add(tmp_path / "site" / "somelib", arcname="somelib")
    shrink_model(samples.model, pack / "yolov3-tiny.f16.onnx")
    shutil.copy(samples.names, pack)
    shutil.copy(samples.bikes, pack)
    shutil.copy(samples.bikes, pack / CLIP_NAME)
    assets = tmp_path / "assets"
    assert unpack(pack, tmp_path / "unpacked", assets) == 0
    assert (tmp_path / "unpacked" / "somelib" / "__init__.py").exists()
    assert {p.relative_to(assets).as_posix() for p in assets.rglob("*") if p.is_file()} == {
        "models/yolov3-tiny.onnx", f"models/{samples.names.name}", "video/bikes.mp4",
        f"cache/{CLIP_NAME}"}
    assert all(t.data_type == onnx.TensorProto.FLOAT for t in
               onnx.load(str(assets / "models" / "yolov3-tiny.onnx")).graph.initializer
               if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16))
