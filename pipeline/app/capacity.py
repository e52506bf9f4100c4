"""How many cameras will this machine hold? ``python run.py capacity --config cams.yaml --clip
my.mp4 [--fps 30]`` plays the clip as N paced live cameras through the run path users take
and finds the largest N that holds, beside what decode and the engine reach alone.
``--unpaced N`` adds a row of N cameras reading as fast as they can (throughput, beside the
slower of those ceilings); ``--http`` turns the live view on and adds and removes a camera
through its API in each window; ``--set KEY=VALUE`` changes the user's configuration (its
``runtime.http`` keys win over the free loopback port given to the live view).

    cams.yaml (model, inference, runtime, outputs) ──┐
    my.mp4 (looped by a stream copy when too short) ─┴─> N.yaml: sources = N cameras
        {camNNN: the clip, live: true, pace_fps: FPS, reconnect: false}, each otherwise set
        like cams.yaml's first source (tracker, analytics, ...); outputs into a temporary
        folder (its events and snapshots counted, then deleted); Prometheus on a free port
    for each N the search picks (then the unpaced N: pace_fps null, the clip looped longer):
        python -m pipeline.app.cli run --config N.yaml   (a child process, its own group)
        └─ pipeline.app.measurement: every camera delivering, --warmup-s, a --seconds window
           of Prometheus scrapes -> delivered, dropped, p50/p99, stages' work and blocked s;
           mid-window, on the GPU path, nvidia-smi's device memory per process; with --http
           POST a camera at 20% of the window, DELETE it at 60% (pipeline.app.api_client);
           after the run, the engine's stages and the processes' drops by why from its
           log (pipeline.app.run_log)
    decode alone, engine alone: python -m pipeline.app.ceilings (child processes, first)
    the rows, the table, results.md and results.json: pipeline.app.capacity_report

Held (``measurement.Window.held``): 0 dropped, p99 capture-to-sink latency <= 100 ms and
delivered >= 95% of offered, over the window. A paced row delivering less than that is an
overload (``capacity_report``): its drops and p99 are reported, against bounded latency.
The search: ``--cameras 50,100,150`` tries those; by default it starts at an estimate (half
of what the slower of decode alone and engine alone could feed at FPS, or ``DEFAULT_START``
without them), doubles while N holds (halves while it does not), then bisects between the
largest N that held and the smallest above it that did not, down to one camera.
``--budget-s`` caps the whole command: a run that would not fit in what is left is not
started (the table says so). The process that measures never creates a CUDA context: every
GPU user is a child.

Exit status: 0 when at least one N was measured (held or not: the table is the result), 1
when none could be, 2 for a bad ``--clip``, configuration or option (one line, nothing run),
130 when interrupted (Ctrl-C or SIGTERM: the running child is stopped with one SIGINT, the
table of the runs so far printed).
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from pipeline.app.api_client import ADDED, AddRemove, add_and_remove
from pipeline.app.capacity_report import (
    Options,
    RunRow,
    header_text,
    held_text,
    plural,
    report,
    results_json,
)
from pipeline.app.measurement import (
    MeasurementError,
    MetricsPoller,
    UtilisationSampler,
    Window,
    child_env,
    cores_busy,
    cpu_ticks,
    free_port,
    gpu_memory,
    launch,
    process_tree,
    query_compute_apps,
    said,
    stop,
    wait_delivering,
    window_numbers,
)
from pipeline.app.run_log import drop_reasons, engine_lines, engine_windows, model_loaded
from pipeline.config import (
    ConfigError,
    PipelineConfig,
    apply_overrides,
    parse_config,
    read_config_data,
    substitute_env,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
DEFAULT_START = 4  # cameras of the first run when no ceiling gives an estimate
MAX_CAMERAS = 4096  # the search never doubles past this
START_TIMEOUT_S = 300.0  # launch until every camera delivered (model load, compile, warm-up)
STOP_S = 30.0  # what stopping a run takes, at most, in the budget's reckoning
CEILING_TIMEOUT_S = 900.0  # a ceiling child (an engine compiled from a cold cache)
# an unpaced camera's clip: long enough for UNPACED_MARGIN x its share of decode alone (as
# placed; UNPACED_CAMERA_FPS without it) over UNPACED_START_S + the warm-up + the window
UNPACED_MARGIN, UNPACED_CAMERA_FPS, UNPACED_START_S = 1.5, 250.0, 30.0


def check_clip(clip: Path) -> tuple[int, float | None]:
    """(frames, frame rate or None) of a clip whose first frame decodes.

    Raises:
        ConfigError: ``--clip: ...`` missing, a folder, not a video, or undecodable.
    """
    from pipeline.app.build import probe_frame_size
    from pipeline.app.clips import clip_frames, clip_rate

    if clip.is_dir():
        raise ConfigError(f"--clip: {str(clip)!r} is a folder, not a video file")
    if not clip.is_file():
        raise ConfigError(f"--clip: file not found: {str(clip)!r}")
    try:
        probe_frame_size(str(clip))
        return clip_frames(clip), clip_rate(clip)
    except ConfigError as error:
        raise ConfigError(f"--clip: {error}") from None


CAMERA_KEYS = ("name", "uri", "live", "pace_fps", "reconnect", "loop")  # what a camera sets


def camera_sources(count: int, clip: Path, fps: float | None,
                   user: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """``count`` live cameras playing ``clip``: ``cam000``, ``cam001``, ...; paced at ``fps``,
    or unpaced (None: each reads as fast as it decodes, and drops what the pipeline cannot
    take, as a live source does). Each is set like the first source of ``user`` (the user's
    YAML; its tracker, analytics, detect_every, decode, ...) but for ``CAMERA_KEYS``."""
    sources = (user or {}).get("sources") or [{}]
    like = {k: v for k, v in (sources[0] if isinstance(sources[0], dict) else {}).items()
            if k not in CAMERA_KEYS}
    return [{**copy.deepcopy(like), "name": f"cam{i:03d}", "uri": str(clip), "live": True,
             "pace_fps": fps, "reconnect": False} for i in range(count)]


def read_user_config(path: Path, overrides: list[str], clip: Path, fps: float
                     ) -> tuple[dict[str, Any], PipelineConfig]:
    """The user's YAML as written (``${VAR}`` kept for the child to fill), ``overrides``
    applied, and the configuration of one camera of ``clip`` set like its first source
    (``camera_sources``), validated: the cameras of every run are valid so too.

    Raises:
        ConfigError: the file is missing, not YAML, or holds a bad value (the key named).
    """
    data = read_config_data(path, overrides)
    if not isinstance(data, dict):
        parse_config(data)  # raises the one-line error of a file that is not a mapping
    one = camera_sources(1, clip, fps, data)
    return data, parse_config(substitute_env({**data, "sources": one}, os.environ))


def run_config(user: dict[str, Any], cameras: int, clip: Path, fps: float | None,
               records: Path, metrics_port: int, http: bool = False,
               overrides: list[str] | None = None) -> dict[str, Any]:
    """The configuration of one run: the user's with its sources replaced by ``cameras``
    cameras, its outputs in ``records`` (video only if the user's config names one; no
    MQTT: the cameras are not real), Prometheus on ``metrics_port`` of 127.0.0.1, no
    progress bar, and no end but SIGINT. The live view, when configured or asked for
    (``http``: without a token, for the API calls), moves to a free port of 127.0.0.1, but
    for what ``overrides`` (``--set``) say of ``runtime.http``. ``runtime.workers`` is the
    user's (null: automatic)."""
    data = copy.deepcopy(user)
    data["sources"] = camera_sources(cameras, clip, fps, user)
    output = dict(data.get("output") or {})
    output["dir"] = str(records)
    output.setdefault("video", None)
    output.pop("mqtt", None)
    data["output"] = output
    runtime = dict(data.get("runtime") or {})
    runtime.pop("metrics_token", None)
    runtime.update(metrics_port=metrics_port, metrics_host="127.0.0.1", progress=False,
                   stop_when="never")
    if http:
        runtime["http"] = {k: v for k, v in (runtime.get("http") or {}).items() if k != "token"}
    if runtime.get("http") is not None:
        runtime["http"] = {**runtime["http"], "host": "127.0.0.1", "port": free_port()}
    data["runtime"] = runtime
    mine = [o for o in overrides or () if o.partition("=")[0].strip().startswith("runtime.http")]
    return apply_overrides(data, mine)


