"""Command line: ``python run.py --config configs/file.yaml`` (``streamdet``): parses the
arguments and the configuration, then runs it the one way every run goes
(``pipeline.app.run``: its docstring has the exit status table). ``run.py capacity --config
cams.yaml --clip my.mp4`` measures how many cameras hold (``pipeline.app.capacity``).
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog

from pipeline.app.output_lock import lock_outputs, missing_folders, remove_made
from pipeline.app.run import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, run
from pipeline.config import ConfigError, PipelineConfig, describe_schema, load_config
from pipeline.logging import configure_logging

log = structlog.get_logger("run")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="streamdet" if Path(sys.argv[0]).name == "streamdet" else "run.py",
        description="Detect objects in video files and RTSP cameras with a YOLO ONNX model; "
                    "write annotated MP4 and JSON Lines detections per source.",
        epilog="Configuration keys: run.py --help-config. Example: configs/file.yaml.",
    )
    parser.add_argument("command", nargs="?", default="run",
                        choices=["run", "build-engine", "capacity"],
                        help="run the pipeline (default), build the TensorRT engine ahead "
                             "of deployment, or find how many cameras of --clip this machine "
                             "holds (capacity)")
    parser.add_argument("--config", "-c", help="YAML configuration file")
    parser.add_argument("--log-format", choices=["console", "json"],
                        help="override runtime.log_format")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                        help="override runtime.log_level")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="override a configuration key, e.g. --set inference.batch_size=8 "
                             "or --set sources[0].uri=rtsp://...; repeatable")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--restart", action="store_true",
                        help="start every file source from its beginning, even one a stopped "
                             "run left cut short (by default it resumes after its last record)")
    parser.add_argument("--ray", metavar="auto|ADDRESS|local",
                        help="run one unit per GPU (its engine and source workers) as a Ray actor "
                             "across the Ray cluster (on the CPU path: one per node): "
                             "auto joins the cluster of this machine, ADDRESS another (its "
                             "head, head:6379, or Ray's client, ray://head:10001), local "
                             "starts one here; needs the ray extra")
    parser.add_argument("--help-config", action="store_true",
                        help="list every configuration key with its default and meaning")
    capacity = parser.add_argument_group(
        "capacity", "run.py capacity --config cams.yaml --clip my.mp4 [--fps 30]: play the clip "
        "as N paced live cameras through the run path (the config's model, inference and "
        "runtime; its sources replaced by cameras set like its first source) and find the "
        "largest N held: 0 dropped, p99 latency <= 100 ms, >= 95% of the frames delivered")
    capacity.add_argument("--clip", type=Path, help="the video every camera plays")
    capacity.add_argument("--fps", type=float, help="each camera's frames/s (default: the clip's)")
    capacity.add_argument("--cameras", metavar="N,N,...",
                          help="camera counts to try (default: search from an estimate, "
                               "doubling, then bisecting)")
    capacity.add_argument("--budget-s", type=float, help="the longest it may take (default 1800)")
    capacity.add_argument("--warmup-s", type=float,
                          help="seconds after every camera delivered before the window "
                               "(default 10)")
    capacity.add_argument("--seconds", type=float, help="the measured window (default 30)")
    capacity.add_argument("--out", type=str,
                          help="folder for each run's config and log, results.md and "
                               "results.json (default: a new temporary folder, named under "
                               "the table)")
    capacity.add_argument("--decoders", type=int,
                          help="decode alone's parallel decoders (default: 16 on NVDEC, one "
                               "per core on the CPU)")
    capacity.add_argument("--no-ceilings", action="store_true",
                          help="skip decode alone and engine alone")
    capacity.add_argument("--unpaced", type=int, metavar="N",
                          help="also measure N cameras reading the clip as fast as they can "
                               "(live, no pace): delivered frames/s beside the slower ceiling "
                               "(without --cameras: no paced counts)")
    capacity.add_argument("--http", action="store_true",
                          help="the live view on (runtime.http on 127.0.0.1, a free port); a "
                               "camera added through its API at 20%% of each window and "
                               "removed at 60%%")
    return parser.parse_args(argv)


CAPACITY_OPTIONS = ("clip", "fps", "cameras", "budget_s", "warmup_s", "seconds", "out",
                    "decoders", "unpaced")


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (``argv``, else this process's own: then the process ends with it,
    and a run's end leaves SIGINT and SIGTERM ignored: ``run_command``)."""
    args = parse_args(argv)
    args.exiting = argv is None
    if args.help_config:
        print("\n".join(describe_schema()))
        return EXIT_OK
    if not args.config:
        print("error: --config is required (for example: --config configs/file.yaml)",
              file=sys.stderr)
        return EXIT_USAGE
    given = [f"--{name.replace('_', '-')}" for name in CAPACITY_OPTIONS
             if getattr(args, name) is not None] + ["--no-ceilings"] * args.no_ceilings \
        + ["--http"] * args.http
    if args.command == "capacity":
        return capacity(args)
    if given:
        print(f"error: {', '.join(given)}: options of the capacity command (run.py capacity "
              f"--config cams.yaml --clip my.mp4)", file=sys.stderr)
        return EXIT_USAGE
    if args.ray is not None:
        from pipeline.app.ray_cluster import ray_missing

        if (missing := ray_missing(args.ray)) is not None:
            print(f"error: {missing}", file=sys.stderr)
            return EXIT_USAGE
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # A script's background job (`run.py ... &`) starts with SIGINT ignored; a run stops
        # on it all the same, as capacity does: while it starts as a KeyboardInterrupt (exit
        # 130), then gracefully (``run.install_signal_handlers``).
        signal.signal(signal.SIGINT, signal.default_int_handler)
    made: list[Path] = []
    lock = None
    try:
        config = load_config(args.config, args.overrides)
        if args.command == "run":
            made = make_output_dir(Path(config.output.dir))
            lock = lock_outputs(config)  # before any .partial file is looked at
            made = lock.made + made
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        remove_made(made)
        return EXIT_USAGE
    try:
        return run_command(args, config, made)
    finally:
        if lock is not None:
            lock.release()


