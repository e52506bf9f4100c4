"""Placement: which pipeline (one per GPU, process or Ray actor) runs which source.

Pure functions over records, no processes: the supervisor (``pipeline.app.supervisor``) calls them
when the run starts, when a source is added or removed, and when a pipeline dies.

A source's load is what decoding and inferring it costs per second, ``width x height x
frames/s``: a 1080p camera at 30 frames/s weighs as much as eight 640x360 ones at 15
(inference cost per frame is the same at any size once letterboxed, but decode and the copy
to the device, the usual limits, grow with the pixels). Files are probed; a camera's size is
known at its first frame only, so it counts as 1920x1080 at its ``pace_fps`` or 25 frames/s.

- ``assign``: longest-processing-time first: sources by falling load, each onto the pipeline
  with the least load so far (ties: the lower number), names breaking ties, so the result
  is the same on every run.
- ``rebalance``: a new placement that keeps every source that still has a live pipeline
  where it is (moving one restarts it), places the sources that have none (new, or on a
  pipeline that died) on the least loaded, forgets removed sources, then moves at most
  ``max_moves`` sources from the most to the least loaded pipeline while each move lowers
  the larger of the two loads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import av

from pipeline.config import PipelineConfig, SourceConfig, is_stream_url

CAMERA_SIZE = (1920, 1080)  # a camera's assumed size until its first frame
CAMERA_FPS = 25.0  # ... and rate, when it is not paced


@dataclass(frozen=True)
class SourceLoad:
    """What one source costs a pipeline per second.

    Attributes:
        name: the source's name.
        width, height: its frame size in pixels (> 0).
        fps: its frames per second (> 0).
    """

    name: str
    width: int
    height: int
    fps: float

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("SourceLoad.name: expected a source name, got ''")
        if self.width <= 0 or self.height <= 0:
            raise ValueError(f"SourceLoad {self.name!r}: expected a positive size, got "
                             f"{self.width}x{self.height}")
        if not self.fps > 0:
            raise ValueError(f"SourceLoad {self.name!r}: expected fps > 0, got {self.fps}")

    @property
    def load(self) -> float:
        """Pixels per second: width x height x fps."""
        return self.width * self.height * self.fps


def probe_load(source: SourceConfig) -> SourceLoad:
    """The load of one source: a file's size and rate read from its first video stream
    (``pace_fps`` wins over its rate); a stream's ``CAMERA_SIZE`` at ``pace_fps`` or
    ``CAMERA_FPS``; a file that cannot be probed counts as a camera (it fails when read)."""
    width, height = CAMERA_SIZE
    fps = source.pace_fps or CAMERA_FPS
    if not is_stream_url(source.uri):
        try:
            with av.open(source.uri) as container:
                stream = container.streams.video[0]
                width, height = stream.width or width, stream.height or height
                rate = stream.average_rate or stream.guessed_rate
                fps = source.pace_fps or (float(rate) if rate else CAMERA_FPS)
        except (av.FFmpegError, OSError, IndexError):
            pass
    return SourceLoad(source.name, width, height, fps)


def source_loads(config: PipelineConfig) -> list[SourceLoad]:
    """The load of every source of ``config``, in config order."""
    return [probe_load(source) for source in config.sources]


def host_loads(placement: Mapping[str, int], loads: Iterable[SourceLoad],
               hosts: Iterable[int]) -> dict[int, float]:
    """The summed load of each of ``hosts`` (0.0 for one without sources) under
    ``placement`` (source name -> host); sources on other hosts are left out."""
    totals = {host: 0.0 for host in hosts}
    for item in loads:
        host = placement.get(item.name)
        if host in totals:
            totals[host] += item.load
    return totals


def _least_loaded(totals: Mapping[int, float]) -> int:
    return min(totals, key=lambda host: (totals[host], host))


def _check_hosts(hosts: Sequence[int]) -> list[int]:
    if not hosts:
        raise ValueError("no pipeline to place the sources on")
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"pipelines listed twice: {list(hosts)}")
    return sorted(hosts)


def assign(loads: Sequence[SourceLoad], hosts: Sequence[int]) -> dict[str, int]:
    """Source name -> host for a fresh start (longest processing time first; module docstring).

    Raises:
        ValueError: no host, a host listed twice, or a source named twice.
    """
    return rebalance({}, loads, hosts)


def rebalance(current: Mapping[str, int], loads: Sequence[SourceLoad], hosts: Sequence[int],
              max_moves: int = 0) -> dict[str, int]:
    """The placement after a change (module docstring).

    Args:
        current: source name -> host now; sources not in ``loads`` are removed, sources on a
            host not in ``hosts`` (dead) are placed again.
        loads: every source to place (the current set: added ones included).
        hosts: the live hosts.
        max_moves: most sources moved between live hosts to even the loads (0: only the
            sources without a live host are placed).

    Raises:
        ValueError: no host, a host listed twice, or a source named twice.
    """
    alive = _check_hosts(hosts)
    names = [item.name for item in loads]
    if len(set(names)) != len(names):
        raise ValueError(f"sources named twice: {sorted({n for n in names if names.count(n) > 1})}")
    placement = {item.name: current[item.name] for item in loads
                 if current.get(item.name) in alive}
    totals = host_loads(placement, loads, alive)
    for item in sorted(loads, key=lambda s: (-s.load, s.name)):
        if item.name not in placement:
            host = _least_loaded(totals)
            placement[item.name] = host
            totals[host] += item.load
    by_name = {item.name: item for item in loads}
    for _ in range(max_moves):
        heavy = max(alive, key=lambda host: (totals[host], -host))
        light = _least_loaded(totals)
        gap = totals[heavy] - totals[light]
        # The move that evens the two best: the source closest to half the gap, and only
        # one lighter than the gap (else the larger of the two loads would not fall).
        movable = [by_name[name] for name, host in placement.items()
                   if host == heavy and by_name[name].load < gap]
        if heavy == light or not movable:
            break
        item = min(movable, key=lambda s: (abs(gap / 2 - s.load), s.name))
        placement[item.name] = light
        totals[heavy] -= item.load
        totals[light] += item.load
    return {name: placement[name] for name in names}