def write_config(data: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# ---- the search --------------------------------------------------------------------------


def next_count(tried: dict[int, bool], start: int, most: int = MAX_CAMERAS) -> int | None:
    """The next camera count to try given ``tried`` (count -> held), or None when the
    largest count that holds is known: ``start`` first; doubled while every count held,
    halved while none did; then the middle between the largest that held and the smallest
    above it that did not, until they are one apart."""
    if not tried:
        return max(1, min(start, most))
    held = [n for n, ok in tried.items() if ok]
    low = max(held, default=0)
    above = [n for n, ok in tried.items() if not ok and n > low]
    if not above:
        return min(2 * low, most) if low < most else None
    high = min(above)
    if low == 0:
        return high // 2 if high > 1 else None
    return (low + high) // 2 if high - low > 1 else None


def estimate(ceilings: dict[str, dict[str, Any]], fps: float) -> int:
    """Half the cameras the slower of decode alone and engine alone could feed at ``fps``
    (``DEFAULT_START`` when neither was measured)."""
    rates = [c[key] for c, key in ((ceilings.get("decode"), "fps"),
                                   (ceilings.get("engine"), "images_s"))
             if c is not None and c.get(key)]
    if not rates:
        return DEFAULT_START
    return max(1, math.floor(0.5 * min(rates) / fps))


# ---- the measurements ----------------------------------------------------------------------


class UsageError(Exception):
    """A child said the configuration cannot run here (its exit status 2): stop, exit 2."""


def measure_ceiling(what: str, config_path: Path, log: Path, seconds: float,
                    decoders: int | None, timeout_s: float) -> dict[str, Any]:
    """Decode alone or engine alone (``pipeline.app.ceilings``) in a child process.

    Raises:
        UsageError: the child exited 2 (its error line).
        MeasurementError: it failed otherwise (its error line), or took longer than
            ``timeout_s``.
    """
    command = [sys.executable, "-m", "pipeline.app.ceilings", what, "--config",
               str(config_path), "--seconds", f"{seconds:g}"]
    if what == "decode" and decoders:
        command += ["--decoders", str(decoders)]
    with open(log, "w") as errors:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors,
                                   stdin=subprocess.DEVNULL, text=True, env=child_env(),
                                   start_new_session=True)
        try:
            output, _ = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop(process, 30.0)
            raise MeasurementError(f"took longer than {timeout_s:g} s") from None
        except BaseException:
            stop(process, 30.0)
            raise
    text = log.read_text().strip()
    last = next((line for line in reversed(text.splitlines()) if line.startswith("error:")),
                f"exit status {process.returncode}; see {log.name}")
    if process.returncode == EXIT_USAGE:
        raise UsageError(last.removeprefix("error: "))
    if process.returncode != 0:
        raise MeasurementError(last.removeprefix("error: "))
    return json.loads(output.strip().splitlines()[-1])


