"""Copy/compute overlap, measured on the whole GPU pipeline.

    python -m benchmarks.overlap_benchmark [--sources 8] [--batch 8] [--repeats 1]
        [--compile | --no-compile] [--engine-cache DIR]

Makes (once, cached under ``assets/cache``) a 1080p H.264 clip from bikes.mp4 (natural
footage at a camera-like 4 Mbps, the clip the other GPU benchmarks use), then runs the real
pipeline on ``--sources`` file sources of it (CPU decode into the pinned slot ring -> batcher:
one H2D per frame on the copy stream, one event per batch -> fused preprocess, torch, NMS on
the compute stream -> JSONL sinks, no video encoding), with the GPU timeline on: the batcher
records one "h2d" range per batch on the copy stream, the infer stage one "compute" range per
batch on the compute stream. It reports, at steady state (the first 20% of the batches left
out as warm-up):

- the share of the H2D copy time during which the compute stream was busy too (hidden under
  compute: the copy of batch N+1 running while batch N computes);
- the median H2D and compute time per batch, and the share of the window the compute
  stream was busy;
- frames/s, and each stage's work ms/frame and blocked seconds.

v1 also compared one staging slot against two at batch 1; the batch-first data plane has no
per-frame staging slots any more (the batcher copies whole batches into a few batch sets),
so only the overlap itself is measured, at batch 8 with 8 cameras by default.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np

from pipeline.gpu import hidden_fraction
from samples.fetch import ensure_samples

CLIP_BITRATE = 4_000_000
CLIP_NAME = "bikes_1080p_4mbps_25fps.mp4"  # under assets/cache; the other benchmarks' too
WARMUP_SHARE = 0.2  # the first 20% of the batches are start-up


def make_1080p_clip(source: Path, target: Path, bitrate: int = 6_000_000) -> Path:
    """Upscale ``source`` to 1920x1080 H.264 at 25 frames/s and ``bitrate`` (once; cached at
    ``target``), with rising timestamps (frame i at i / 25 s)."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.stem + ".partial" + target.suffix)
    with av.open(str(source)) as inp, av.open(str(partial), "w") as out:
        stream = out.add_stream("libx264", rate=Fraction(25))
        stream.width, stream.height, stream.pix_fmt = 1920, 1080, "yuv420p"
        stream.bit_rate = bitrate
        for index, frame in enumerate(inp.decode(video=0)):
            big = frame.reformat(width=1920, height=1080, format="yuv420p")
            big.pts, big.time_base = index, Fraction(1, 25)
            out.mux(stream.encode(big))
        out.mux(stream.encode(None))
    partial.replace(target)
    return target


def union_ms(ranges: list[tuple[float, float]]) -> float:
    """Milliseconds covered by the union of (start, end) ranges."""
    total, end = 0.0, None
    for start, stop in sorted(ranges):
        if end is None or start > end:
            total, end = total + stop - start, stop
        elif stop > end:
            total, end = total + stop - end, stop
    return total


def steady(ranges: list[tuple[float, float]], since: float) -> list[tuple[float, float]]:
    return [r for r in ranges if r[0] >= since]


def run_once(clip: Path, samples: Any, out: Path, sources: int, batch: int, compile: bool,
             engine_cache: str) -> dict[str, Any]:
    """One pipeline run with the GPU timeline on; the figures of the module docstring."""
    from pipeline.app.build import build_graph
    from pipeline.config import parse_config

    config = parse_config({
        # CPU decode: the frames cross PCIe from the pinned ring, which is what is measured.
        "sources": [{"name": f"cam{i}", "uri": str(clip), "decode": "cpu"} for i in range(sources)],
        "model": {"path": str(samples.model), "class_names": str(samples.names)},
        "inference": {"device": "cuda", "backend": "torch", "precision": "fp16",
                      "batch_size": batch, "compile": compile, "engine_cache": engine_cache},
        "output": {"dir": str(out), "video": None},
        "runtime": {"progress": False, "log_level": "warning"},
    })
    graph = build_graph(config, profile_gpu=True)
    started = time.perf_counter()
    graph.run()
    seconds = time.perf_counter() - started
    frames = sum(m.frames_out for m in graph.source_metrics.values())
    ranges = graph.gpu.timeline.intervals()
    copies, compute = ranges.get("h2d", []), ranges.get("compute", [])
    if len(copies) < 5 or not compute:
        raise RuntimeError(f"too few batches on the timeline: {len(copies)} copies, "
                           f"{len(compute)} compute ranges")
    since = sorted(copies)[int(len(copies) * WARMUP_SHARE)][0]
    copies, compute = steady(copies, since), steady(compute, since)
    window = max(e for _, e in [*copies, *compute]) - since
    return {
        "fps": frames / seconds, "frames": frames, "slots": graph.ring.slots,
        "hidden": hidden_fraction(copies, compute), "batches": len(copies),
        "copy_ms": float(np.median([e - s for s, e in copies])),
        "compute_ms": float(np.median([e - s for s, e in compute])),
        "compute_busy": union_ms(compute) / window if window > 0 else 0.0,
        "stages": {name: m.summary() for name, m in graph.stage_metrics.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sources", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="runs; medians are reported")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="torch backend: compiled (default) or eager (--no-compile)")
    parser.add_argument("--engine-cache", default="assets/engines",
                        help="folder for compile artefacts (default assets/engines)")
    parser.add_argument("--assets", default="assets")
    args = parser.parse_args(argv)
    assets = Path(args.assets)
    samples = ensure_samples(assets)
    clip = make_1080p_clip(samples.bikes, assets / "cache" / CLIP_NAME,
                           bitrate=CLIP_BITRATE)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [run_once(clip, samples, Path(tmp) / f"o{i}", args.sources, args.batch,
                         args.compile, args.engine_cache) for i in range(args.repeats)]

    def median(key: str) -> float:
        return statistics.median(run[key] for run in runs)

    last = runs[-1]
    print(f"overlap: {args.sources} x 1080p sources, batch {args.batch}, "
          f"{'compiled' if args.compile else 'eager'} torch, {last['frames']} frames a run, "
          f"{last['slots']} frame slots; medians of {len(runs)} run(s)")
    fps = ", ".join(f"{run['fps']:.0f}" for run in runs)
    hidden = ", ".join(f"{100 * run['hidden']:.1f}" for run in runs)
    print(f"  frames/s {median('fps'):.0f} (runs {fps})")
    print(f"  steady-state batches {last['batches']}: H2D median {median('copy_ms'):.3f} ms, "
          f"compute median {median('compute_ms'):.3f} ms per batch; compute stream busy "
          f"{100 * median('compute_busy'):.1f}% of the window")
    print("  stages (work ms/frame, blocked s): " + "; ".join(
        f"{name} {s['work_ms_per_frame']}, {s['blocked_s']}"
        for name, s in last["stages"].items() if not name.startswith("sink:"))
        + f"; {sum(1 for n in last['stages'] if n.startswith('sink:'))} sinks")
    print(f"H2D hidden under compute: {100 * median('hidden'):.1f}% (runs {hidden})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
