"""INT8 (Q/DQ) against FP32 on the CPU: how many FP32 detections the INT8 model keeps.

For each calibration method, the sample YOLOv3-tiny is quantised by
``stages.backends.precision.quantize_int8`` (calibrated on frames spread over the video), then
the FP32 and the Q/DQ model both run with onnxruntime on every frame of the video, both
outputs go through the pipeline's NMS (``kernels.nms.postprocess_reference``), and INT8
detections are matched to FP32 ones: same class, IoU above 0.5, greedily by score.

Run from the repository root:

    python -m benchmarks.int8_accuracy [--calibration-frames 64] [--video ...] [--model ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kernels.nms import postprocess_reference
from stages.backends.precision import (
    CALIBRATION_METHODS,
    CalibrationSettings,
    calibration_frames,
    quantize_int8,
)

CONF_THRESHOLD, NMS_IOU, MATCH_IOU = 0.25, 0.45, 0.5


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(len(a), len(b)) IoU of two (n, 4) float32 host arrays of xyxy boxes."""
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), axis=2)
    area = lambda x: np.prod(x[:, 2:] - x[:, :2], axis=1)  # noqa: E731
    return inter / (area(a)[:, None] + area(b)[None, :] - inter + 1e-9)


def match_detections(reference: tuple, candidate: tuple, iou: float = MATCH_IOU) -> list[float]:
    """Greedily match ``candidate`` detections to ``reference`` ones, best reference first.

    Args:
        reference, candidate: ``(xyxy (n, 4), scores (n,), class_ids (n,))`` host arrays of one
            image, as ``postprocess_reference`` returns them (best score first).
        iou: a match needs the same class and an IoU above this.

    Returns:
        The IoU of each matched pair.
    """
    ious = iou_matrix(reference[0], candidate[0])
    ious[reference[2][:, None] != candidate[2][None, :]] = 0.0
    matched = []
    for row in ious:
        j = int(np.argmax(row)) if row.size else -1
        if j >= 0 and row[j] > iou:
            matched.append(float(row[j]))
            ious[:, j] = 0.0
    return matched


def detect(model: Path, frames: np.ndarray, batch: int = 8) -> list[tuple]:
    """Per-frame NMS'd detections of an ONNX model run by onnxruntime on the CPU."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    out = []
    for start in range(0, len(frames), batch):
        raw = session.run(None, {name: frames[start:start + batch]})[0]
        out += postprocess_reference(raw, CONF_THRESHOLD, NMS_IOU)
    return out


def compare(model: Path, video: Path, methods: tuple[str, ...], frames: int,
            work_dir: Path) -> list[dict]:
    """One row per calibration method: detections of FP32 and INT8 and how many match."""
    images = calibration_frames(video, 10**6, 416, 416)  # every frame of the video
    fp32 = detect(model, images)
    rows = []
    for method in methods:
        started = time.perf_counter()
        qdq = quantize_int8(model, work_dir / f"{method}.onnx",
                            CalibrationSettings(video, method, frames))
        seconds = time.perf_counter() - started
        int8 = detect(qdq, images)
        ious = [m for ref, cand in zip(fp32, int8) for m in match_detections(ref, cand)]
        n32, n8 = sum(len(d[0]) for d in fp32), sum(len(d[0]) for d in int8)
        rows.append({"method": method, "frames": len(images), "fp32": n32, "int8": n8,
                     "matched": len(ious), "recall": len(ious) / max(n32, 1),
                     "precision": len(ious) / max(n8, 1),
                     "mean_iou": float(np.mean(ious)) if ious else 0.0,
                     "calibration_s": seconds})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Command line entry; prints a Markdown table and the command that produced it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=Path("assets/models/yolov3-tiny.onnx"))
    parser.add_argument("--video", type=Path, default=Path("assets/video/bikes.mp4"))
    parser.add_argument("--calibration-frames", type=int, default=64)
    parser.add_argument("--methods", nargs="+", default=list(CALIBRATION_METHODS),
                        choices=CALIBRATION_METHODS)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work_dir:
        rows = compare(args.model, args.video, tuple(args.methods), args.calibration_frames,
                       Path(work_dir))
    print(f"INT8 Q/DQ vs FP32, {args.model.name} on every frame of {args.video.name}, "
          f"onnxruntime CPU, calibrated on {args.calibration_frames} frames; a match is the "
          f"same class with IoU > {MATCH_IOU} (NMS: conf > {CONF_THRESHOLD}, IoU {NMS_IOU})\n")
    print("| calibration | frames | FP32 dets | INT8 dets | matched | recall vs FP32 | "
          "precision vs FP32 | mean IoU | calibration s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['frames']} | {r['fp32']} | {r['int8']} | {r['matched']} | "
              f"{r['recall']:.3f} | {r['precision']:.3f} | {r['mean_iou']:.3f} | "
              f"{r['calibration_s']:.1f} |")
    print("\nCommand: " + " ".join(["python -m benchmarks.int8_accuracy", *(argv or sys.argv[1:])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