def run_command(args: argparse.Namespace, config: PipelineConfig, made: list[Path]) -> int:
    """``run`` or ``build-engine`` with a valid config (``made``: the output folders this run
    created, removed again if it leaves them empty: refused, or failed to start)."""
    runtime = config.runtime
    # Into the config, which every process of the run logs by (the engine's and the workers'
    # lines once ignored --log-format and --log-level: console lines among the JSON).
    runtime.log_format = args.log_format or runtime.log_format
    runtime.log_level = args.log_level or runtime.log_level
    configure_logging(runtime.log_format, runtime.log_level)
    if args.no_progress:
        runtime.progress = False
    if args.command == "build-engine":
        return one_line_errors(lambda: build_engine(config))
    status = one_line_errors(lambda: run(config, args.ray, restart=args.restart))
    if args.exiting:  # the status is decided and the process ends: a Ctrl-C from here on
        for signum in (signal.SIGINT, signal.SIGTERM):  # (its exit's cleanup included) once
            signal.signal(signum, signal.SIG_IGN)  # made a finished run exit 130
    remove_made(made)  # those still empty: refused (a model that is not one) or failed to
    return status  # start (the live view's port in use) before anything was written


def make_output_dir(folder: Path) -> list[Path]:
    """Create ``output.dir`` (and its parents) and write a file in it, before anything
    starts: a folder the run cannot write is a config error, not a failure after the model
    has loaded. Returns the folders it created, the deepest first.

    Raises:
        ConfigError: it cannot be created or written in (one line).
    """
    made = missing_folders(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise ConfigError(f"output.dir: cannot create or write in {str(folder)!r}: "
                          f"{error.strerror or error}") from None
    return made


def one_line_errors(command: Callable[[], int]) -> int:
    """``command()``'s exit status; Ctrl-C or an unexpected error as one line (the traceback
    at debug level) and its exit status, never a traceback on the terminal."""
    try:
        return command()
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:  # noqa: BLE001 - one line for the user, details at debug
        log.debug("traceback", text=traceback.format_exc())
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        return EXIT_FAILED


def capacity(args: argparse.Namespace) -> int:
    """``run.py capacity``: how many paced cameras of ``--clip`` hold (``pipeline.app.capacity``)."""
    from pipeline.app.capacity import Options, main, parse_counts

    configure_logging(args.log_format or "console", args.log_level or "warning")
    if args.clip is None:
        print("error: capacity: --clip is required (the video every camera plays)",
              file=sys.stderr)
        return EXIT_USAGE
    if args.ray is not None or args.restart:
        print("error: capacity: --ray and --restart are options of run, not of capacity",
              file=sys.stderr)
        return EXIT_USAGE
    if args.out == "":  # ``--out "$OUT"`` with OUT unset: not the current folder
        print("error: --out: an empty path (give a folder, or leave --out out for a new "
              "temporary folder)", file=sys.stderr)
        return EXIT_USAGE
    options = Options(Path(args.config), args.clip, list(args.overrides), args.fps,
                      decoders=args.decoders, ceilings=not args.no_ceilings,
                      out=None if args.out is None else Path(args.out),
                      unpaced=args.unpaced, http=args.http)
    for name in ("budget_s", "warmup_s", "seconds"):
        if getattr(args, name) is not None:
            setattr(options, name, getattr(args, name))
    try:
        if args.cameras is not None:
            options.cameras = parse_counts(args.cameras)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE

    def measure() -> int:
        try:
            return main(options)
        except ConfigError as error:
            print(f"error: {error}", file=sys.stderr)
            return EXIT_USAGE

    return one_line_errors(measure)


def build_engine(config: PipelineConfig) -> int:
    """Build (or find in the cache) the TensorRT engine for the configured model."""
    from pipeline.app.build import first_file_source
    from stages.backends.tensorrt import EngineBuildError, build_engine_cli

    inference = config.inference
    try:
        path = build_engine_cli(
            config.model.path, inference.batch_size, inference.precision, inference.engine_cache,
            calibration_video=inference.calibration_video or first_file_source(config),
            calibration_method=inference.calibration_method,
            calibration_frames=inference.calibration_frames)
    except ImportError as error:  # what this machine lacks, as a run's missing backend
        print(f"error: TensorRT is not installed ({error})", file=sys.stderr)
        return EXIT_USAGE
    except (EngineBuildError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_FAILED
    print(path)
    return EXIT_OK


if __name__ == "__main__":  # python -m pipeline.app.cli: what capacity starts
    sys.exit(main())
