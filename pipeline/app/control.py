"""Sources added and removed while the pipeline runs (the HTTP API's ``POST /api/sources``
and ``DELETE /api/sources/{name}``).

An added source is validated exactly as a ``sources[]`` entry of the YAML file is (the same
one-line messages, its key ``sources[N]`` where N is its position among every source this
run has had), then against the running pipeline: its name must not be in use (a source
running, or one whose outputs are being finalised), a file's frames must fit the frame slots
sized at start, and a tracker or zones need the stages that run them (present when a
configured source uses them). ``${VAR}`` references are not expanded in a request (a request
must not read the server's environment).

Then every stage that keeps per-source state learns of it (batcher, filter, tracker,
analytics, annotate), the graph opens its sink and starts its thread, and only then does its
decode start: in the decode worker with the fewest running sources (sharing that worker's
slots), or in a thread of this process without workers. Removing a source stops its reading;
what it queued drains and its outputs are finalised as for a file that ended. The other
sources are not touched either way: no frame of theirs waits or is lost.

**A name used again.** The name of a source that was removed or has ended may be added again
once its outputs are final. Its earlier outputs are never touched: the new source writes under
the next free numbered name, ``NAME.2.jsonl`` (``.3``, ...: the number goes before the
suffix of every output file ``output`` names, the same number for all of them), the first
number whose final and ``.partial`` names are all free on disk and unused in this run.
"""

from __future__ import annotations

