"""How long a start takes, through the run path users take, and what the bucketed CUDA graphs
cost at run time.

    python -m benchmarks.startup launch --config-out cfg.yaml [--cameras 1] [--workers N]
        [--batch 64] [--cache DIR] [--log FILE] [--limit-s 300]
    python -m benchmarks.startup inference [--batch 64] [--odd 37] [--cache DIR]

``launch`` writes a config (``--cameras`` paced live cameras at ``--pace-fps`` playing
``--clip``, YOLOv8s 640 FP16 at ``--batch``, compile cache ``--cache``; ``runtime.workers``
when ``--workers`` is given, else the default config's automatic count), starts
``python run.py --config`` on it as a new process and prints, in seconds from the launch:
when the log said ``model ready`` (the first one, with its cache hit or miss and the seconds
per bucket it logged), when the first record reached a JSONL file, and when every camera had
at least one record; with ``--http-port``, when
``/api/health`` first answered each status (``starting`` while the model warms up). Then it
stops the run with SIGINT. The run's log, each line prefixed with its second since the launch,
goes to ``--log``: the start's profile. A fresh ``--cache`` folder makes a cold start; the
same folder again a warm one.

``inference`` builds the backend as the pipeline does (``create_backend``), times its
``warmup()``, and times ``infer`` with CUDA events on the backend's own input buffer of random
images: at ``--batch``, and at ``--odd`` frames, which run padded in the graph of the next
bucket (37 -> 48 with the default buckets); then a second backend whose buckets include
``--odd`` itself times the same batch in a graph captured at exactly that size. It prints
images/s of each and the padded/exact ratio.

Needs a GPU, torch, CuPy and the YOLOv8s sample (``python -m samples.yolov8``); the clip is
``benchmarks.overlap_benchmark``'s 1080p clip (made from bikes.mp4 when missing).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class LaunchTimes:
    """Seconds from the launch of ``run.py`` (None: not seen before the limit)."""

    model_ready: list[float] = field(default_factory=list)  # each process's "model ready"
    ready_lines: list[str] = field(default_factory=list)
    first_record: float | None = None
    all_cameras: float | None = None
    exit_code: int | None = None
    health: dict[str, float] = field(default_factory=dict)  # status -> first seen (--http-port)


def write_config(path: Path, clip: Path, model: Path, names: Path | None, cameras: int,
                 pace_fps: float, batch: int, cache: Path, out: Path,
                 workers: int | None, http_port: int | None) -> None:
    # decode auto: NVDEC where usable (the live view downloads a watched frame now and then)
    sources = [{"name": f"cam{i:03d}", "uri": str(clip), "live": True, "pace_fps": pace_fps,
                "reconnect": False, "decode": "auto"} for i in range(cameras)]
    config = {
        "sources": sources,
        "model": {"path": str(model), "class_names": str(names) if names else None},
        "inference": {"device": "cuda", "backend": "torch", "precision": "fp16",
                      "batch_size": batch, "engine_cache": str(cache)},
        "output": {"dir": str(out), "video": None, "jsonl": "{source}.jsonl"},
        "runtime": {"progress": False, "http": {"port": http_port} if http_port else None},
    }
    if workers is not None:  # else not set: the default config's automatic count
        config["runtime"]["workers"] = workers
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def cameras_with_records(out: Path) -> set[str]:
    """Sources whose JSONL (final or ``.partial`` name) holds at least one byte."""
    found = set()
    for path in out.glob("*.jsonl"):
        try:
            if path.stat().st_size:
                found.add(path.name.split(".")[0])
        except OSError:
            continue
    return found


def health_status(port: int) -> str | None:
    """``/api/health``'s status on 127.0.0.1:``port``, or None while nothing answers."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=1) as answer:
            return json.loads(answer.read())["status"]
    except (OSError, ValueError, KeyError):
        return None


def launch(config: Path, out: Path, cameras: int, log: Path, limit_s: float,
           http_port: int | None = None) -> LaunchTimes:
    """Start ``run.py`` on ``config``; time its start (module docstring); stop it."""
    times = LaunchTimes()
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "run.py", "--config", str(config)],
                               cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def read_log() -> None:
        with open(log, "w") as sink:
            for line in process.stderr:
                at = time.monotonic() - started
                line = ANSI.sub("", line.rstrip())
                sink.write(f"{at:8.2f} {line}\n")
                sink.flush()
                if "model ready" in line:
                    times.model_ready.append(round(at, 2))
                    times.ready_lines.append(line)

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    while time.monotonic() - started < limit_s and process.poll() is None:
        seen = cameras_with_records(out)
        at = round(time.monotonic() - started, 2)
        if seen and times.first_record is None:
            times.first_record = at
        if http_port and (status := health_status(http_port)) is not None:
            times.health.setdefault(status, at)
        if len(seen) >= cameras:
            times.all_cameras = at
            break
        time.sleep(0.05)
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
    times.exit_code = process.wait()
    reader.join(5)
    return times