def measure_cameras(options: Options, user: dict[str, Any], clip: Path, fps: float | None,
                    cameras: int, folder: Path, start_limit_s: float, gpu: bool) -> RunRow:
    """One run of ``cameras`` cameras (paced at ``fps``; None: unpaced) through ``python -m
    pipeline.app.cli run`` (module docstring); its config, ``run.log`` and the scrapes at the
    window's ends go to ``folder``. In the window, on the GPU path, the device memory is
    sampled once; with ``options.http`` a camera is added and removed through the API. After
    the run, the engine's stages are read from its log.

    Raises:
        UsageError: run.py refused the configuration (exit status 2).
    """
    row = RunRow(cameras, fps)
    folder.mkdir(parents=True, exist_ok=True)
    records = Path(tempfile.mkdtemp(prefix="capacity-records-"))
    port = free_port()
    data = run_config(user, cameras, clip, fps, records, port, options.http, options.overrides)
    config = write_config(data, folder / "config.yaml")
    http = data["runtime"].get("http")
    base = None if http is None else f"http://127.0.0.1:{http['port']}"
    names = {source["name"] for source in camera_sources(cameras, clip, fps)}
    poller = MetricsPoller(f"http://127.0.0.1:{port}/metrics")
    command = [sys.executable, "-m", "pipeline.app.cli", "run", "--config", str(config),
               "--no-progress"]
    started = time.monotonic()
    process, reader = launch(command, folder / "run.log")
    apps, tree, span = None, set(), None
    try:
        poller.start()
        row.start_s = wait_delivering(poller, process, names, start_limit_s, started)
        time.sleep(options.warmup_s)
        window = Window(offered=None if fps is None else cameras * fps)
        control = None
        with UtilisationSampler(gpu) as sampler:
            t0, p0, ticks0 = time.monotonic(), time.perf_counter(), cpu_ticks()
            (folder / "metrics-start.txt").write_text(poller.scrape())
            if options.http and base is not None:
                control = ControlThread(base, camera_sources(1, clip, fps, user)[0]
                                        | {"name": ADDED},
                                        t0, options.seconds, poller.host_of)
            time.sleep(max(0.0, t0 + options.seconds / 2 - time.monotonic()))
            if gpu:
                apps, tree = query_compute_apps(), process_tree(process.pid)
            time.sleep(max(0.0, t0 + options.seconds - time.monotonic()))
            (folder / "metrics-end.txt").write_text(poller.scrape())
            t1, p1, ticks1 = time.monotonic(), time.perf_counter(), cpu_ticks()
        window.gpu_util, window.nvdec_util = sampler.mean(p0, p1) or (None, None)
        window.cpu_busy = cores_busy(ticks0, ticks1)
        window.cpus = ticks1.cpus if ticks1 is not None else None
        window.window_s = t1 - t0
        span = (t0 - started, t1 - started)
        if control is not None:
            row.control = control.result()
        if process.poll() is not None:
            raise MeasurementError(f"run.py exited with {process.returncode} in the "
                                   f"window{said(process)}")
        window_numbers(poller, t0, t1, names, window)
        row.window = window
    except (MeasurementError, OSError, ValueError) as error:
        row.error = str(error)
    finally:
        poller.stop()
        row.exit_code, note = stop(process)
        reader.join(10)
        row.took_s = time.monotonic() - started
        if data["output"].get("events"):
            row.events, row.snapshots = events_written(records, data["output"]["events"])
        shutil.rmtree(records, ignore_errors=True)
    if row.window is not None and span is not None:
        lines = (folder / "run.log").read_text(errors="replace").splitlines()
        engines = engine_windows(engine_lines(lines), *span)
        row.window.add_engines(engines)
        row.window.drop_reasons = drop_reasons(lines, *span)
        row.window.gpu_memory = gpu_memory(apps, tree)
        if row.window.gpu_memory is not None:
            row.window.gpu_memory.engine_pids = sorted(p for p in engines if p is not None)
    if note is not None:
        row.error = row.error or note
    if row.exit_code == EXIT_USAGE:
        raise UsageError(getattr(process, "last_error", "run.py: bad configuration")
                         .removeprefix("error: "))
    if row.error is None and row.exit_code not in (0, None):
        row.error = f"run.py exited with {row.exit_code}{said(process)}"
    return row


