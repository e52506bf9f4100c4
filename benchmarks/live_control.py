"""The live view and source control under load, through the run path users take: N paced
cameras with ``runtime.http`` on (and ``runtime.workers`` only when ``--workers`` is given: the
default config's automatic count otherwise); one camera added and removed through the HTTP API
while they run; does the paced result still hold?

    python -m benchmarks.live_control [--small] [--cameras 100] [--workers N]
        [--pace-fps 30] [--warmup-s S] [--seconds S] [--decode auto|cpu|gpu]
        [--engine-cache DIR] [--budget-s S] [--out DIR]

It writes ``OUT/config.yaml`` (the records go to a temporary folder, deleted afterwards)
and starts ``python run.py --config OUT/config.yaml`` as a new process (its stdout and
stderr, each line prefixed with its second since the launch, go to ``OUT/run.log``), then:

1. polls ``GET /api/health`` until it answers ``ok``, then ``/api/sources`` until every
   camera delivered a frame (the seconds from the launch of each are rows; with
   ``--budget-s`` it waits at most what the rest of the run leaves);
2. waits ``--warmup-s``, then opens a window of ``--seconds``. All through the run it scrapes
   ``/metrics`` (``runtime.metrics_port``) about 5 times a second and keeps, per host (label
   ``pipeline``: the source worker, ``worker0``, ...), each new snapshot with the time it was
   first seen: hosts send theirs to the supervisor once a second, so a window's numbers are
   per host between its first and last snapshot inside the window (timed to within a scrape
   period);
3. in the window: ``POST /api/sources`` one more camera (``added``, the same clip and pace) at
   20% of it, then polls ``/api/sources`` until that camera's ``frames`` is above 0, and at
   60% (or once it delivered, at most at 90%) ``DELETE /api/sources/added``, which answers
   200 once its outputs are final (202: still finalising, then polled until it leaves the
   list). Meanwhile a viewer fetches ``snapshot.jpg`` of up to 6 cameras spread over the
   hosts, at ``preview_fps`` each, as the page does for the cards on screen;
4. after the window: saves the page (``GET /`` -> ``index.html``), ``sources.json``,
   ``health.json``, the viewer's latest JPEG of each watched camera
   (``snapshots/NAME.jpg``) and the two raw scrapes at the window's ends
   (``metrics-start.txt``, ``metrics-end.txt``); ``python -m benchmarks.render_page OUT``
   makes a PNG of the page from them on any machine with Chromium;
5. sends SIGINT to run.py and waits for its exit status (0 expected: every camera is live,
   and a camera stopped by Ctrl-C counts as finished; 3 would mean a file source was cut
   short).

Over the window, for the N configured cameras (not ``added``), the numbers and the verdict
of ``pipeline.app.measurement`` (its docstring says how each is read from the scrapes):
offered and delivered frames/s, dropped, p50 and p99 capture-to-sink latency as the
histogram bucket they fall in (all cameras, and each host's p99), each stage's work and
blocked seconds summed over the hosts, the busiest stage of any host (the bottleneck); held =
0 dropped, p99 <= 100 ms and delivered >= 95% of offered. ``python run.py capacity`` uses the
same measurement to find how many cameras hold.

Full mode (the H200): YOLOv8s-fall 640 (``assets/models/yolov8s-fall.onnx``), torch FP16,
batch 64, compile cache ``--engine-cache``; every camera plays the 1080p clip of the
benchmarks (``benchmarks.overlap_benchmark.make_1080p_clip``, under ``assets/cache``,
repeated long enough for the whole run) as ``{live: true, pace_fps, reconnect: false}`` with
``decode: auto`` (NVDEC: no video is written); 100 cameras at 30 fps in the default config
(no runtime tuning keys: one engine, the automatic number of source workers).
``--small`` (CI, no GPU): ``runtime.workers: 2``, 2 cameras of bikes.mp4 at 2 fps, YOLOv3-tiny
on the CPU, a 10 s window.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeline.app.api_client import ADDED, AddRemove, add_and_remove, get_json, request
from pipeline.app.measurement import (
    DELIVERED_SHARE,
    P99_LIMIT_S,
    MeasurementError,
    MetricsPoller,
    UtilisationSampler,
    Window,
    bucket_text,
    free_port,
    launch,
    said,
    stop,
    window_numbers,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
HEALTH_TIMEOUT_S = {"full": 420.0, "small": 120.0}  # launch until /api/health says ok
AFTER_WINDOW_S = 100.0  # --budget-s: what saving and stopping may take after the window
WATCHED = 6  # cameras whose snapshots the viewer fetches and saves
EXIT_MEANING = {0: "every source finished (a live camera stopped by Ctrl-C counts as finished)",
                1: "a source or stage failed", 2: "bad configuration or command line",
                3: "stopped early: a file source was cut short (its outputs stay .partial)",
                130: "aborted by a second signal"}


class BenchmarkError(MeasurementError):
    """A step of the benchmark failed; the message is one line for the user."""


# ---- the live view -----------------------------------------------------------------------


class Viewer:
    """Fetches ``snapshot.jpg`` of ``names`` in a thread each (as the page's cards do, at
    most ``fps`` a second each) and keeps the latest JPEG of each."""

    def __init__(self, base: str, names: list[str], fps: float) -> None:
        self.base, self.names, self.period_s = base, names, 1.0 / fps
        self.latest: dict[str, bytes] = {}
        self.served = 0
        self.pictures: dict[str, set[str]] = {}  # name -> the X-Picture numbers seen
        self.missing = 0  # answers other than 200 (503: no picture yet)
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._watch, args=(name,), daemon=True)
                         for name in names]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)

    def _watch(self, name: str) -> None:
        url = f"{self.base}/api/sources/{name}/snapshot.jpg"
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                status, body, headers = request(url, timeout=10)
            except OSError:
                status, body, headers = 0, b"", {}
            with self.lock:
                if status == 200 and body:
                    self.latest[name] = body
                    self.served += 1
                    self.pictures.setdefault(name, set()).add(headers.get("x-picture", ""))
                else:
                    self.missing += 1
            self._stop.wait(max(0.0, self.period_s - (time.monotonic() - began)))


def spread(hosts: dict[str, str], names: list[str], count: int) -> list[str]:
    """Up to ``count`` of ``names`` taken from each host in turn (config order within one)."""
    by_host: dict[str, list[str]] = {}
    for name in names:
        by_host.setdefault(hosts.get(name, "?"), []).append(name)
    picked: list[str] = []
    queues = [list(items) for _, items in sorted(by_host.items())]
    while len(picked) < count and any(queues):
        for queue in queues:
            if queue and len(picked) < count:
                picked.append(queue.pop(0))
    return picked


# ---- the run -----------------------------------------------------------------------------


@dataclass
class Plan:
    """What one run measures."""

    small: bool
    cameras: int
    workers: int | None  # runtime.workers; None: not set (the default config)
    pace_fps: float
    warmup_s: float
    seconds: float
    decode: str
    clip: Path
    model: Path
    names: Path
    engine_cache: Path
    out: Path
    records: Path  # output.dir
    http_port: int
    metrics_port: int
    health_s: float  # longest wait from the launch until /api/health says ok

    def source(self, name: str) -> dict[str, Any]:
        return {"name": name, "uri": str(self.clip), "live": True, "pace_fps": self.pace_fps,
                "reconnect": False, "decode": self.decode}

    def config(self) -> dict[str, Any]:
        inference = ({"device": "cpu", "backend": "onnxruntime", "batch_size": 4}
                     if self.small else
                     {"device": "cuda", "backend": "torch", "precision": "fp16",
                      "batch_size": 64, "engine_cache": str(self.engine_cache)})
        runtime: dict[str, Any] = {"http": {"port": self.http_port},
                                   "metrics_port": self.metrics_port, "progress": False,
                                   "stop_when": "never"}
        if self.workers is not None:
            runtime["workers"] = self.workers
        return {
            "sources": [self.source(f"cam{i:03d}") for i in range(self.cameras)],
            "model": {"path": str(self.model), "class_names": str(self.names)},
            "inference": inference,
            "output": {"dir": str(self.records), "video": None,
                       "jsonl": "{source}.jsonl"},
            "runtime": runtime,
        }


@dataclass
class Result(Window):
    """Everything measured (the window's numbers, ``Window``, and the live view's); None: not
    measured (the notes say why)."""

    start_s: float | None = None  # launch until /api/health said ok
    all_s: float | None = None  # launch until every configured camera had delivered a frame
    control: AddRemove = field(default_factory=AddRemove)  # added and removed in the window
    health_end: str | None = None
    watched: list[str] = field(default_factory=list)
    saved_jpegs: list[str] = field(default_factory=list)
    viewer_served: int = 0
    viewer_pictures: int = 0  # distinct pictures (X-Picture) among those served
    viewer_missing: int = 0
    exit_code: int | None = None
    notes: list[str] = field(default_factory=list)


def wait_healthy(base: str, process: subprocess.Popen[Any], limit_s: float,
                 started: float) -> float:
    """Seconds from ``started`` until ``/api/health`` said ``ok``.

    Raises:
        BenchmarkError: run.py ended first, or it took longer than ``limit_s``.
    """
    last = None
    while time.monotonic() - started < limit_s:
        if process.poll() is not None:
            raise BenchmarkError(f"run.py exited with {process.returncode} before /api/health "
                                 f"said ok (last: {last}){said(process)}")
        try:
            last = get_json(f"{base}/api/health").get("status")
        except (OSError, ValueError, MeasurementError):
            last = last or "no answer"
        if last == "ok":
            return time.monotonic() - started
        time.sleep(0.25)
    raise BenchmarkError(f"/api/health not ok within {limit_s:g} s (last: {last}); see run.log")


def wait_delivering(base: str, process: subprocess.Popen[Any], limit_s: float,
                    started: float) -> float:
    """Seconds from ``started`` until every source of ``/api/sources`` had a frame.

    Raises:
        BenchmarkError: run.py ended first, or it took longer than ``limit_s``.
    """
    waiting: list[str] = []
    while time.monotonic() - started < limit_s:
        if process.poll() is not None:
            raise BenchmarkError(f"run.py exited with {process.returncode} before every camera "
                                 f"delivered{said(process)}")
        sources = get_json(f"{base}/api/sources")["sources"]
        waiting = [entry["name"] for entry in sources if not entry.get("frames")]
        if sources and not waiting:
            return time.monotonic() - started
        time.sleep(0.25)
    raise BenchmarkError(f"{len(waiting)} cameras had delivered no frame {limit_s:g} s after "
                         f"the launch (first: {waiting[:3]}); see run.log")


def save_page(base: str, out: Path, viewer: Viewer, result: Result) -> None:
    """The page, the API's answers and the watched cameras' JPEGs (step 4)."""
    status, page, _ = request(f"{base}/", timeout=30)
    if status != 200:
        result.notes.append(f"GET / answered {status}")
    (out / "index.html").write_bytes(page)
    sources = get_json(f"{base}/api/sources")
    (out / "sources.json").write_text(json.dumps(sources, indent=1))
    health = get_json(f"{base}/api/health")
    (out / "health.json").write_text(json.dumps(health, indent=1))
    result.health_end = health.get("status")
    snapshots = out / "snapshots"
    snapshots.mkdir(exist_ok=True)
    deadline = time.monotonic() + 10
    while set(viewer.latest) < set(viewer.names) and time.monotonic() < deadline:
        time.sleep(0.2)  # a watched GPU-decoded camera's first picture can take a moment
    viewer.stop()
    with viewer.lock:
        for name, jpeg in viewer.latest.items():
            (snapshots / f"{name}.jpg").write_bytes(jpeg)
        result.saved_jpegs = sorted(viewer.latest)
        result.viewer_served, result.viewer_missing = viewer.served, viewer.missing
        result.viewer_pictures = sum(len(seen) for seen in viewer.pictures.values())


def measure(plan: Plan, command: list[str], result: Result) -> None:
    """Launch run.py, measure (module docstring), stop it."""
    base = f"http://127.0.0.1:{plan.http_port}"
    poller = MetricsPoller(f"http://127.0.0.1:{plan.metrics_port}/metrics")
    started = time.monotonic()
    process, reader = launch(command, plan.out / "run.log", cwd=REPO_ROOT)
    viewer: Viewer | None = None
    try:
        result.start_s = wait_healthy(base, process, plan.health_s, started)
        result.all_s = wait_delivering(base, process, plan.health_s, started)
        poller.start()
        time.sleep(plan.warmup_s)
        names = [f"cam{i:03d}" for i in range(plan.cameras)]
        result.watched = spread(poller.host_of(), names, WATCHED)
        preview_fps = 5.0  # runtime.http.preview_fps's default: the page's rate
        viewer = Viewer(base, result.watched, preview_fps)
        with UtilisationSampler(True) as sampler:  # none without NVML or nvidia-smi
            t0, p0 = time.monotonic(), time.perf_counter()
            (plan.out / "metrics-start.txt").write_text(poller.scrape())
            viewer.start()
            result.control = add_and_remove(base, plan.source(ADDED), t0, plan.seconds,
                                            poller.host_of)
            result.notes += result.control.notes
            time.sleep(max(0.0, t0 + plan.seconds - time.monotonic()))
            (plan.out / "metrics-end.txt").write_text(poller.scrape())
            t1, p1 = time.monotonic(), time.perf_counter()
        result.gpu_util, result.nvdec_util = sampler.mean(p0, p1) or (None, None)
        result.window_s = t1 - t0
        result.offered = plan.cameras * plan.pace_fps
        window_numbers(poller, t0, t1, set(names), result)
        save_page(base, plan.out, viewer, result)
    finally:
        if viewer is not None:
            viewer.stop()
        poller.stop()
        result.exit_code, note = stop(process)
        if note is not None:
            result.notes.append(note)
        reader.join(10)


# ---- the report --------------------------------------------------------------------------


def num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def markdown(plan: Plan, result: Result, header: str) -> str:
    """The table, one row per measurement, then the verdict line."""
    rows: list[tuple[str, str, str]] = [
        ("start: launch until /api/health ok", f"{num(result.start_s, 1)} s", ""),
        ("start: launch until every camera delivered", f"{num(result.all_s, 1)} s",
         "a frame of each in /api/sources"),
        ("window", f"{num(result.window_s, 1)} s",
         f"after {plan.warmup_s:g} s warm-up; hosts: " + ", ".join(
             f"{h} (cameras: {result.host_cameras[h]})" for h in result.hosts)),
        ("offered", f"{num(result.offered, 1)} fps",
         f"{plan.cameras} cameras x {plan.pace_fps:g} fps"),
        ("delivered", f"{num(result.delivered, 1)} fps", f"{num(result.delivered_pct, 1)}% of offered"),
        ("dropped", num(result.dropped), "the configured cameras, in the window"),
        ("p50 latency", bucket_text(result.p50), "capture to sink, all cameras; bucket bounds"),
        ("p99 latency", bucket_text(result.p99), "capture to sink, all cameras; bucket bounds"),
    ]
    rows += [(f"p99 latency {host}", bucket_text(p99), f"its cameras "
              f"({result.host_cameras.get(host, 0)})") for host, p99 in result.host_p99.items()]
    control = result.control
    rows += [
        ("POST /api/sources (added)", num(control.post_status),
         f"answered in {num(control.post_ms, 0)} ms; placed on {control.added_host or '-'}"),
        ("added: first frame", f"{num(control.first_frame_s, 2)} s",
         "after the POST answered (its frames > 0 in /api/sources)"),
        ("DELETE /api/sources/added", num(control.delete_status),
         f"answered in {num(control.delete_s, 2)} s; {num(control.added_frames)} frames; "
         f"gone from /api/sources after {num(control.gone_s, 2)} s"),
    ]
    if result.stages:
        # each host's counters cover its span (about the window): the mean span, not the
        # window, is what their sum is a share of
        spans = list(result.spans.values())
        covered = sum(spans) / len(spans) if spans else (result.window_s or 1.0)
        rows += [(f"stage {stage}", f"{work:,.1f} s work, {blocked:,.1f} s blocked",
                  f"summed over {len(result.hosts)} hosts; {100 * work / covered:.0f}% of one "
                  f"thread over the {covered:.1f} s its counters cover") for stage,
                 (work, blocked) in sorted(result.stages.items(), key=lambda item: -item[1][0])]
    if result.busiest is not None:
        host, stage, share = result.busiest
        rows.append(("busiest stage", f"{host} {stage}", f"work {share:.0f}% of the window"))
    if result.gpu_util is not None:  # sampled (NVML or nvidia-smi)
        rows.append(("GPU utilisation", f"{num(result.gpu_util)}%", "mean over the window"))
        rows.append(("NVDEC utilisation", "-" if result.nvdec_util is None
                     else f"{num(result.nvdec_util)}%", "the GPU's video decoders, mean over "
                     "the window (-: the device gives no figure)"))
    rows += [
        ("live view", f"health {result.health_end or '-'}",
         f"viewer: {result.viewer_served} snapshots served ({result.viewer_pictures} "
         f"distinct pictures), {result.viewer_missing} not "
         f"(503 or error) over {len(result.watched)} cameras; saved: "
         f"{', '.join(result.saved_jpegs) or 'none'}"),
        ("exit status after SIGINT", num(result.exit_code),
         EXIT_MEANING.get(result.exit_code, "killed by a signal")
         if result.exit_code is not None else ""),
    ]
    lines = [header, "", "| measurement | value | notes |", "|---|---|---|"]
    lines += [f"| {name} | {value} | {notes} |" for name, value, notes in rows]
    lines.append("")
    for note in result.notes:
        lines.append(f"Note: {note}")
    verdict = "held" if result.held else "NOT held"
    lines.append(f"Verdict: {verdict} ({num(result.dropped)} dropped, p99 "
                 f"{bucket_text(result.p99)}, delivered {num(result.delivered)} of "
                 f"{num(result.offered)} fps offered; held = 0 dropped, p99 <= "
                 f"{1000 * P99_LIMIT_S:g} ms, delivered >= {100 * DELIVERED_SHARE:g}%); "
                 f"add {'ok' if control.added_ok else 'FAILED'}, "
                 f"remove {'ok' if control.removed_ok else 'FAILED'}")
    return "\n".join(lines) + "\n"


def camera_clip(small: bool, assets: Path) -> Path:
    """The clip a camera plays (once): bikes.mp4 (small), else the benchmarks' 1080p clip made
    from it (``benchmarks.overlap_benchmark.make_1080p_clip``, cached under ``assets/cache``)."""
    from benchmarks.overlap_benchmark import CLIP_BITRATE, CLIP_NAME, make_1080p_clip
    from samples.fetch import SamplePaths

    bikes = SamplePaths.under(assets).bikes
    if not bikes.exists():
        raise BenchmarkError(f"{bikes} is missing: run python -m samples.fetch")
    return bikes if small else make_1080p_clip(bikes, assets / "cache" / CLIP_NAME,
                                               bitrate=CLIP_BITRATE)


def make_clip(small: bool, assets: Path, seconds: float, pace_fps: float) -> tuple[Path, str]:
    """The cameras' clip (``camera_clip``) repeated to last ``seconds`` at ``pace_fps``, and
    its description."""
    from pipeline.app.clips import clip_frames, make_looped_clip

    clip = camera_clip(small, assets)
    repeats = max(1, math.ceil(pace_fps * seconds / clip_frames(clip)))
    looped = make_looped_clip(clip, assets / "cache" / f"{clip.stem}_x{repeats}.mp4", repeats)
    return looped, f"{clip.name} repeated {repeats}x ({clip_frames(looped):,} frames)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.live_control",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="CPU-only mode for CI")
    parser.add_argument("--cameras", type=int, default=None, help="default 100; small: 2")
    parser.add_argument("--workers", type=int, default=None,
                        help="runtime.workers (default: not set, the automatic count; small: 2)")
    parser.add_argument("--pace-fps", type=float, default=None, help="default 30; small: 2")
    parser.add_argument("--warmup-s", type=float, default=None, help="default 10; small: 2")
    parser.add_argument("--seconds", type=float, default=None,
                        help="the window, at least 5 (default 30; small: 10)")
    parser.add_argument("--decode", choices=("auto", "cpu", "gpu"), default="auto")
    parser.add_argument("--engine-cache", type=Path, default=REPO_ROOT / "assets" / "engines")
    parser.add_argument("--assets", type=Path, default=REPO_ROOT / "assets")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="end within about this many seconds: the start may take what "
                             "the warm-up, the window and saving and stopping leave")
    parser.add_argument("--out", type=Path, default=Path("/tmp/live-control"),
                        help="folder for the config, run.log, the page, JPEGs and the table")
    began = time.monotonic()
    args = parser.parse_args(argv)
    small = args.small
    cameras = args.cameras or (2 if small else 100)
    workers = args.workers if args.workers is not None else (2 if small else None)
    pace_fps = args.pace_fps or (2.0 if small else 30.0)
    warmup_s = args.warmup_s if args.warmup_s is not None else (2.0 if small else 10.0)
    seconds = args.seconds or (10.0 if small else 30.0)
    if seconds < 5:
        parser.error(f"--seconds: at least 5 (hosts report once a second), got {seconds:g}")
    if cameras < 1 or (workers is not None and workers < 1):
        parser.error("--cameras and --workers: at least 1")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in ("index.html", "sources.json", "health.json", "results.md"):
        (out / old).unlink(missing_ok=True)
    for old in (out / "snapshots").glob("*.jpg"):
        old.unlink()
    assets = args.assets.resolve()
    try:
        # a camera plays from its host's start: warm-up, window, saving, stop, and a margin
        run_s = warmup_s + seconds + 120
        clip, clip_text = make_clip(small, assets, run_s, pace_fps)
        if small:
            model, names = assets / "models" / "yolov3-tiny.onnx", assets / "models" / "coco.names"
            what = "YOLOv3-tiny 416, onnxruntime on the CPU"
        else:
            from samples.yolov8 import ensure_yolov8

            model, names = ensure_yolov8(assets, log=print)
            what = f"YOLOv8s-fall 640, torch FP16, batch 64, compile cache {args.engine_cache}"
        records = Path(tempfile.mkdtemp(prefix="live-control-records-"))
        health_s = HEALTH_TIMEOUT_S["small" if small else "full"]
        if args.budget_s is not None:
            health_s = min(health_s, args.budget_s - (time.monotonic() - began) - warmup_s
                           - seconds - AFTER_WINDOW_S)
            if health_s < 30:
                raise BenchmarkError(f"--budget-s {args.budget_s:g}: no time left to start "
                                     f"(warm-up {warmup_s:g} s + window {seconds:g} s + "
                                     f"{AFTER_WINDOW_S:g} s to save and stop)")
        plan = Plan(small, cameras, workers, pace_fps, warmup_s, seconds, args.decode, clip,
                    model, names, args.engine_cache.resolve(), out, records, free_port(),
                    free_port(), health_s)
        config_path = out / "config.yaml"
        config_path.write_text(yaml.safe_dump(plan.config(), sort_keys=False))
        command = [sys.executable, "run.py", "--config", str(config_path)]
        me = "python -m benchmarks.live_control " + shlex.join(argv if argv is not None
                                                              else sys.argv[1:])
        layout = (f"runtime.workers {workers}" if workers is not None
                  else "default workers (runtime.workers not set)")
        header = (f"Live control ({me.strip()}): `{shlex.join(['python', *command[1:]])}`; "
                  f"{cameras} paced cameras (live, {pace_fps:g} fps, reconnect off, decode "
                  f"{args.decode}), {layout}, runtime.http on; "
                  f"{what}; clip {clip_text}; outputs: JSONL only. Latency percentiles are "
                  f"histogram buckets (bounds 5, 10, 20, 50, 100, 200, 500 ms, ...).")
        print(f"launching: {shlex.join(['python', *command[1:]])} (log: {out / 'run.log'})",
              flush=True)
        result = Result()
        try:
            measure(plan, command, result)
        except (MeasurementError, OSError, ValueError) as error:
            result.notes.append(f"failed: {error}")
        finally:
            shutil.rmtree(records, ignore_errors=True)
    except ImportError as error:
        print(f"error: {error.name or error} is not installed", file=sys.stderr)
        return 1
    except (BenchmarkError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    table = markdown(plan, result, header)
    (out / "results.md").write_text(table)
    print(f"saved under {out}: results.md, run.log, config.yaml, index.html, sources.json, "
          f"health.json, snapshots/ ({len(result.saved_jpegs)} JPEGs), metrics-start.txt, "
          f"metrics-end.txt; render the page with: python -m benchmarks.render_page {out}")
    print(table, end="")
    # held or not is the result; a measurement that failed (or add/remove that did) is not
    worked = (result.delivered is not None and result.control.added_ok
              and result.control.removed_ok)
    return 0 if worked else 1


if __name__ == "__main__":
    raise SystemExit(main())
