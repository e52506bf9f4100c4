"""Command line: ``python run.py --config configs/file.yaml``.

Exit status (``EXIT_*``, one table):

- 0: every source finished (a camera stopped by Ctrl-C, SIGTERM or ``stop_when`` counts as
  finished: it has no end); every output has its final name.
- 1: a source or stage failed (its outputs stay ``.partial``).
- 2: a bad configuration or command line; nothing was written.
- 3: stopped early: a file source was stopped before its end (the first Ctrl-C or SIGTERM);
  its outputs keep their ``.partial`` names, and running the same command again resumes it
  after its last record (``--restart`` starts over).
- 130: aborted by a second Ctrl-C or SIGTERM (outputs are left as ``.partial``).
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import structlog

from pipeline.config import ConfigError, PipelineConfig, describe_schema, load_config
from pipeline.logging import configure_logging

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_STOPPED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

log = structlog.get_logger("run")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="streamdet" if Path(sys.argv[0]).name == "streamdet" else "run.py",
        description="Detect objects in video files and RTSP cameras with a YOLO ONNX model; "
                    "write annotated MP4 and JSON Lines detections per source.",
        epilog="Configuration keys: run.py --help-config. Example: configs/file.yaml.",
    )
    parser.add_argument("command", nargs="?", default="run", choices=["run", "build-engine"],
                        help="run the pipeline (default), or build the TensorRT engine ahead "
                             "of deployment")
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
                        help="run one pipeline per GPU as Ray actors across the Ray cluster: "
                             "auto joins the cluster of this machine, ADDRESS another "
                             "(ray://head:10001), local starts one here; needs the ray extra")
    parser.add_argument("--help-config", action="store_true",
                        help="list every configuration key with its default and meaning")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.help_config:
        print("\n".join(describe_schema()))
        return EXIT_OK
    if not args.config:
        print("error: --config is required (for example: --config configs/file.yaml)",
              file=sys.stderr)
        return EXIT_USAGE
    if args.ray is not None:
        from pipeline.app.ray_cluster import ray_missing

        if (missing := ray_missing()) is not None:
            print(f"error: {missing}", file=sys.stderr)
            return EXIT_USAGE
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    runtime = config.runtime
    configure_logging(args.log_format or runtime.log_format, args.log_level or runtime.log_level)
    if args.no_progress:
        runtime.progress = False
    try:
        if args.command == "build-engine":
            return build_engine(config)
        if args.ray is not None or runtime.gpus is not None or runtime.pipelines is not None:
            from pipeline.app.supervisor import run_cluster

            return run_cluster(config, args.ray, restart=args.restart)
        return run_pipeline(config, restart=args.restart)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:  # noqa: BLE001 - one line for the user, details at debug
        log.debug("traceback", text=traceback.format_exc())
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        return EXIT_FAILED


def run_pipeline(config: PipelineConfig, restart: bool = False) -> int:
    """Build the graph, run it with signal handling and print the summary.

    Args:
        config: the validated configuration.
        restart: start the file sources a stopped run left cut short from their beginning
            instead of resuming them (``resume_cut_files``).
    """
    from pipeline.app.build import DeviceUnavailable, build_graph
    from pipeline.app.progress import Progress
    from pipeline.graph import PipelineError
    from pipeline.records import BatchDetections
    from stages.infer import BackendUnavailable
    from stages.sinks import stopped_text

    try:
        resumed = {} if restart else resume_cut_files(config)
    except ValueError as error:
        print(f"error: output.jsonl: {error}; run with --restart to start over", file=sys.stderr)
        return EXIT_USAGE

    exporter = server = None
    if config.runtime.metrics_port is not None:
        from pipeline.app.prometheus import PrometheusExporter

        runtime = config.runtime
        exporter = PrometheusExporter(runtime.metrics_port, runtime.metrics_host,
                                      runtime.metrics_token)
    with Progress(enabled=config.runtime.progress) as progress:
        def batch_done(source: str, part: BatchDetections) -> None:
            progress.frames_done(len(part))
            if exporter is not None:
                exporter.observe_batch(source, time.time() - part.frames.capture_time)

        try:
            graph = build_graph(config, on_batch_done=batch_done)
            for name, frame in resumed.items():  # appends to the records (see SinkStage)
                graph.sinks[name].resume_from = frame
            if exporter is not None:
                port = exporter.start(graph)
                log.info("serving Prometheus metrics",
                         url=f"http://{config.runtime.metrics_host}:{port}/metrics")
            if config.runtime.http is not None:
                from pipeline.app.http import HttpServer
                from pipeline.app.view import local_board

                board, _, pump = local_board(graph, graph.preview, config)
                graph.add_service(pump.start, pump.close)  # the graph's reports, while it runs
                server = HttpServer(config.runtime.http, board, config)
                server.start()  # logs "serving the live view" with its URL
        except (ConfigError, DeviceUnavailable, BackendUnavailable) as error:
            print(f"error: {error}", file=sys.stderr)  # what was asked for cannot be had
            return EXIT_USAGE
        except (ValueError, OSError, RuntimeError) as error:  # a fault while starting
            print(f"error: failed to start: {type(error).__name__}: {error}", file=sys.stderr)
            return EXIT_FAILED
        progress.set_total(graph.sources)
        interrupts, previous = install_signal_handlers(graph)
        started = time.monotonic()
        try:
            graph.run()
            failure = None
        except PipelineError as error:
            failure = error
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            if exporter is not None:
                exporter.stop()
            if server is not None:
                server.close()
    elapsed = time.monotonic() - started
    cut = {name: stopped_text(*sink.stopped_at) for name, sink in graph.sinks.items()
           if getattr(sink, "stopped_at", None) is not None}
    _log_summary(graph, elapsed, cut)
    if interrupts["count"] >= 2:
        return EXIT_INTERRUPTED
    if failure is not None:
        print(f"error: {failure}", file=sys.stderr)
        return EXIT_FAILED
    failed = {name: m.error for name, m in graph.source_metrics.items() if m.error}
    for name, reason in failed.items():
        print(f"error: source {name}: {reason}", file=sys.stderr)
    if failed:
        return EXIT_FAILED
    in_config = {source.name for source in config.sources}
    for name, where in cut.items():
        if name in in_config:
            log.warning("stopped early: outputs kept as .partial; run the same command again "
                        "to resume (--restart: start over)", source=name, at=where)
        else:  # added through the API: a rerun of the config does not know it
            log.warning("stopped early: outputs kept as .partial (a source added while "
                        "running: add it to the config file to resume it)", source=name,
                        at=where)
    return EXIT_STOPPED if cut else EXIT_OK


def resume_cut_files(config: PipelineConfig) -> dict[str, int]:
    """Set the ``start_frame`` of every file source whose records an earlier run left cut
    short to the frame after its last record (``pipeline.resume.cut_files``), as the cluster
    supervisor resumes a moved source. Returns {source name: resume frame} of those; their
    sinks must append (``resume_from``).

    Raises:
        ValueError: a ``.partial`` JSONL file whose last line is not a record (not ours).
    """
    from pipeline.resume import cut_files

    resumed = cut_files(config)
    config.sources = [dataclasses.replace(s, start_frame=resumed[s.name])
                      if s.name in resumed else s for s in config.sources]
    return resumed


def install_signal_handlers(graph: object) -> tuple[dict[str, int], dict[int, object]]:
    """First SIGINT/SIGTERM: ``graph.request_stop()`` (a graceful stop); second:
    ``graph.abort()`` (a graph, or the cluster's supervisor). Returns the count and the
    handlers replaced (restored after the run)."""
    interrupts = {"count": 0}

    def handle(signum: int, _frame: object) -> None:
        interrupts["count"] += 1
        if interrupts["count"] == 1:
            log.warning("stopping: finishing queued frames (signal again to abort)",
                        signal=signal.Signals(signum).name)
            graph.request_stop()  # type: ignore[attr-defined]
        else:
            log.warning("aborting", signal=signal.Signals(signum).name)
            graph.abort()  # type: ignore[attr-defined]

    previous = {signum: signal.signal(signum, handle) for signum in (signal.SIGINT, signal.SIGTERM)}
    return interrupts, previous


def _log_summary(graph: object, elapsed: float, cut: dict[str, str]) -> None:
    """Stage and source summaries; ``cut``: where each file source stopped before its end
    (``stopped at frame N of M``), said in its summary as ``cut_short``."""
    for metrics in graph.stage_metrics.values():  # type: ignore[attr-defined]
        log.info("stage summary", **metrics.summary())
    for metrics in graph.source_metrics.values():  # type: ignore[attr-defined]
        extra = {"cut_short": cut[metrics.name]} if metrics.name in cut else {}
        log.info("source summary", **metrics.summary(elapsed), **extra)
    log.info("run finished", seconds=round(elapsed, 2))


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
    except ImportError as error:
        print(f"error: TensorRT is not installed ({error})", file=sys.stderr)
        return EXIT_FAILED
    except (EngineBuildError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_FAILED
    print(path)
    return EXIT_OK