def main_launch(args: argparse.Namespace) -> int:
    from benchmarks.overlap_benchmark import CLIP_BITRATE, CLIP_NAME, make_1080p_clip
    from samples.fetch import SamplePaths

    assets = REPO_ROOT / "assets"
    clip = Path(args.clip) if args.clip else make_1080p_clip(
        SamplePaths.under(assets).bikes, assets / "cache" / CLIP_NAME, bitrate=CLIP_BITRATE)
    model = Path(args.model)
    names = model.with_suffix(".names")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.jsonl"):
        old.unlink()
    write_config(Path(args.config_out), clip, model, names if names.exists() else None,
                 args.cameras, args.pace_fps, args.batch, Path(args.cache), out, args.workers,
                 args.http_port)
    times = launch(Path(args.config_out), out, args.cameras, Path(args.log), args.limit_s,
                   args.http_port)
    layout = (f"runtime.workers: {args.workers}" if args.workers
              else "default workers (runtime.workers not set)")
    print(f"launch ({layout}, {args.cameras} paced camera(s) at {args.pace_fps:g} fps, "
          f"batch {args.batch}, cache {args.cache}):")
    print(f"  model ready at (s after launch, per process): {times.model_ready}")
    for line in times.ready_lines:
        print(f"    {line.split('model ready', 1)[1].strip()}")
    print(f"  first record at: {times.first_record} s")
    print(f"  every camera delivering at: {times.all_cameras} s")
    if args.http_port:
        print(f"  /api/health status first seen at (s): {times.health}")
    print(f"  exit code after SIGINT: {times.exit_code}")
    print("RESULT " + json.dumps(times.__dict__))
    return 0 if times.all_cameras is not None else 1


def time_infer(backend, stream, batch: int, seconds: float = 2.0) -> float:
    """Images/s of ``backend.infer`` on ``stream`` (CuPy) on ``batch`` random images in its
    own input buffer (``pipeline.app.ceilings.infer_rate``: CUDA events over about
    ``seconds``)."""
    import cupy
    import numpy as np

    from pipeline.app.ceilings import infer_rate

    images = backend.input_buffer(batch)
    with stream:
        images[...] = cupy.random.random(images.shape, np.float32).astype(images.dtype)
    return infer_rate(backend, images, stream, seconds, min_runs=20)


def main_inference(args: argparse.Namespace) -> int:
    from pipeline.app.build import create_gpu_context
    from pipeline.config import parse_config
    from stages.backends.base import read_model_info
    from stages.infer import create_backend

    model = Path(args.model)
    info = read_model_info(model)
    names = model.with_suffix(".names")

    def build(buckets: list[int] | None):
        config = parse_config({
            "sources": [{"name": "x", "uri": "rtsp://127.0.0.1/x"}],
            "model": {"path": str(model), "class_names": str(names) if names.exists() else None},
            "inference": {"device": "cuda", "backend": "torch", "precision": "fp16",
                          "batch_size": args.batch, "engine_cache": args.cache,
                          "batch_buckets": buckets}})
        if args.profile:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.enable()
        began = time.perf_counter()
        gpu = create_gpu_context(config)
        backend = create_backend(config.inference, model, info, gpu)
        built = time.perf_counter() - began
        if args.no_cudnn_benchmark:
            import torch

            torch.backends.cudnn.benchmark = False
        began = time.perf_counter()
        backend.warmup()
        warmup_s = time.perf_counter() - began
        print(f"backend built in {built:.1f} s, warmed up in {warmup_s:.1f} s")
        if args.profile:
            profiler.disable()
            stats = pstats.Stats(profiler, stream=sys.stdout)
            stats.sort_stats("cumulative").print_stats(args.profile)
            args.profile = 0
        return backend, gpu.compute_stream, warmup_s

    default, stream, warmup_s = build(None)
    full = time_infer(default, stream, args.batch)
    padded = time_infer(default, stream, args.odd)
    print(f"default buckets {default.buckets}: warm-up {warmup_s:.1f} s (per bucket "
          f"{default.capture_seconds}), cache hit {default.cache_hit}")
    print(f"  batch {args.batch}: {full:,.0f} images/s")
    bucket = next(b for b in default.buckets if b >= args.odd)
    print(f"  batch {args.odd} (padded to {bucket}): {padded:,.0f} images/s")
    default.close()
    exact_backend, stream, exact_warmup_s = build([args.odd])
    exact = time_infer(exact_backend, stream, args.odd)
    print(f"buckets {exact_backend.buckets}: warm-up {exact_warmup_s:.1f} s")
    print(f"  batch {args.odd} (a graph captured at exactly {args.odd}): {exact:,.0f} images/s")
    print(f"padded / exact at {args.odd}: {padded / exact:.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.startup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("launch", "inference"):
        sub = commands.add_parser(name)
        sub.add_argument("--model", default=str(REPO_ROOT / "assets/models/yolov8s-fall.onnx"))
        sub.add_argument("--batch", type=int, default=64)
        sub.add_argument("--cache", default=str(REPO_ROOT / "assets/engines"))
        if name == "launch":
            sub.add_argument("--cameras", type=int, default=1)
            sub.add_argument("--workers", type=int, default=None,
                             help="runtime.workers (default: not set, the automatic count)")
            sub.add_argument("--pace-fps", type=float, default=30.0)
            sub.add_argument("--clip", default=None)
            sub.add_argument("--config-out", default="/tmp/startup.yaml")
            sub.add_argument("--output-dir", default="/tmp/startup-out")
            sub.add_argument("--log", default="/tmp/startup.log")
            sub.add_argument("--limit-s", type=float, default=300.0)
            sub.add_argument("--http-port", type=int, default=None,
                             help="runtime.http on 127.0.0.1 at this port; /api/health is "
                                  "polled during the start")
        else:
            sub.add_argument("--odd", type=int, default=37)
            sub.add_argument("--profile", type=int, default=0,
                             help="print this many lines of a cProfile of the first build")
            sub.add_argument("--no-cudnn-benchmark", action="store_true")
    args = parser.parse_args(argv)
    return main_launch(args) if args.command == "launch" else main_inference(args)


if __name__ == "__main__":
    raise SystemExit(main())
