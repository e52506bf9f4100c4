"""Decode + NMS on the GPU: ``kernels.nms_cuda.CudaNms`` against torchvision, end to end.

Run ``python -m benchmarks.nms_benchmark`` on a machine with an NVIDIA GPU, CuPy, torch and
torchvision. Both sides get the same raw YOLO output (B, 4 + K, 8400) float32, a CuPy array
on a CuPy stream (torch reads it zero-copy), and do the same job: best class per anchor,
confidence filter, xywh -> xyxy, per-class greedy NMS, at most 300 detections per image,
results left on the GPU. Timed with CUDA events on that stream (median of --runs after
--warmup runs), so each time includes the host's launch overhead and any synchronisation:

- CudaNms: ``CudaNms.run`` (4 kernels on the stream, no synchronisation).
- torchvision: argmax / gather / box maths on the batch tensor, then per image the boolean
  filter and ``torchvision.ops.batched_nms(...)[:300]`` (which synchronise with the host).

Two score distributions: "realistic" (conf 0.25: background anchors score low, about 20
objects per image are each seen by 40 anchors) and "all anchors" (conf 0.0: all 8400 anchors
are candidates, the worst case). "match" says whether every image kept the same detections
(torchvision's keep sorted by score, then index, cut at 300); the boxes lie on a half-pixel
grid so that no step of either side rounds differently (torchvision shifts boxes by a class
offset, and its compiler may fuse multiply-adds), which makes exact equality the right test.
Writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

ANCHORS, MAX_DET, IOU = 8400, 300, 0.45


def make_predictions(rng: np.random.Generator, batch: int, num_classes: int,
                     objects: int = 20, size: int = 640) -> np.ndarray:
    """(batch, 4 + K, 8400) float32 raw outputs: low-scoring background, clustered objects."""
    p = np.empty((batch, 4 + num_classes, ANCHORS), np.float32)
    p[:, :2] = rng.uniform(0, size, (batch, 2, ANCHORS))
    p[:, 2:4] = rng.uniform(8, size / 3, (batch, 2, ANCHORS))
    p[:, 4:] = rng.random((batch, num_classes, ANCHORS), np.float32) ** 6 * 0.2 + 1e-4
    for image in p:
        for _ in range(objects):
            anchors = rng.choice(ANCHORS, 40, replace=False)
            centre, wh = rng.uniform(50, size - 50, (2, 1)), rng.uniform(20, 200, (2, 1))
            image[:2, anchors] = centre + rng.normal(0, 0.05, (2, 40)) * wh
            image[2:4, anchors] = wh * rng.uniform(0.8, 1.2, (2, 40))
            image[4 + rng.integers(num_classes), anchors] = rng.uniform(0.2, 0.95, 40)
    p[:, :2], p[:, 2:4] = np.round(p[:, :2] * 2) / 2, np.round(p[:, 2:4])  # see the module doc
    return p


def torchvision_postprocess(torch: Any, ops: Any, pred: Any, conf: float) -> list[tuple]:
    """Decode, filter and batched_nms with torch ops; per image the candidates (xyxy, scores,
    classes) and the full keep indices (device tensors)."""
    class_scores = pred[:, 4:].float()
    classes = class_scores.argmax(1)
    scores = class_scores.gather(1, classes[:, None])[:, 0]
    cx, cy, half_w, half_h = pred[:, 0], pred[:, 1], pred[:, 2] * 0.5, pred[:, 3] * 0.5
    boxes = torch.stack([cx - half_w, cy - half_h, cx + half_w, cy + half_h], -1)
    results = []
    for b in range(pred.shape[0]):
        m = scores[b] > conf
        xyxy, sc, cl = boxes[b][m], scores[b][m], classes[b][m]
        keep = ops.batched_nms(xyxy, sc, cl, IOU)
        results.append((xyxy, sc, cl, keep))
    return results


def torchvision_job(torch: Any, ops: Any, pred: Any, conf: float) -> list[tuple]:
    """What is timed: ``torchvision_postprocess`` and the kept detections' gather."""
    return [(x[k[:MAX_DET]], s[k[:MAX_DET]], c[k[:MAX_DET]])
            for x, s, c, k in torchvision_postprocess(torch, ops, pred, conf)]