def events_written(records: Path, pattern: str) -> tuple[int, int]:
    """(event lines, snapshot JPEGs) a run wrote into ``records``, its events files named by
    ``pattern`` (``output.events``, ``{source}`` in it)."""
    events = sum(len(path.read_bytes().splitlines())
                 for path in records.glob(pattern.replace("{source}", "*")))
    return events, sum(1 for _ in records.rglob("*.jpg"))


class ControlThread:
    """``api_client.add_and_remove`` in a thread, beside the window's own timing."""

    def __init__(self, base: str, source: dict[str, Any], t0: float, seconds: float,
                 host_of: Callable[[], dict[str, str]]) -> None:
        self._result: AddRemove | None = None
        self._thread = threading.Thread(target=self._run, name="add-remove", daemon=True,
                                        args=(base, source, t0, seconds, host_of))
        self._thread.start()

    def _run(self, *args: Any) -> None:
        self._result = add_and_remove(*args)

    def result(self, wait_s: float = 200.0) -> AddRemove:
        """Its answers, once it ended (a DELETE may outlast the window), at most ``wait_s``."""
        self._thread.join(wait_s)
        if self._result is None:
            return AddRemove(notes=[f"add/remove still running {wait_s:g} s after the window"])
        return self._result


# ---- the command ---------------------------------------------------------------------------


