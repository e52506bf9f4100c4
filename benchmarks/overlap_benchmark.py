"""Copy/compute overlap and double buffering, measured on the whole GPU pipeline.

    python -m benchmarks.overlap_benchmark [--sources 4] [--batch 8]

Makes a 1080p H.264 clip from bikes.mp4 (natural footage, camera-like bitrate), then runs
the real pipeline (decode -> upload -> fused preprocess -> torch -> Numba NMS -> JSONL sink,
no video encoding) with CUDA-event ranges on the copy and compute streams, and reports:

- the share of H2D copy time hidden under compute work, at steady state (first 20% of the
  ranges dropped as warm-up);
- frames/s at batch 1 with double buffering (default staging slots) against one slot,
  in the same process, alternating runs, median of each.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from pipeline.build import build_graph
from pipeline.config import parse_config
from pipeline.gpu import hidden_fraction
from samples.fetch import ensure_samples


def make_1080p_clip(source: Path, target: Path, bitrate: int = 6_000_000) -> Path:
    """Upscale ``source`` to 1920x1080 H.264 at ``bitrate`` (once; cached at ``target``)."""
    if target.exists():
        return target
    with av.open(str(source)) as inp, av.open(str(target), "w") as out:
        stream = out.add_stream("libx264", rate=Fraction(25))
        stream.width, stream.height, stream.pix_fmt = 1920, 1080, "yuv420p"
        stream.bit_rate = bitrate
        for frame in inp.decode(video=0):
            big = frame.reformat(width=1920, height=1080, format="yuv420p")
            big.pts = None
            out.mux(stream.encode(big))
        out.mux(stream.encode(None))
    return target


def run_once(clip: Path, samples, out: Path, sources: int, batch: int, slots: int,
             profile: bool) -> dict:
    config = parse_config({
        # CPU decode: the frames cross PCIe from pinned slots, which is what is measured.
        "sources": [{"name": f"cam{i}", "uri": str(clip), "decode": "cpu"} for i in range(sources)],
        "model": {"path": str(samples.model), "class_names": str(samples.names)},
        "inference": {"device": "cuda", "backend": "torch", "precision": "fp16",
                      "batch_size": batch},
        "output": {"dir": str(out), "video": None},
        "runtime": {"progress": False, "staging_slots": slots, "log_level": "warning"},
    })
    graph = build_graph(config, profile_gpu=profile)
    started = time.perf_counter()
    graph.run()
    seconds = time.perf_counter() - started
    frames = sum(m.frames_out for m in graph.source_metrics.values())
    result = {"fps": frames / seconds, "frames": frames, "slots": graph.gpu.staging.slots,
              "busy_ms": {name: m.summary()["busy_ms_per_frame"]
                          for name, m in graph.stage_metrics.items()}}
    if profile:
        ranges = graph.gpu.timeline.intervals()
        copies, compute = ranges.get("h2d", []), ranges.get("compute", [])
        warm = len(copies) // 5
        start = copies[warm][0] if copies else 0.0
        steady_copies = [c for c in copies if c[0] >= start]
        result["hidden"] = hidden_fraction(steady_copies, compute)
        result["copy_ms"] = float(np.median([e - s for s, e in steady_copies]))
        result["copies"] = len(steady_copies)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sources", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--assets", default="assets")
    args = parser.parse_args(argv)
    samples = ensure_samples(Path(args.assets))
    with tempfile.TemporaryDirectory() as tmp:
        clip = make_1080p_clip(samples.bikes, Path(tmp) / "bikes_1080p.mp4")
        overlap = run_once(clip, samples, Path(tmp) / "o", args.sources, args.batch, 0, True)
        double, single = [], []
        for _ in range(args.repeats):
            double.append(run_once(clip, samples, Path(tmp) / "d", 1, 1, 0, False)["fps"])
            single.append(run_once(clip, samples, Path(tmp) / "s", 1, 1, 1, False)["fps"])
    print(f"overlap run: {args.sources} x 1080p sources, batch {args.batch}, "
          f"{overlap['frames']} frames, {overlap['fps']:.0f} frames/s, {overlap['slots']} slots")
    print(f"  H2D copies at steady state: {overlap['copies']}, median {overlap['copy_ms']:.3f} ms, "
          f"hidden under compute: {100 * overlap['hidden']:.1f}%")
    print("  busy ms per frame by stage (host threads): "
          + ", ".join(f"{name} {ms}" for name, ms in overlap["busy_ms"].items()))
    d, s = statistics.median(double), statistics.median(single)
    print(f"batch 1, one 1080p source, median of {args.repeats}: double-buffered {d:.0f} frames/s "
          f"(runs {', '.join(f'{x:.0f}' for x in double)}), one slot {s:.0f} frames/s "
          f"(runs {', '.join(f'{x:.0f}' for x in single)}), ratio {d / s:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
