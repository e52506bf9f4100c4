"""One way to run, at every scale: ``run(config)`` is what ``run.py`` does, for one pipeline
or many, local processes or ``--ray``: check what can be checked before anything starts,
start the supervisor (``pipeline.app.supervisor``) with its hosts, the live view and the
Prometheus endpoint, handle the signals, log the summary and return the exit status.

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

import dataclasses
import functools
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import structlog

from pipeline.config import UNPACED_FILES, ConfigError, PipelineConfig, is_stream_url

FILES_ENDED_WITHOUT_FILES = (
    "stop_when is files_ended but no source is a file (a looped or live file plays as a "
    "camera): the run ends once every source has ended for good, or on Ctrl-C or SIGTERM, "
    "as with all_ended, unless a file source is added")

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_STOPPED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

log = structlog.get_logger("run")


def prepare(config: PipelineConfig, restart: bool = False) -> tuple[str, ...]:
    """What can be checked before any pipeline starts, in this process, once: the extras a
    feature needs, the model and its classes, every file's first frame, the sources' classes
    and zones against the model, the live view's settings. Returns the file sources an
    earlier run left cut short (they resume after their last record), none with ``restart``.
    First, what runs killed whole left behind is removed (``pipeline.app.leftovers``).

    Raises:
        ConfigError: the one-line message for the user (exit status 2).
    """
    from pipeline.app.build import check_extras, check_sources, model_setup, probe_file_sources
    from pipeline.app.leftovers import sweep
    from pipeline.resume import cut_files

    sweep()
    check_extras(config)
    model = model_setup(config)
    check_sources(config, model, probe_file_sources(config))
    warn_unpaced_files(config)
    warn_files_ended_without_files(config)
    if config.runtime.http is not None:
        from pipeline.app.http import check_settings

        try:
            check_settings(config.runtime.http)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    if restart:
        return ()
    try:
        return tuple(cut_files(config))
    except ValueError as error:
        raise ConfigError(f"output.jsonl: {error}; run with --restart to start over") from None


def warn_unpaced_files(config: PipelineConfig) -> None:
    """One warning for the file sources read live (``live: true`` or ``loop: true``) without
    ``pace_fps``: the source and its key when there is one, else how many and the first names
    (``capacity``'s unpaced row runs 100 such cameras on purpose)."""
    unpaced = [(i, source.name) for i, source in enumerate(config.sources)
               if source.is_live and not source.pace_fps and not is_stream_url(source.uri)]
    if len(unpaced) == 1:
        i, name = unpaced[0]
        log.warning(UNPACED_FILES, source=name, key=f"sources[{i}].pace_fps")
    elif unpaced:
        names = ", ".join(name for _, name in unpaced[:3])
        if len(unpaced) > 3:
            names += f" and {len(unpaced) - 3} more"
        log.warning(UNPACED_FILES, sources=len(unpaced), names=names, key="sources[].pace_fps")


def warn_files_ended_without_files(config: PipelineConfig) -> None:
    """One warning for ``runtime.stop_when: files_ended`` in a run with no file source (a
    looped or live file is a camera): it then ends as ``all_ended`` does, once every source
    has ended for good, which a camera does only by failing (a new user's run, whose one file
    had been set to a camera's URL, ran on for 10 minutes until Ctrl-C)."""
    if config.runtime.stop_when == "files_ended" and all(
            source.is_live for source in config.sources):
        log.warning(FILES_ENDED_WITHOUT_FILES, key="runtime.stop_when")


def gpu_settings(config: PipelineConfig) -> list[tuple[str, str, str, str]]:
    """The settings of ``config`` that run on the GPU only, in config order: (key, value,
    what it does, what to set instead)."""
    inference = config.inference
    asked = []
    if inference.device == "cuda":
        asked.append(("inference.device", "cuda", "", "leave it at auto or set cpu"))
    if inference.backend in ("torch", "tensorrt"):
        asked.append(("inference.backend", inference.backend, " runs on the GPU only",
                      "leave it at auto or set onnxruntime"))
    asked += [(f"sources[{i}].decode", "gpu", " decodes on the GPU (NVDEC)",
               "leave it at auto or set cpu")
              for i, source in enumerate(config.sources) if source.decode == "gpu"]
    if isinstance(config.runtime.gpus, list):  # ('all' asks the machine and says so itself)
        asked.append(("runtime.gpus", config.runtime.gpus, " places an engine on each",
                      "leave runtime.gpus out to run on the CPU"))
    return asked


def check_gpu_settings(config: PipelineConfig, probe: Callable[[], tuple[int, str | None]]
                       ) -> int | None:
    """Stop the start, before any worker, when a setting runs on the GPU only and cannot:
    inference is set to the CPU, or ``probe`` (``supervisor.gpu_probe``) finds no usable GPU.

    Returns:
        The GPUs the probe found, or None when it was not asked (no such setting).

    Raises:
        ConfigError: ``KEY: 'VALUE' ...: no usable GPU here (why): what to set instead``.
    """
    asked = gpu_settings(config)
    if not asked:
        return None
    key, value, does, instead = asked[0]
    if config.inference.device == "cpu":
        raise ConfigError(f"{key}: {value!r}{does}, and inference.device is cpu: {instead}")
    count, reason = probe()
    if count < 1:
        raise ConfigError(f"{key}: {value!r}{does}: no usable GPU here ({reason}): {instead}")
    if isinstance(config.runtime.gpus, list) and max(config.runtime.gpus) >= count:
        raise ConfigError(f"runtime.gpus: {config.runtime.gpus!r} names GPU "
                          f"{max(config.runtime.gpus)}; this machine has {count} "
                          f"(0 to {count - 1})")
    return count


def make_executor(config: PipelineConfig, ray_address: str | None = None, metrics: bool = False,
                  on_batch_done: Callable[..., None] | None = None,
                  frames: str | None = None) -> Any:
    """The hosts: the whole pipeline in this process (one source worker), source worker
    processes with one engine per GPU (several), or Ray actors (``ray_address``).
    ``frames``: the batch parts ``on_batch_done`` sees carry their frames' pictures in this
    format (``build_graph``'s ``frames``; the Python API).

    Raises:
        ConfigError: a setting that runs on the GPU only cannot (``check_gpu_settings``),
            ``runtime.gpus`` cannot be had, or per-batch results asked for
            (``on_batch_done``) with more than one worker.
    """
    from pipeline.app.supervisor import (
        InProcessExecutor,
        LocalExecutor,
        absolute_paths,
        gpu_count,
        gpu_probe,
        resolve_devices,
        spare_hosts,
    )

    if ray_address is not None:
        from pipeline.app.ray_cluster import RayExecutor, connect, unit_count

        if on_batch_done is not None:
            raise ConfigError("--ray: the Python API's per-frame results need the pipeline in "
                              "this process")
        if ray_address == "local" and isinstance(config.runtime.gpus, list) \
                and config.inference.device != "cpu":
            # the cluster to start has this machine's GPUs: a list longer is told before it
            unit_count(config, {"GPU": gpu_count()}, 1)
        local_gcs = connect(ray_address)
        return RayExecutor(absolute_paths(config), metrics=metrics, local_gcs=local_gcs)
    gpus = None if config.runtime.gpus == "all" else check_gpu_settings(config, gpu_probe)
    devices = resolve_devices(config)  # (runtime.gpus: all asks, and says when it finds none)
    if len(devices) > 1 and on_batch_done is not None:
        raise ConfigError("runtime.workers: the Python API's per-frame results need the "
                          "whole pipeline in this process (runtime.workers: 1); run() and "
                          "the outputs work with any")
    on_gpu = functools.cache(lambda: config.inference.device != "cpu" and (
        any(d is not None for d in devices) or (gpus if gpus is not None else gpu_count()) > 0))
    place_decoders(config, len(set(devices)), on_gpu)
    if len(devices) == 1:
        if config.runtime.cuda_mps is True:
            log.warning("runtime.cuda_mps: true, but the whole pipeline runs in one process "
                        "here (runtime.workers: 1, set or chosen for this machine): no MPS "
                        "daemon started")
        if devices[0] is not None:
            config.inference.gpu_id = devices[0]
        return InProcessExecutor(config, metrics, on_batch_done, frames)
    spares = spare_hosts(config, devices)
    if spares:
        log.info("spare source workers", spares=len(spares), setting="runtime.spare_workers")
    return LocalExecutor(absolute_paths(config), devices + spares, metrics, on_gpu(),
                         spares=range(len(devices), len(devices) + len(spares)))


def place_decoders(config: PipelineConfig, gpus: int, on_gpu: Callable[[], bool]) -> None:
    """Both decoders for ``decode: auto`` where ``runtime.cpu_decode_fps`` is set: the
    sources ``placement.plan_cpu_decode`` picks are set to ``decode: cpu`` in ``config`` (on
    the GPU path, ``on_gpu()``, with no annotated video: else every auto source decodes on
    the CPU anyway), and the plan is logged. Sources added while the run goes on keep
    ``auto`` (NVDEC where usable)."""
    from pipeline.app.build import host_outputs_reason
    from pipeline.app.placement import plan_cpu_decode, source_loads

    runtime = config.runtime
    if (len(config.sources) < 2 or not runtime.cpu_decode_fps or host_outputs_reason(config)
            or not any(s.decode == "auto" for s in config.sources)
            or config.inference.device == "cpu"):
        return
    nvdec_fps = runtime.nvdec_fps * max(1, gpus)
    cpu_fps = runtime.cpu_decode_fps
    chosen = set(plan_cpu_decode(config.sources, source_loads(config), nvdec_fps, cpu_fps))
    if not chosen or not on_gpu():
        return
    config.sources = [dataclasses.replace(s, decode="cpu") if s.name in chosen else s
                      for s in config.sources]
    log.info("decoders planned", nvdec=len(config.sources) - len(chosen), cpu=len(chosen),
             nvdec_fps=round(nvdec_fps), cpu_decode_fps=round(cpu_fps),
             setting="runtime.nvdec_fps, runtime.cpu_decode_fps")


def run(config: PipelineConfig, ray_address: str | None = None, restart: bool = False) -> int:
    """Run ``config`` through the supervisor with signals, the live view, Prometheus, the
    progress bar, the summary and the exit status (module docstring)."""
    runtime = config.runtime
    try:
        resume = prepare(config, restart)
        executor = make_executor(config, ray_address, metrics=runtime.metrics_port is not None)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except ConnectionError as error:  # --ray: no cluster there
        print(f"error: failed to start: {error}", file=sys.stderr)
        return EXIT_FAILED
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        return supervise(config, executor, resume)
    finally:  # (already closed when the supervisor ran: a run that never began closes it
        executor.close()  # here, its engines' rings and folders with it)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def supervise(config: PipelineConfig, executor: Any, resume: tuple[str, ...]) -> int:
    """``run``'s part once the executor exists: the live view, Prometheus, the progress bar,
    the supervisor's run, the summary and the exit status."""
    from pipeline.app.progress import Progress
    from pipeline.app.supervisor import Supervisor

    runtime = config.runtime
    exporter = server = board = None
    if runtime.metrics_port is not None:
        from pipeline.app.cluster_metrics import ClusterExporter

        exporter = ClusterExporter(runtime.metrics_port, runtime.metrics_host,
                                   runtime.metrics_token)
    supervisor: Supervisor | None = None
    with Progress(enabled=runtime.progress) as progress:
        progress.set_total(frame_counts(config))
        if runtime.http is not None:
            from pipeline.app.board import SourceBoard

            board = SourceBoard(lambda data: supervisor.add_source(data),
                                lambda name, wait_s: remove_and_wait(supervisor, name, wait_s),
                                runtime.http.preview_fps, [s.name for s in config.sources])
        supervisor = Supervisor(config, executor, runtime.max_restarts, exporter,
                                resume=resume, board=board, on_frames=progress.frames_done)
        try:
            if exporter is not None:
                port = exporter.start()
                log.info("serving Prometheus metrics",
                         url=f"http://{runtime.metrics_host}:{port}/metrics")
            if board is not None:
                from pipeline.app.http import HttpServer

                server = HttpServer(runtime.http, board, config)
                server.start()  # logs "serving the live view" with its URL
        except (OSError, RuntimeError) as error:
            if exporter is not None:
                exporter.stop()
            reason = error.strerror if isinstance(error, OSError) and error.strerror else error
            print(f"error: failed to start: {reason}", file=sys.stderr)  # (no "[Errno 98]")
            return EXIT_FAILED
        log.info("sources placed by load", sources=len(config.sources),
                 workers=[n for h, n in enumerate(executor.names) if h not in executor.spares],
                 spares=[executor.names[h] for h in sorted(executor.spares)])
        interrupts = install_signal_handlers(supervisor)
        started = time.monotonic()
        try:
            results = supervisor.run()
        finally:
            ignore_signals_while_closing()  # (``run`` restores the handlers at the very end)
            if exporter is not None:
                exporter.stop()
            if server is not None:
                server.close()
    return finish(supervisor, results, interrupts["count"], time.monotonic() - started)


def remove_and_wait(supervisor: Any, name: str, wait_s: float) -> dict[str, Any]:
    """The live view's ``DELETE``: stop ``name`` and wait up to ``wait_s`` for its outputs to
    be final; returns ``{"name", "state": "removed", "frames", "outputs"}``, or ``{"name",
    "state": "removing"}`` when they are not final yet.

    Raises:
        SourceConflict: no such source.
    """
    supervisor.remove_source(name)
    deadline = time.monotonic() + wait_s
    while not supervisor.source_done(name) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not supervisor.source_done(name):
        return {"name": name, "state": "removing"}
    run = supervisor.sources[name]
    ended = run.ended
    return {"name": name, "state": "removed", "frames": run.frames,
            "outputs": list(ended.outputs) if ended is not None else []}


def frame_counts(config: PipelineConfig) -> list[int | None]:
    """Frames each source's container announces (None: a camera, or unknown)."""
    from stages.decode import probe_frame_count

    return [None if source.is_live or is_stream_url(source.uri) else probe_frame_count(source)
            for source in config.sources]


def finish(supervisor: Any, results: dict[str, str | None], interrupts: int,
           elapsed: float) -> int:
    """Log every source's summary (each source the run had, in the order added: a name
    added again has one per source) and the run's end; print the errors; the exit status."""
    cut: list[tuple[Any, str]] = []  # (its SourceRun, where)
    unfinished: list[str] = []  # sources with frames whose outputs are not final, a rerun's
    for run, error in supervisor.every_source():
        name = run.config.name
        ended = run.ended
        summary = dict(ended.summary) if ended is not None else {"source": name}
        summary.update(frames=run.frames, error=error, removed=run.removing,
                       pipelines=list(dict.fromkeys(run.hosts)), moves=run.moves)
        if run.output_number is not None:  # a name added again: its outputs NAME.N.*
            summary["output_number"] = run.output_number
        if run.first_frame:  # resumed after an earlier run's records: frames are this run's
            summary["resumed_at"] = run.first_frame
        where = ended.cut_short if ended is not None and ended.cut_short else run.unended
        if where and error is None:
            summary["cut_short"] = where
            cut.append((run, where))
        if (run.frames and not (ended is not None and ended.complete) and not run.added
                and run.output_number is None):
            unfinished.append(name)
        log.info("source summary", **summary)
    log.info("run finished", seconds=round(elapsed, 2))
    if interrupts >= 2:
        if unfinished:  # as after a first Ctrl-C (below), for the sources a rerun resumes
            log.warning("aborted: outputs kept as .partial; run the same command again to "
                        "resume (--restart: start over)", sources=unfinished)
        return EXIT_INTERRUPTED
    if supervisor.failure is not None:
        reason, usage = supervisor.failure
        print(f"error: {reason}", file=sys.stderr)
        return EXIT_USAGE if usage else EXIT_FAILED
    failed = {name: error for name, error in results.items() if error}
    for name, reason in failed.items():
        print(f"error: source {name}: {reason}", file=sys.stderr)
    if failed:
        return EXIT_FAILED
    for run, where in cut:
        name = run.config.name
        if not run.frames:
            log.warning("stopped before its first frame: nothing was written", source=name,
                        at=where)
        elif not run.added:
            log.warning("stopped early: outputs kept as .partial; run the same command again "
                        "to resume (--restart: start over)", source=name, at=where)
        elif run.output_number is not None:  # NAME.N.partial.*: no config source resumes it
            log.warning(f"stopped early: outputs kept as .partial ({name}.{run.output_number}"
                        ".partial.*; a source added while running under a name used before: "
                        "no rerun resumes these)", source=name, at=where)
        else:  # added through the API: a rerun of the config does not know it
            log.warning("stopped early: outputs kept as .partial (a source added while "
                        "running: add it to the config file to resume it)", source=name,
                        at=where)
    if cut and interrupts and not any(run.frames for run, _ in cut):
        return EXIT_INTERRUPTED  # stopped while starting: nothing written, nothing to resume
    return EXIT_STOPPED if cut else EXIT_OK


def ignore_signals_while_closing() -> None:
    """Once the supervisor's run is over (every output final or kept), SIGINT and SIGTERM
    are said and ignored while the summary is logged and the processes close (a bounded
    wait): a second Ctrl-C just after the first run's end once turned its exit status 0
    into 130."""
    def handle(signum: int, _frame: object) -> None:
        log.info("signal ignored: the run has ended; closing its processes",
                 signal=signal.Signals(signum).name)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handle)


def install_signal_handlers(target: Any) -> dict[str, int]:
    """First SIGINT/SIGTERM: ``target.request_stop()`` (a graceful stop); second:
    ``target.abort()``. Returns the count (``run`` restores the handlers it replaced)."""
    interrupts = {"count": 0}

    def handle(signum: int, _frame: object) -> None:
        interrupts["count"] += 1
        if interrupts["count"] == 1:
            log.warning("stopping: finishing queued frames (signal again to abort)",
                        signal=signal.Signals(signum).name)
            target.request_stop()
        else:
            log.warning("aborting", signal=signal.Signals(signum).name)
            target.abort()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handle)
    return interrupts