def parse_counts(text: str) -> list[int]:
    """``50,100,150`` -> [50, 100, 150].

    Raises:
        ConfigError: not a list of positive whole numbers.
    """
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ConfigError(f"--cameras: expected camera counts like 50,100,150, got {text!r}")
    return counts


def check_options(options: Options) -> None:
    """Raise ``ConfigError`` (one line) for an option out of range."""
    if options.seconds < 5:
        raise ConfigError(f"--seconds: at least 5 (pipelines report metrics once a second), "
                          f"got {options.seconds:g}")
    if options.warmup_s < 0:
        raise ConfigError(f"--warmup-s: at least 0, got {options.warmup_s:g}")
    if options.fps is not None and options.fps <= 0:
        raise ConfigError(f"--fps: above 0, got {options.fps:g}")
    if options.budget_s <= 0:
        raise ConfigError(f"--budget-s: above 0, got {options.budget_s:g}")
    if options.decoders is not None and options.decoders < 1:
        raise ConfigError(f"--decoders: at least 1, got {options.decoders}")
    if options.unpaced is not None and options.unpaced < 1:
        raise ConfigError(f"--unpaced: at least 1 camera, got {options.unpaced}")


def check_out(out: Path | None) -> None:
    """Raise ``ConfigError`` (one line) unless ``--out`` is a folder this user can write in,
    or can be created (nothing is created here)."""
    if out is None:
        return
    try:
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out: {str(out)!r} is a file, not a folder")
        there = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    except OSError as error:
        raise ConfigError(f"--out: cannot use {str(out)!r}: {error.strerror or error}") from None
    if not there.is_dir():
        raise ConfigError(f"--out: cannot create {str(out)!r}: {str(there)!r} is a file, not a "
                          "folder")
    if not os.access(there, os.W_OK | os.X_OK):
        if there == out.absolute():
            raise ConfigError(f"--out: cannot write in {str(out)!r}: permission denied")
        raise ConfigError(f"--out: cannot create {str(out)!r}: no permission to write in "
                          f"{str(there)!r}")


def replaced_note(out: Path | None) -> str | None:
    """The line saying that ``--out`` holds an earlier run's results, which this run replaces
    (None when it holds none)."""
    earlier = [name for name in ("results.md", "results.json")
               if out is not None and (out / name).is_file()]
    if not earlier:
        return None
    return (f"--out {str(out)!r}: replacing the earlier results there ({', '.join(earlier)}, "
            "and the folder of each camera count measured again)")


def progress(text: str) -> None:
    print(f"capacity: {text}", file=sys.stderr, flush=True)


def search(measure: Callable[[int], bool], start: int, counts: list[int] | None = None,
           fits: Callable[[int], bool] = lambda count: True) -> dict[int, bool]:
    """Try camera counts until the largest that holds is known (``next_count`` from
    ``start``), or ``counts`` in their order when given; stop early at a count ``fits``
    refuses (the budget). Returns count -> held (``measure``'s answer)."""
    tried: dict[int, bool] = {}
    pending = None if counts is None else list(counts)
    while True:
        if pending is None:
            count = next_count(tried, start)
        else:
            count = pending.pop(0) if pending else None
        if count is None or not fits(count):
            return tried
        tried[count] = measure(count)


