"""Soak: live RTSP cameras through ``python run.py`` for minutes, looking for slow growth.

    python -m benchmarks.soak [--minutes 30] [--cameras 2] [--fps 25] [--interval-s 10]
        [--warmup-s 60] [--device cpu|cuda] [--no-video] [--clip VIDEO] [--out soak.md]
    python -m benchmarks.soak --refit soak.md --warmup-s 900   # slopes of a printed report

Starts the tests' real RTSP server (GStreamer, ``tests/support``) with one endless live
camera per source (a moving test pattern, 320x240), writes a configuration that reads them
(``live: true``, annotated video on unless ``--no-video``, JSONL, Prometheus on a free
loopback port) and runs the pipeline as users do, in a process of its own. On a machine
without GStreamer (the H200 machine), ``--clip VIDEO`` makes the cameras that clip instead,
repeated by a stream copy to last the run and played as live cameras in real time
(``live: true``, ``pace_fps``: dropped when behind, like the RTSP ones). Every
``--interval-s`` it samples:

- host: resident memory (RSS) of the pipeline process and of all its children (the decode
  workers) together, their threads and open file descriptors (``/proc``);
- device (``--device cuda``): memory used by those processes (``nvidia-smi``);
- the pipeline's own Prometheus counters: frames done and dropped in the interval, and the
  mean capture-to-sink latency of the interval's frames (histogram sum and count deltas) and
  its p99 bound (the smallest bucket bound at or above the 99th percentile).

At the end it stops the pipeline with SIGINT (the graceful stop users use), checks that it
exits 0, and prints the samples and, over the samples after ``--warmup-s``, the least-squares
slope of each quantity per hour: a leak shows as a steady positive slope of RSS (MB/h),
threads or file descriptors. The live MP4 of a camera grows without bound by design until
segmenting exists: its size is reported, not counted as memory.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from pipeline.app.measurement import process_tree, query_compute_apps

PROMETHEUS_P99 = 0.99
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Sample:
    """One sample of the running pipeline (host figures summed over its process tree)."""

    elapsed_s: float
    rss_mb: float
    threads: int
    fds: int
    device_mb: float | None
    frames: float  # pipeline_source_frames_total, all sources
    dropped: float  # pipeline_source_dropped_frames_total, all sources
    latency_sum_s: float
    latency_count: float
    buckets: dict[float, float]  # le -> cumulative count, all sources
    video_mb: float


def host_usage(pids: list[int]) -> tuple[float, int, int]:
    """(RSS MB, threads, open file descriptors) summed over ``pids``."""
    rss_kb, threads, fds = 0, 0, 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            fds += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue  # exited meanwhile
        for line in status:
            if line.startswith("VmRSS:"):
                rss_kb += int(line.split()[1])
            elif line.startswith("Threads:"):
                threads += int(line.split()[1])
    return rss_kb / 1024, threads, fds


def device_usage(pids: list[int]) -> float | None:
    """Device memory (MB) used by ``pids`` according to ``nvidia-smi``, or None without it."""
    used = query_compute_apps()
    return None if used is None else sum(used.get(pid, 0.0) for pid in pids)


def scrape(port: int) -> tuple[float, float, float, float, dict[float, float]]:
    """(frames, dropped, latency sum, latency count, cumulative buckets) from /metrics, summed
    over the sources."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    frames = dropped = total = count = 0.0
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pipeline_source_frames_total":
                frames += sample.value
            elif sample.name == "pipeline_source_dropped_frames_total":
                dropped += sample.value
            elif sample.name == "pipeline_frame_latency_seconds_sum":
                total += sample.value
            elif sample.name == "pipeline_frame_latency_seconds_count":
                count += sample.value
            elif sample.name == "pipeline_frame_latency_seconds_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
    return frames, dropped, total, count, buckets


def p99_bound(before: Sample, after: Sample) -> float | None:
    """The smallest latency bucket bound holding 99% of the frames done between two samples."""
    done = after.latency_count - before.latency_count
    if done <= 0:
        return None
    for le in sorted(after.buckets):
        if after.buckets[le] - before.buckets.get(le, 0.0) >= PROMETHEUS_P99 * done:
            return le
    return None


def slope_per_hour(times: list[float], values: list[float]) -> float | None:
    """Least-squares slope of ``values`` over ``times`` (s), per hour; None with < 3 points."""
    if len(times) < 3:
        return None
    return float(np.polyfit(np.asarray(times), np.asarray(values, np.float64), 1)[0]) * 3600


