"""Fused preprocess kernel throughput on the GPU: 1080p I420 frames to a 640x640 fp16 batch.

Times, with CUDA events (median over many runs), one frame per launch and a whole batch in
one launch, and reports the achieved bandwidth (frame bytes + model-input bytes written, per
second; the kernel reads about 2/3 of a 1080p frame's rows at this scale, so this slightly
overstates DRAM traffic) next to a device-to-device copy of a 256 MB buffer (read + write)
measured in the same run.

Two times per case: "GPU us/frame" brackets one launch between events while a spin kernel
keeps the stream busy, so it is the kernel alone; "b2b frames/s" is from many launches
queued back to back, so it includes the host's launch overhead (Numba's dispatch, tens of
microseconds) where that dominates.

Seen on an H200 (2026-11-30): 64 frames per launch 2.98 us/frame, 1.87 TB/s, 45% of the
copy's 4.18 TB/s (fp32 output: 62%); one frame per launch 6.9 us on the GPU but about
70 us of host time per launch; the NumPy reference ~10 ms/frame.

Frames are real pictures: frames of assets/video/bikes.mp4 upscaled to 1080p (or, without
the clip or PyAV, drawn gradients and shapes). Run from the repository root on a GPU host:

    python -m benchmarks.preprocess_benchmark [--batch 64] [--runs 200] [--dtype float16]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

BIKES = Path(__file__).resolve().parents[1] / "assets" / "video" / "bikes.mp4"


def real_frames(count: int, width: int, height: int) -> np.ndarray:
    """(count, height*3//2*width) uint8 I420 frames of natural video, upscaled with OpenCV."""
    import cv2

    pictures: list[np.ndarray] = []
    try:
        import av

        with av.open(str(BIKES)) as container:
            for frame in container.decode(video=0):
                pictures.append(frame.to_ndarray(format="rgb24"))
                if len(pictures) == count:
                    break
    except (ImportError, OSError) as exc:
        print(f"note: drawing frames instead of decoding {BIKES.name} ({exc})")
    while len(pictures) < count:
        i = len(pictures)
        img = np.zeros((height, width, 3), np.uint8)
        img[:] = np.linspace(0, 255, width, dtype=np.uint8)[None, :, None]
        cv2.circle(img, (200 + 20 * i, height // 2), height // 4, (255, 40, 10), -1)
        cv2.rectangle(img, (width // 2, 100), (width // 2 + 400, 700), (10, 90, 250), -1)
        pictures.append(img)
    return np.stack(
        [cv2.cvtColor(cv2.resize(p, (width, height)), cv2.COLOR_RGB2YUV_I420).ravel() for p in pictures]
    )


def event_median(cp: Any, stream: Any, run: Any, runs: int, busy: Any = None) -> float:
    """Median seconds between two events around ``run()`` on ``stream``, over ``runs`` runs."""
    times = []
    for _ in range(runs):
        if busy is not None:
            busy()  # keeps the GPU busy while the host queues the timed work
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        run()
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="frames per batched launch")
    parser.add_argument("--runs", type=int, default=200, help="timed runs per case (>= 100)")
    parser.add_argument("--src", default="1920x1080", help="frame size WxH")
    parser.add_argument("--dst", default="640x640", help="model input size WxH")
    parser.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    parser.add_argument("--pixel-format", default="i420", choices=["i420", "nv12"])
    args = parser.parse_args(argv)
    try:
        import cupy as cp
        from numba import cuda

        if cp.cuda.runtime.getDeviceCount() < 1 or os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
            raise RuntimeError("no CUDA device (or the Numba CUDA simulator is on)")
    except Exception as exc:  # ImportError, CUDARuntimeError, ...
        print(f"preprocess benchmark needs CuPy and an NVIDIA GPU: {exc}", file=sys.stderr)
        return 1
    from kernels.preprocess import letterbox_geometry, preprocess_reference
    from kernels.preprocess_cuda import launch_preprocess, launch_preprocess_frame, warmup_preprocess

    src_w, src_h = map(int, args.src.split("x"))
    dst_w, dst_h = map(int, args.dst.split("x"))
    dtype, fmt, n = np.dtype(args.dtype), args.pixel_format, args.batch
    lb = letterbox_geometry(src_w, src_h, dst_w, dst_h)
    host_frames = real_frames(n, src_w, src_h)
    if fmt == "nv12":  # interleave U and V after the Y plane
        y_bytes = src_w * src_h
        u, v = host_frames[:, y_bytes:].reshape(n, 2, -1).transpose(1, 0, 2)
        host_frames[:, y_bytes:] = np.stack([u, v], axis=2).reshape(n, -1)

    warnings.filterwarnings("ignore", message=".*Grid size")  # the one-thread spin kernel

    @cuda.jit
    def spin_kernel(steps):
        for _ in range(steps):
            cuda.nanosleep(10_000)

    stream = cp.cuda.Stream(non_blocking=True)
    nb_stream = cuda.external_stream(stream.ptr)
    with stream:
        frames = cp.asarray(host_frames)
        out = cp.zeros((n, 3, dst_h, dst_w), dtype)
        pairs = cp.asarray(np.stack([np.arange(n), np.arange(n)], axis=1).astype(np.int32))
        copy_src = cp.ones(256 * 2**20, np.uint8)
        copy_dst = cp.empty_like(copy_src)
    warmup_preprocess(lb, dtype, fmt)
    busy = lambda: spin_kernel[1, 1, nb_stream](30)  # noqa: E731  ~300 us
    busy()
    stream.synchronize()

    frame_bytes, out_bytes = host_frames.shape[1], 3 * dst_h * dst_w * dtype.itemsize
    d2d = event_median(cp, stream, lambda: copy_dst.data.copy_from_device_async(
        copy_src.data, copy_src.nbytes, stream), 50, busy)  # fmt: skip
    d2d_bw = 2 * copy_src.nbytes / d2d
    one = lambda i=0: launch_preprocess_frame(frames[i], lb, out, i, stream, pixel_format=fmt)  # noqa: E731
    many = lambda: launch_preprocess(frames, pairs, lb, out, stream, pixel_format=fmt)  # noqa: E731
    rows = []
    for name, run, per_launch in (("1 frame / launch", one, 1), (f"{n} frames / launch", many, n)):
        gpu_s = event_median(cp, stream, run, args.runs, busy)
        queued = 100 if per_launch == 1 else 20
        wall = event_median(cp, stream, lambda r=run, q=queued: [r() for _ in range(q)], 10) / queued
        bw = per_launch * (frame_bytes + out_bytes) / gpu_s
        rows.append((name, gpu_s / per_launch * 1e6, bw / 1e9, bw / d2d_bw * 100, per_launch / wall))
    stream.synchronize()

    frame0 = cp.asnumpy(frames[0]).reshape(-1, src_w)
    reference = lambda: preprocess_reference(frame0, src_w, src_h, lb, dtype=dtype, pixel_format=fmt)  # noqa: E731
    err = float(np.abs(cp.asnumpy(out[0]).astype(np.float32) - reference()).max() * 255)
    cpu_times = []
    for _ in range(5):
        start = time.perf_counter()
        reference()
        cpu_times.append(time.perf_counter() - start)
    cpu_ms = min(cpu_times) * 1e3

    print(f"preprocess {args.src} {fmt} -> {args.dst} {dtype.name}; {frame_bytes / 1e6:.2f} MB in "
          f"+ {out_bytes / 1e6:.2f} MB out per frame; median of {args.runs} runs")  # fmt: skip
    print(f"device-to-device copy (256 MB): {d2d_bw / 1e9:,.0f} GB/s (read + write)")
    print(f"{'case':<20} {'GPU us/frame':>13} {'GB/s':>8} {'% of copy':>10} {'b2b frames/s':>13}")
    for name, us, gbs, pct, fps in rows:
        print(f"{name:<20} {us:>13.2f} {gbs:>8,.0f} {pct:>9.0f}% {fps:>13,.0f}")
    print(f"NumPy reference on the CPU: {cpu_ms:.1f} ms/frame; GPU vs reference max |err| "
          f"{err:.3f}/255")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