def prepare_inputs(options: Options) -> tuple[Any, dict[str, Any], Path, int, float]:
    """Check the options, the clip and the configuration before anything runs: (the
    configuration with one camera, the user's YAML, the clip's absolute path, its frames,
    the cameras' fps).

    Raises:
        ConfigError: the one line for the user (exit status 2).
    """
    from pipeline.app.run import prepare

    check_options(options)
    check_out(options.out)
    frames, rate = check_clip(options.clip)
    fps = options.fps or rate
    if not fps:
        raise ConfigError("--fps: the clip states no frame rate: give one")
    clip = options.clip.resolve()
    user, single = read_user_config(options.config, options.overrides, clip, fps)
    prepare(single, restart=True)  # the model, its classes, the clip's first frame
    return single, user, clip, frames, fps


def unpaced_clip(clip: Path, cameras: int, decode: dict[str, Any] | None, options: Options,
                 folder: Path) -> Path:
    """``clip``, looped long enough for ``cameras`` unpaced cameras: each reads as fast as it
    decodes, until the window's end (``UNPACED_MARGIN`` etc.: its share of ``decode``, decode
    alone as placed). A camera that still reaches its end is counted (``Window.ended``)."""
    from pipeline.app.clips import clip_for

    share = decode["fps"] / cameras if decode else UNPACED_CAMERA_FPS
    return clip_for(clip, UNPACED_START_S + options.warmup_s + options.seconds,
                    UNPACED_MARGIN * share, folder)


def measure_ceilings(options: Options, user: dict[str, Any], clip: Path, fps: float,
                     out: Path, time_left: Callable[[], float]) -> dict[str, Any]:
    """Engine alone, then decode alone, each in a child process: what each measured (a
    dict), or why it could not (a string).

    Raises:
        UsageError: a child found the configuration cannot run here.
    """
    seconds = min(10.0, max(2.0, options.seconds / 3))
    records = Path(tempfile.mkdtemp(prefix="capacity-records-"))
    try:
        config = write_config(run_config(user, 1, clip, fps, records, free_port()),
                              out / "ceilings.yaml")
        found: dict[str, Any] = {}
        for what in ("engine", "decode"):
            log = out / f"{what}-alone.log"
            progress(f"{what} alone ({seconds:g} s window; log: {log})")
            try:
                found[what] = measure_ceiling(what, config, log, seconds, options.decoders,
                                              min(CEILING_TIMEOUT_S, max(time_left(), 30.0)))
            except MeasurementError as error:
                found[what] = str(error)
        return found
    finally:
        shutil.rmtree(records, ignore_errors=True)


def budget_note(budget_s: float, count: int, left_s: float, took_s: float,
                needed_s: float) -> str | None:
    """Why a run of ``count`` cameras is not tried with ``left_s`` of ``--budget-s`` left, or
    None when it fits: it may take as long as the longest run so far (``took_s``), or its
    warm-up, window and stop (``needed_s``) and 10 s to start."""
    required = max(took_s, needed_s + 10.0)
    if left_s >= required:
        return None
    return (f"--budget-s {budget_s:g}: {plural(count, 'camera')} not tried ({left_s:.0f} s "
            f"left; a run may take {required:.0f} s: the longest so far took {took_s:.0f} s, "
            f"and start, warm-up, window and stop may take {needed_s + 10.0:.0f} s)")