def looped_clip(clip: Path, target: Path, seconds: float) -> Path:
    """``clip`` repeated end to end (stream copy) to last at least ``seconds``."""
    import av

    from pipeline.app.clips import make_looped_clip

    with av.open(str(clip)) as container:
        duration = float(container.duration or 0) / av.time_base
    if duration <= 0:
        raise SystemExit(f"error: --clip {clip}: no duration")
    return make_looped_clip(clip, target, int(seconds / duration) + 1)


def soak_config(urls: list[str], out: Path, model: Path, names: Path, device: str, video: bool,
                port: int, pace_fps: float | None = None) -> dict:
    """The pipeline's configuration: one live source per URL (a file played at ``pace_fps``
    in real time when given)."""
    pace = {} if pace_fps is None else {"pace_fps": pace_fps}
    return {
        "sources": [{"name": f"cam{i}", "uri": url, "live": True, **pace}
                    for i, url in enumerate(urls)],
        "model": {"path": str(model), "class_names": str(names)},
        "inference": {"device": device, "batch_size": 4},
        "output": {"dir": str(out), "video": "{source}.mp4" if video else None,
                   "jsonl": "{source}.jsonl"},
        "runtime": {"progress": False, "log_format": "json", "log_level": "warning",
                    "metrics_port": port},
    }


def run_soak(args: argparse.Namespace) -> tuple[list[Sample], int]:
    """Run the pipeline against live cameras for ``args.minutes``; samples and exit code."""
    from samples.fetch import SamplePaths, ensure_samples
    from tests.support import RtspServer, free_port, rtsp_server_missing

    if args.clip is None and (reason := rtsp_server_missing()) is not None:
        raise SystemExit(f"error: {reason} (or give --clip VIDEO)")
    samples = SamplePaths.under(Path(args.assets))
    if not samples.model.exists():
        samples = ensure_samples(Path(args.assets))
    port = free_port()
    mounts = {f"cam{i}": f"live:{args.fps:g}" for i in range(args.cameras)}
    samples_taken: list[Sample] = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        if args.clip is None:
            server = stack.enter_context(RtspServer(mounts))
            uris = [server.url(m) for m in mounts]
        else:
            uris = [str(looped_clip(args.clip, Path(tmp) / "looped.mp4", 60 * args.minutes + 120))
                    ] * args.cameras
        out = Path(tmp) / "out"
        config = soak_config(uris, out, samples.model, samples.names, args.device, args.video,
                             port, None if args.clip is None else args.fps)
        config_path = Path(tmp) / "soak.yaml"
        config_path.write_text(yaml.safe_dump(config))
        log = open(Path(tmp) / "stderr.log", "w")
        process = subprocess.Popen([sys.executable, str(REPO / "run.py"), "--config",
                                    str(config_path)],
                                   stderr=log, stdout=subprocess.DEVNULL)
        started = time.monotonic()
        deadline = started + 60 * args.minutes
        try:
            while time.monotonic() < deadline and process.poll() is None:
                time.sleep(args.interval_s)
                try:
                    frames, dropped, total, count, buckets = scrape(port)
                except OSError:
                    continue  # not serving yet (model loading)
                pids = process_tree(process.pid)
                rss, threads, fds = host_usage(pids)
                video = sum(p.stat().st_size for p in out.glob("*.mp4")) / 2**20 \
                    if out.exists() else 0.0
                samples_taken.append(Sample(
                    time.monotonic() - started, rss, threads, fds,
                    device_usage(pids) if args.device == "cuda" else None, frames, dropped,
                    total, count, buckets, video))
                print(line(samples_taken), file=sys.stderr, flush=True)
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
            try:
                code = process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                code = process.wait()
            log.close()
        if code != 0:
            tail = (Path(tmp) / "stderr.log").read_text()[-2000:]
            print(f"pipeline exited {code}; its log ends:\n{tail}", file=sys.stderr)
    return samples_taken, code