import dataclasses
import threading
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
from pipeline.slots import SlotRing, i420_bytes
from pipeline.stage import SourceStage, Stage
from stages.analytics import AnalyticsStage, Region
from stages.annotate import AnnotateStage
from stages.batcher import BatcherStage
from stages.decode import DecodeStage, decoder_threads
from stages.filters import DetectionFilterStage, SourceFilter
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
        base_dir: folder relative paths are resolved against (the working directory).
        track_gone_margin_s: analytics: seconds past ``tracker_lost_s`` a track is gone.
    """

    def __init__(self, config: PipelineConfig, graph: Graph, ring: SlotRing,
                 pool: DecodeWorkerPool | None, class_names: list[str] | None,
                 num_classes: int,
                 make_sink: Callable[[PipelineConfig, SourceConfig, bool, bool], Stage],
                 probe_size: Callable[[str], tuple[int, int] | None],
                 base_dir: Path = Path("."), track_gone_margin_s: float = 0.5) -> None:
        self.config, self.graph, self.ring, self.pool = config, graph, ring, pool
        self.class_names, self.num_classes = class_names, num_classes
        self.make_sink, self.probe_size = make_sink, probe_size
        self.base_dir, self.track_gone_margin_s = base_dir, track_gone_margin_s
        self.sources: list[SourceConfig] = list(config.sources)  # every source of the run
        self.retired: set[int] = set()  # ids (positions in sources) removed or replaced
        self.outputs: dict[int, list[Path]] = {}  # a reused name's source id -> its outputs
        self._lock = threading.Lock()  # one change at a time
        stages = {type(stage): stage for stage in graph.chain}
        self._batcher: BatcherStage = stages[BatcherStage]  # type: ignore[assignment]
        self._filter = stages.get(DetectionFilterStage)
        self._tracker = stages.get(TrackerStage)
        self._analytics = stages.get(AnalyticsStage)
        self._annotate = stages.get(AnnotateStage)

    def current(self) -> list[SourceConfig]:
        """The sources of the run that were not removed, in the order they came."""
        with self._lock:
            return [s for i, s in enumerate(self.sources) if i not in self.retired]

    def add(self, data: Any) -> SourceConfig:
        """Validate a ``sources[]`` entry and start it (returns once its threads started);
        while the run is still starting (the model warming up), waits until it has started.

        Raises:
            ConfigError: the entry is not valid (a one-line message naming the key).
            SourceConflict: its name is in use (a source running, or one whose outputs are
                being finalised), or the run is ending.
        """
        self.graph.wait_until_started()  # the decode workers take new sources once started
        with self._lock:
            index = len(self.sources)
            key = f"sources[{index}]"
            if not isinstance(data, dict):
                raise ConfigError(f"{key}: expected a mapping of a source's keys, got "
                                  f"{type(data).__name__}")
            source = build_section(SourceConfig, data, key)
            earlier = [i for i, s in enumerate(self.sources) if s.name == source.name]
            if earlier and not self.graph.reusable(source.name):
                raise SourceConflict(f"{key}.name: source name {source.name!r} is in use in "
                                     "this run (running, or its outputs are being finalised)")
            others = [s for i, s in enumerate(self.sources)
                      if i not in self.retired and i not in earlier]
            candidate = dataclasses.replace(self.config, sources=[*others, source])
            check_config(candidate, self.base_dir)
            parts = self._stage_parts(key, source)
            sink_config = self._config_for(source) if earlier else self.config
            stage = self._decoder(index, source)
            sink = self.make_sink(sink_config, source, parts["tracker"] is not None,
                                  bool(parts["regions"]))
            assigned = self._batcher.add_source(source.name, source.detect_every,
                                                source.detect_fps)
            if assigned != index:  # the batcher numbers sources as this list does
                raise RuntimeError(f"source id {assigned} != {index}: out of step")
            self.sources.append(source)
            self.retired.update(earlier)
            self._register(index, source, parts)
            in_worker = self.pool is not None and getattr(stage, "pool", None) is self.pool
            try:
                self.graph.add_source(stage, sink)  # SourceConflict: the run is ending
            except BaseException:
                if in_worker:
                    self.pool.stop_source(index)  # never started: it ends at once
                raise
            if in_worker:
                self.pool.start_source(index)
        log.info("source added at runtime", source=source.name, id=index, live=source.is_live)
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
            return self.outputs.get(index) or self.config.output_paths(self.sources[index])

    def done(self, name: str) -> bool:
        """Whether a removed (or ended) source's outputs are final."""
        return self.graph.source_done(name)

    # -- internals -----------------------------------------------------------------------
    def _config_for(self, source: SourceConfig) -> PipelineConfig:
        """The run's configuration with ``output`` naming the next free numbered outputs of
        a name used again (module docstring); the caller holds ``_lock``."""
        taken = {path for paths in self.outputs.values() for path in paths}
        number = 2
        while True:
            output = self.config.output
            changes: dict[str, str] = {}
            for key in OUTPUT_KEYS:
                template = getattr(output, key)
                if not template:
                    continue
                path = self.base_dir / self.config.output_path(template, source.name)
                numbered = path.with_name(f"{path.stem}.{number}{path.suffix}")
                changes[key] = str(numbered.absolute()).replace("{", "{{").replace("}", "}}")
            candidate = dataclasses.replace(self.config,
                                            output=dataclasses.replace(output, **changes))
            paths = candidate.output_paths(source)
            if not any(p in taken or p.exists() or partial_path(p).exists() for p in paths):
                self.outputs[len(self.sources)] = paths
                log.info("source name used again: its outputs get new names",
                         source=source.name, outputs=[str(p) for p in paths])
                return candidate
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

    def _decoder(self, index: int, source: SourceConfig) -> SourceStage:
        """The graph's source for ``source``; its decoding starts in ``add`` after the graph
        took it. Decoded on the CPU: the previews, which the HTTP API comes with, read the
        frames on the host."""
        if self.pool is not None:
            return self.pool.add_source(index, source)
        return DecodeStage(source, self.ring, self.graph.abort_event,
                           decoder_threads=decoder_threads(len(self.sources) + 1))

    def _register(self, index: int, source: SourceConfig, parts: dict[str, Any]) -> None:
        """Tell the stages with per-source state about source ``index``."""
        if parts["filter"] is not None and self._filter is not None:
            self._filter.add_source(index, parts["filter"])
        if parts["tracker"] is not None and self._tracker is not None:
            self._tracker.add_source(source.name, parts["tracker"])
        if parts["regions"] and self._analytics is not None:
            self._analytics.add_source(source.name, parts["regions"], self.class_names,
                                       source.tracker_lost_s + self.track_gone_margin_s)
            if self._annotate is not None:
                self._annotate.add_source(source.name, parts["regions"])