def main(options: Options) -> int:
    """Run the command (module docstring); returns its exit status."""
    began = time.monotonic()

    def time_left() -> float:
        return options.budget_s - (time.monotonic() - began)

    try:
        single, user, clip, frames, fps = prepare_inputs(options)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    # the runs' configs, logs and scrapes: kept (the progress lines name the logs)
    out = (options.out or Path(tempfile.mkdtemp(prefix="capacity-logs-"))).resolve()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # what check_out could not tell (a race, root in /proc)
        print(f"error: --out: cannot create {str(out)!r}: {error.strerror or error}",
              file=sys.stderr)
        return EXIT_USAGE
    replacing = replaced_note(options.out)
    if replacing is not None:
        progress(replacing)
    work = Path(tempfile.mkdtemp(prefix="capacity-"))
    rows: list[RunRow] = []
    ceilings: dict[str, Any] = {}
    notes: list[str] = []
    header = ""
    # Ctrl-C and SIGTERM stop the command, even where SIGINT came in ignored (a shell's
    # background job ignores it, and Python then sets no handler of its own)
    previous = {signum: signal.signal(signum, _interrupt)
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        from pipeline.app.clips import clip_for

        # each camera plays from its start: the start, the warm-up, the window, the stop
        played = clip_for(clip, START_TIMEOUT_S + options.warmup_s + options.seconds + STOP_S,
                          fps, work)
        header = header_text(options, single, clip, played, frames, fps)
        if options.ceilings:
            ceilings = measure_ceilings(options, user, played, fps, out, time_left)
            decode = ceilings.get("decode")
            if isinstance(decode, dict) and decode.get("both_fps") is not None:
                # runtime.cpu_decode_fps set: decode: auto places cameras on both decoders
                decode["both_placed"] = bool(single.runtime.cpu_decode_fps)
            header = header_text(options, single, clip, played, frames, fps,
                                 ceilings.get("engine"))
        measured = {k: v for k, v in ceilings.items() if isinstance(v, dict)}
        needed = options.warmup_s + options.seconds + STOP_S

        def fits(count: int) -> bool:
            if not rows:
                return True
            took = max(row.took_s or 0.0 for row in rows)
            note = budget_note(options.budget_s, count, time_left(), took, needed)
            if note is not None:
                notes.append(note)
            return note is None

        def run_row(count: int, pace: float | None, plays: Path, folder: Path) -> RunRow:
            nonlocal header
            progress(f"{plural(count, 'camera')} "
                     + (f"at {pace:g} fps" if pace is not None else "unpaced")
                     + f" (log: {folder / 'run.log'})")
            row = measure_cameras(options, user, plays, pace, count, folder,
                                  min(START_TIMEOUT_S, max(time_left() - needed, 30.0)),
                                  single.inference.device != "cpu")
            rows.append(row)
            if not isinstance(ceilings.get("engine"), dict) and "auto" in (
                    single.inference.backend, single.inference.device):
                chosen = model_loaded(folder / "run.log")  # what the run's auto chose
                if chosen:
                    header = header_text(options, single, clip, played, frames, fps, chosen)
            return row

        def measure(count: int) -> bool:
            row = run_row(count, fps, played, out / f"cameras-{count:03d}")
            progress(f"{plural(count, 'camera')}: held {held_text(row)}")
            return row.held

        if options.cameras is not None or options.unpaced is None:
            search(measure, estimate(measured, fps), options.cameras, fits)
        if options.unpaced is not None and fits(options.unpaced):
            count = options.unpaced
            fast = unpaced_clip(clip, count, measured.get("decode"), options, work)
            row = run_row(count, None, fast, out / f"unpaced-{count:03d}")
            progress(f"{plural(count, 'camera')} unpaced: "
                     + (f"{row.window.delivered:,.1f} frames/s delivered"
                        if row.window is not None and row.window.delivered is not None
                        else f"failed ({row.error})"))
        status = EXIT_OK if any(row.window is not None for row in rows) else EXIT_FAILED
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        if options.out is None:
            shutil.rmtree(out, ignore_errors=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        notes.append("interrupted: the table holds the runs finished before")
        status = EXIT_INTERRUPTED
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        shutil.rmtree(work, ignore_errors=True)
    if options.out is None:
        notes.append(f"each run's config and run.log, and results.md / results.json: {out} "
                     "(--out DIR chooses the folder)")
    text = report(header, rows, ceilings, notes, fps)
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(
        json.dumps(results_json(options, rows, ceilings, notes, fps), indent=1))
    print(text, end="", flush=True)
    return status


def _interrupt(signum: int, _frame: object) -> None:
    """SIGINT and SIGTERM stop the command (as Ctrl-C does by default)."""
    raise KeyboardInterrupt
