"""Sources added to and removed from a graph: the one path every source starts by, those of
the configuration file (``pipeline.app.build``), those a supervisor places on a pipeline host
(``pipeline.app.host``) and those the HTTP API adds while the run goes on (``POST
/api/sources``, ``DELETE /api/sources/{name}``).

A ``SourceConfig`` (a source of the validated file) is taken as it is. A POSTed entry is
validated exactly as a ``sources[]`` entry of the YAML file is (the same one-line messages,
its key ``sources[N]``: N its position among every source the run has had), then against the
running pipeline: its name must not be in use (a source
running, or one whose outputs are being finalised), a file's frames must fit the frame slots
sized at start, and a tracker or zones need the stages that run them (present when a
configured source uses them). ``${VAR}`` references are not expanded in a request (a request
must not read the server's environment).

Then every stage that keeps per-source state learns of it (batcher, filter, tracker,
analytics, annotate), the graph opens its sink and starts its thread (before the run: with
the run's other threads, once the stages are open), and only then does its decode start:
on NVDEC, or in the decode worker with the fewest running sources (sharing that worker's
slots), or in a thread of this process without workers. A source ``resume``d starts after
its last written record and its sink appends to its records (``pipeline.resume``); if
tracked, its track ids go on after the largest of its records.
Removing a source stops its reading; what it queued drains and its outputs are finalised as
for a file that ended. The other sources are not touched either way: no frame of theirs
waits or is lost.

**A name used again.** The name of a source that was removed or has ended may be added again
once its outputs are final. Its earlier outputs are never touched: the new source writes under
the next free numbered name, ``NAME.2.jsonl`` (``.3``, ...: the number goes before the
suffix of every output file ``output`` names, the same number for all of them), the first
number whose final and ``.partial`` names are all free on disk and unused in this run.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from pipeline.app.workers import DecodeWorkerPool
from pipeline.config import (
    OUTPUT_KEYS,
    ConfigError,
    PipelineConfig,
    SourceConfig,
    build_section,
    check_config,
    partial_path,
)
from pipeline.graph import Graph, SourceConflict
from pipeline.resume import last_record_pts, next_tracker_id, resume_point
from pipeline.slots import SlotRing, i420_bytes
from pipeline.stage import SourceStage, Stage
from stages.analytics import AnalyticsStage, Region
from stages.annotate import AnnotateStage
from stages.batcher import BatcherStage
from stages.filters import DetectionFilterStage, SourceFilter
from stages.remote_infer import RemoteInferStage
from stages.tracking import TrackerSettings, TrackerStage

log = structlog.get_logger("control")

__all__ = ["SourceControl", "SourceConflict"]


class SourceControl:
    """Adds sources to, and removes them from, a running graph (module docstring).

    Args:
        config: the run's configuration; ``config.sources`` is not changed (source ids are
            positions in ``self.sources``, which only grows).
        graph: the running graph.
        ring: the frame slot ring (its slot size bounds an added file's frame size).
        pool: the decode worker pool, or None (sources decode in threads of this process).
        class_names: the class names the build settled on, or None.
        num_classes: the model's class count.
        make_sink: (config, source, tracked, has_analytics) -> the source's sink.
        probe_size: uri -> the (width, height) of a file's first frame (``ConfigError`` when
            none decodes).
        make_decoder: (source id, source, key) -> the graph's source of a source not decoded
            in the worker pool (NVDEC, or a thread of this process); ``ConfigError`` when its
            ``decode`` cannot be had.
        decoded_by_pool: (source, key) -> whether ``pool`` decodes it.
        base_dir: folder relative paths are resolved against (the working directory).
        track_gone_margin_s: analytics: seconds past ``tracker_lost_s`` a track is gone.
    """

    def __init__(self, config: PipelineConfig, graph: Graph, ring: SlotRing,
                 pool: DecodeWorkerPool | None, class_names: list[str] | None,
                 num_classes: int,
                 make_sink: Callable[[PipelineConfig, SourceConfig, bool, bool], Stage],
                 probe_size: Callable[[str], tuple[int, int] | None],
                 make_decoder: Callable[[int, SourceConfig, str], SourceStage],
                 decoded_by_pool: Callable[[SourceConfig, str], bool],
                 base_dir: Path = Path("."), track_gone_margin_s: float = 0.5) -> None:
        self.config, self.graph, self.ring, self.pool = config, graph, ring, pool
        self.class_names, self.num_classes = class_names, num_classes
        self.make_sink, self.probe_size = make_sink, probe_size
        self.make_decoder, self.decoded_by_pool = make_decoder, decoded_by_pool
        self.base_dir, self.track_gone_margin_s = base_dir, track_gone_margin_s
        self.sources: list[SourceConfig] = []  # every source of the graph, in the order added
        self.numbers: dict[int, int] = {}  # source id -> the number of its numbered outputs
        self.retired: set[int] = set()  # ids (positions in sources) removed or replaced
        self._lock = threading.Lock()  # one change at a time
        stages = {type(stage): stage for stage in graph.chain}
        # the stage frames enter: the batcher, or a source worker's remote inference
        self._first_stage: BatcherStage | RemoteInferStage = graph.chain[0]  # type: ignore[assignment]
        self._filter = stages.get(DetectionFilterStage)
        self._tracker = stages.get(TrackerStage)
        self._analytics = stages.get(AnalyticsStage)
        self._annotate = stages.get(AnnotateStage)

    def current(self) -> list[SourceConfig]:
        """The sources of the run that were not removed, in the order they came."""
        with self._lock:
            return [s for i, s in enumerate(self.sources) if i not in self.retired]

    def add(self, data: Any, resume: bool = False, output_number: int | None = None,
            renumber: bool = False, key: str | None = None) -> SourceConfig:
        """Validate a source and start it (before the run: it starts with the run).

        Args:
            data: a ``SourceConfig`` of the validated configuration, taken as it is, or a
                ``sources[]`` entry (a mapping: a POSTed source), validated here.
            resume: start after its last written record, appending to its records (a source
                a stopped run cut short, or one moved here from another pipeline).
            output_number: write the numbered outputs ``NAME.N.*`` (module docstring); by
                default its own, or the next free numbers when its name was used before in
                this graph.
            renumber: take the next free numbered outputs (its name was used before in the
                run, on another pipeline).
            key: its name in messages (default ``sources[N]``, N its position in this graph).

        Raises:
            ConfigError: the entry is not valid (a one-line message naming the key).
            SourceConflict: its name is in use (a source running, or one whose outputs are
                being finalised), or the run is ending.
        """
        started = last = time.monotonic()
        phases_s: dict[str, float] = {}  # where the add went (its log line)

        def phase(name: str) -> None:
            nonlocal last
            now = time.monotonic()
            phases_s[name], last = round(now - last, 3), now

        with self._lock:
            phase("lock")
            index = len(self.sources)
            key = key or f"sources[{index}]"
            earlier = [i for i, s in enumerate(self.sources) if s.name == getattr(
                data, "name", None) or (isinstance(data, dict) and s.name == data.get("name"))]
            if isinstance(data, SourceConfig):
                source = data
            elif isinstance(data, dict):
                source = build_section(SourceConfig, data, key)
                others = [s for i, s in enumerate(self.sources)
                          if i not in self.retired and i not in earlier]
                check_config(dataclasses.replace(self.config, sources=[*others, source]),
                             self.base_dir, key)
            else:
                raise ConfigError(f"{key}: expected a mapping of a source's keys, got "
                                  f"{type(data).__name__}")
            if earlier and not self.graph.reusable(source.name):
                raise SourceConflict(f"{key}.name: source name {source.name!r} is in use in "
                                     "this run (running, or its outputs are being finalised)")
            parts = self._stage_parts(key, source)
            if output_number is None and (earlier or renumber):
                output_number = self._next_number(source)
            sink_config = (self._numbered(output_number) if output_number is not None
                           else self.config)
            if resume and sink_config.output.jsonl:  # ValueError: not our records
                records = sink_config.output_path(sink_config.output.jsonl, source.name)
                point = resume_point(records)
                source = dataclasses.replace(source, start_frame=max(source.start_frame, point))
                if source.is_live and point > 0:  # its pts go on after its last record's
                    source = dataclasses.replace(source, start_pts=last_record_pts(records))
                if parts["tracker"] is not None:  # new ids: after those of its records
                    parts["first_tracker_id"] = next_tracker_id(records)
            phase("check")
            in_pool = self.pool is not None and self.decoded_by_pool(source, key)
            stage = (self.pool.add_source(index, source, source.start_frame) if in_pool
                     else self.make_decoder(index, source, key))
            phase("decoder")
            sink = self.make_sink(sink_config, source, parts["tracker"] is not None,
                                  bool(parts["regions"]))
            phase("sink")
            if resume and source.start_frame > 0:  # appends to the records (see SinkStage)
                sink.resume_from = source.start_frame
            assigned = self._first_stage.add_source(source.name, source.detect_every,
                                                source.detect_fps, source.is_live)
            if assigned != index:  # the first stage numbers sources as this list does
                raise RuntimeError(f"source id {assigned} != {index}: out of step")
            self.sources.append(source)
            if output_number is not None:
                self.numbers[index] = output_number
            self.retired.update(earlier)
            self._register(index, source, parts)
            try:
                self.graph.add_source(stage, sink)  # SourceConflict: the run is ending
            except BaseException:
                if in_pool:
                    self.pool.stop_source(index)  # never started: it ends at once
                raise
            if in_pool:
                self.pool.start_source(index)
            phase("start")
        log.info("source added", source=source.name, id=index, live=source.is_live,
                 resumed_at=source.start_frame if resume else None,
                 first_tracker_id=parts.get("first_tracker_id"),
                 took_s=round(time.monotonic() - started, 3), phases_s=phases_s)
        return source

    def remove(self, name: str) -> bool:
        """Stop source ``name``, or forget it when it has ended; its outputs are final once
        ``done(name)``. Returns True when it was running (it is being stopped now).

        Raises:
            SourceConflict: no source of that name is running or has ended in this run.
        """
        with self._lock:
            ids = [i for i, s in enumerate(self.sources) if s.name == name
                   and i not in self.retired]
            if not ids:
                raise SourceConflict(f"no source named {name!r}")
            try:
                self.graph.remove_source(name)
                stopped = True
            except SourceConflict:  # it has ended (or is ending) by itself
                stopped = False
            self.retired.update(ids)
        return stopped

    def output_paths(self, name: str) -> list[Path]:
        """The final output paths of the source now named ``name`` (for a name used again,
        its numbered ones), whichever exist or not."""
        with self._lock:
            index = max(i for i, s in enumerate(self.sources) if s.name == name)
            number = self.numbers.get(index)
            config = self.config if number is None else self._numbered(number)
            return config.output_paths(self.sources[index])

    def outputs_left(self, name: str) -> list[str]:
        """The files the source now named ``name`` left: each output under its ``.partial``
        name (a file cut short) or its final one; none for a source that delivered no
        frame."""
        return [str(partial_path(path) if partial_path(path).exists() else path)
                for path in self.output_paths(name)
                if path.exists() or partial_path(path).exists()]

    def output_number(self, name: str) -> int | None:
        """The number of the outputs the source now named ``name`` writes (None: its own)."""
        with self._lock:
            index = max(i for i, s in enumerate(self.sources) if s.name == name)
            return self.numbers.get(index)

    def done(self, name: str) -> bool:
        """Whether a removed (or ended) source's outputs are final."""
        return self.graph.source_done(name)

    # -- internals -----------------------------------------------------------------------
    def _numbered(self, number: int) -> PipelineConfig:
        """The configuration with ``output`` naming the numbered outputs ``NAME.N.*``."""
        output = self.config.output
        changes: dict[str, str] = {}
        for key in OUTPUT_KEYS:
            template = getattr(output, key)
            if template:
                path = Path(template)
                changes[key] = str(path.with_name(f"{path.stem}.{number}{path.suffix}"))
        return dataclasses.replace(self.config, output=dataclasses.replace(output, **changes))

    def _next_number(self, source: SourceConfig) -> int:
        """The first number from 2 whose outputs of ``source`` are free: not on disk (final or
        ``.partial``) and not written by another source of this graph; the caller holds
        ``_lock``."""
        taken = {path for i, number in self.numbers.items()
                 for path in self._numbered(number).output_paths(self.sources[i])}
        number = 2
        while True:
            paths = self._numbered(number).output_paths(source)
            if not any(p in taken or p.exists() or partial_path(p).exists() for p in paths):
                log.info("source name used again: its outputs get new names",
                         source=source.name, outputs=[str(p) for p in paths])
                return number
            number += 1

    def _stage_parts(self, key: str, source: SourceConfig) -> dict[str, Any]:
        """What the chain's stages need for ``source``, checked against the run."""
        source_filter = SourceFilter.from_config(key, source, self.class_names, self.num_classes)
        if source_filter is not None and self._filter is None:
            raise ConfigError(f"{key}.classes: this run has no filter stage (no source had "
                              "classes or roi at start); restart with the source in the file")
        tracker = TrackerSettings.from_config(source)
        if tracker is not None and self._tracker is None:
            raise ConfigError(f"{key}.tracker: this run has no tracking stage (no source had a "
                              "tracker at start); restart with the source in the file")
        regions = [Region.from_config(f"{key}.analytics[{k}]", region, source,
                                      self.class_names, self.num_classes)
                   for k, region in enumerate(source.analytics or ())]
        if regions and self._analytics is None:
            raise ConfigError(f"{key}.analytics: this run has no analytics stage (no source "
                              "had zones or lines at start); restart with the source in the "
                              "file")
        try:
            size = None if source.is_live else self.probe_size(source.uri)
        except ConfigError as error:  # the file's first frame does not decode
            raise ConfigError(f"{key}.uri (source {source.name!r}): {error}") from None
        if size is not None:
            for region in regions:
                if (reason := region.frame_error(*size)) is not None:
                    raise ConfigError(f"{reason} of source {source.name!r}")
            if i420_bytes(*size) > self.ring.slot_bytes:
                raise ConfigError(f"{key}.uri (source {source.name!r}): its {size[0]}x{size[1]} "
                                  "frames do not fit the frame slots sized at start (the "
                                  "largest file then); restart with it in the file")
        return {"filter": source_filter, "tracker": tracker, "regions": regions}

    def _register(self, index: int, source: SourceConfig, parts: dict[str, Any]) -> None:
        """Tell the stages with per-source state about source ``index``."""
        if parts["filter"] is not None and self._filter is not None:
            self._filter.add_source(index, parts["filter"])
        if parts["tracker"] is not None and self._tracker is not None:
            self._tracker.add_source(source.name, parts["tracker"],
                                     parts.get("first_tracker_id", 0))
        if parts["regions"] and self._analytics is not None:
            self._analytics.add_source(source.name, parts["regions"], self.class_names,
                                       source.tracker_lost_s + self.track_gone_margin_s,
                                       source.start_frame)
            if self._annotate is not None:
                self._annotate.add_source(source.name, parts["regions"])