def line(samples: list[Sample]) -> str:
    """One table row for the newest sample (rates and latency over the interval before it)."""
    now = samples[-1]
    before = samples[-2] if len(samples) > 1 else None
    span = now.elapsed_s - before.elapsed_s if before else None
    fps = (now.frames - before.frames) / span if before and span else None
    dropped = now.dropped - before.dropped if before else None
    done = now.latency_count - before.latency_count if before else 0
    mean_ms = 1000 * (now.latency_sum_s - before.latency_sum_s) / done if before and done else None
    p99 = p99_bound(before, now) if before else None
    cells = [f"{now.elapsed_s:.0f}", f"{now.rss_mb:.1f}", str(now.threads), str(now.fds),
             "" if now.device_mb is None else f"{now.device_mb:.0f}",
             "" if fps is None else f"{fps:.1f}", "" if dropped is None else f"{dropped:.0f}",
             "" if mean_ms is None else f"{mean_ms:.0f}",
             "" if p99 is None else f"<= {1000 * p99:.0f}", f"{now.video_mb:.1f}"]
    return "| " + " | ".join(cells) + " |"


def report(samples: list[Sample], code: int, args: argparse.Namespace) -> str:
    cameras = (f"live RTSP cameras ({args.fps:g} fps, 320x240 test pattern)" if args.clip is None
               else f"simulated live cameras ({args.clip.name} looped, played at {args.fps:g} fps)")
    header = (f"Soak: {args.cameras} {cameras} "
              f"through `python run.py` ({args.device}, video {'on' if args.video else 'off'}) "
              f"for {args.minutes:g} min, sampled every {args.interval_s:g} s; pipeline exit "
              f"code after SIGINT: {code}.")
    rows = ["| s | RSS MB (process tree) | threads | fds | device MB | fps | dropped | "
            "latency mean ms | latency p99 ms | video MB |", "|" + "---|" * 10]
    rows += [line(samples[: i + 1]) for i in range(len(samples))]
    steady = [s for s in samples if s.elapsed_s >= args.warmup_s]
    times = [s.elapsed_s for s in steady]
    slopes = {"RSS MB/h": slope_per_hour(times, [s.rss_mb for s in steady]),
              "threads/h": slope_per_hour(times, [s.threads for s in steady]),
              "fds/h": slope_per_hour(times, [s.fds for s in steady])}
    if args.device == "cuda":
        slopes["device MB/h"] = slope_per_hour(
            times, [s.device_mb or 0.0 for s in steady])
    span = f"{times[0]:.0f}-{times[-1]:.0f} s" if times else "none"
    slope_text = ", ".join(f"{name} {'n/a' if value is None else f'{round(value, 2) + 0.0:+.2f}'}"
                           for name, value in slopes.items())
    return "\n".join([header, "", *rows, "",
                      f"Least-squares slopes over the samples after {args.warmup_s:g} s "
                      f"({span}, {len(steady)} samples): {slope_text}."])


def refit(text: str, warmup_s: float) -> str:
    """The slopes line of a printed report (its table), over the samples after ``warmup_s``:
    to see whether growth continues past a step (a buffer that grew once)."""
    rows = [line.strip("|").split("|") for line in text.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    steady = [[cell.strip() for cell in row] for row in rows if float(row[0]) >= warmup_s]
    times = [float(row[0]) for row in steady]
    slopes = {"RSS MB/h": slope_per_hour(times, [float(row[1]) for row in steady]),
              "threads/h": slope_per_hour(times, [float(row[2]) for row in steady]),
              "fds/h": slope_per_hour(times, [float(row[3]) for row in steady])}
    span = f"{times[0]:.0f}-{times[-1]:.0f} s" if times else "none"
    return (f"Least-squares slopes over the samples after {warmup_s:g} s ({span}, "
            f"{len(steady)} samples): " + ", ".join(
                f"{name} {'n/a' if value is None else f'{round(value, 2) + 0.0:+.2f}'}"
                for name, value in slopes.items()) + ".")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--cameras", type=int, default=2)
    parser.add_argument("--fps", type=float, default=25.0, help="each camera's frame rate")
    parser.add_argument("--interval-s", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=60.0,
                        help="samples before this are left out of the slopes")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--no-video", dest="video", action="store_false")
    parser.add_argument("--assets", default="assets")
    parser.add_argument("--clip", type=Path, default=None,
                        help="cameras play this video looped, paced (no RTSP server needed)")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    parser.add_argument("--refit", type=Path, default=None, metavar="REPORT",
                        help="no run: the slopes of REPORT's samples after --warmup-s")
    args = parser.parse_args(argv)
    if args.refit is not None:
        print(refit(args.refit.read_text(), args.warmup_s))
        return 0
    samples, code = run_soak(args)
    text = report(samples, code, args)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0 if code == 0 and samples else 1


if __name__ == "__main__":
    raise SystemExit(main())