def same_keep(ours: list[tuple], theirs: list[tuple]) -> bool:
    """Ours (host) equal torchvision's keep, ordered by (score desc, index asc), cut at 300."""
    for (xyxy, scores, classes), (t_xyxy, t_sc, t_cl, keep) in zip(ours, theirs):
        t_xyxy, t_sc, t_cl, keep = (t.cpu().numpy() for t in (t_xyxy, t_sc, t_cl, keep))
        keep = keep[np.lexsort((keep, -t_sc[keep]))][:MAX_DET]
        if not (np.array_equal(xyxy, t_xyxy[keep]) and np.array_equal(scores, t_sc[keep])
                and np.array_equal(classes, t_cl[keep].astype(np.int32))):
            return False
    return True


def median_ms(cupy: Any, stream: Any, fn: Callable[[], Any], runs: int, warmup: int) -> float:
    """Median CUDA-event time of ``fn`` on the CuPy ``stream``, in milliseconds."""
    for _ in range(warmup):
        fn()
    stream.synchronize()
    times = []
    for _ in range(runs):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    """Print the comparison table; 0 when every keep set matched, 1 if not, 2 without a GPU."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="timed runs per case (median)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs first")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        import cupy
        import torch
        import torchvision.ops as ops

        from kernels.nms_cuda import CudaNms, stream_from_cupy, to_host
    except ImportError as e:
        print(f"nms_benchmark needs CuPy, torch and torchvision: {e}")
        return 2
    if not torch.cuda.is_available():
        print("nms_benchmark needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2

    rng = np.random.default_rng(args.seed)
    stream = cupy.cuda.Stream(non_blocking=True)
    numba_stream, torch_stream = stream_from_cupy(stream), torch.cuda.ExternalStream(stream.ptr)
    timed = lambda fn: median_ms(cupy, stream, fn, args.runs, args.warmup)  # noqa: E731
    print("\n\n".join(__doc__.split("\n\n")[1:3]) + "\n")
    header = (f"{'scenario':<12} {'classes':>7} {'batch':>5} {'cand/img':>8} {'CudaNms ms':>10} "
              f"{'tv ms':>8} {'tv/ours':>7}  match")
    print(header + "\n" + "-" * len(header))
    all_match = True
    for scenario, conf in (("realistic", 0.25), ("all anchors", 0.0)):
        for num_classes in (80, 1):
            for batch in (1, 32):
                with stream:
                    pred = cupy.asarray(make_predictions(rng, batch, num_classes))
                nms = CudaNms(batch, ANCHORS, num_classes, conf, IOU, False, MAX_DET)
                ours_ms = timed(lambda: nms.run(pred, numba_stream))  # noqa: B023
                ours = to_host(*nms.run(pred, numba_stream), stream=numba_stream)
                with torch.cuda.stream(torch_stream):
                    pred_torch = torch.as_tensor(pred, device="cuda")
                    tv_ms = timed(lambda: torchvision_job(torch, ops, pred_torch, conf))  # noqa: B023
                    theirs = torchvision_postprocess(torch, ops, pred_torch, conf)
                match = same_keep(ours, theirs)
                all_match &= match
                candidates = np.mean([len(t[1]) for t in theirs])
                print(f"{scenario:<12} {num_classes:>7} {batch:>5} {candidates:>8.0f} "
                      f"{ours_ms:>10.3f} {tv_ms:>8.3f} {tv_ms / ours_ms:>7.1f}  {match}")
    return 0 if all_match else 1


if __name__ == "__main__":
    raise SystemExit(main())
