"""Placement: which source worker (or Ray actor) runs which source, and which decoder
decodes it.

Pure functions over records, no processes: the supervisor (``pipeline.app.supervisor``) calls them
when the run starts, when a source is added or removed, and when a worker dies;
``plan_cpu_decode`` is called once before the run starts (``pipeline.app.run``).

A source's load is what decoding and inferring it costs per second, ``width x height x
frames/s``: a 1080p camera at 30 frames/s weighs as much as eight 640x360 ones at 15
(inference cost per frame is the same at any size once letterboxed, but decode and the copy
to the device, the usual limits, grow with the pixels). Files are probed; a camera's size is
known at its first frame only, so it counts as 1920x1080 at its ``pace_fps`` or 25 frames/s.

- ``assign``: longest-processing-time first: CPU-decoded sources first (they cost their
  worker the decoding too, so they are spread evenly), then by falling load, each onto the
  worker with the least load so far (ties: the lower number), names breaking ties, so the
  result is the same on every run.
- ``rebalance``: a new placement that keeps every source that still has a live pipeline
  where it is (moving one restarts it), places the sources that have none (new, or on a
  pipeline that died) on the least loaded, forgets removed sources, then moves at most
  ``max_moves`` sources from the most to the least loaded pipeline while each move lowers
  the larger of the two loads; the sources asked to ``stay`` (running cameras) never move.
- ``plan_cpu_decode`` (``decode: auto`` on the GPU path, both decoders): the paced and live
  sources fill NVDEC up to ``NVDEC_FILL`` of its capacity (``runtime.nvdec_fps`` per GPU), the
  rest go to CPU decode up to its capacity (``runtime.cpu_decode_fps``); past both, they are
  shared in proportion to the two capacities. Unpaced files (each reads as fast as it
  decodes) are always shared in that proportion. The CPU-decoded ones are picked evenly
  spaced in config order, so every size and kind of source keeps its share of both.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import av

from pipeline.config import PipelineConfig, SourceConfig, is_stream_url

CAMERA_SIZE = (1920, 1080)  # a camera's assumed size until its first frame
CAMERA_FPS = 25.0  # ... and rate, when it is not paced
FULL_HD = 1920 * 1080  # decode capacities are counted in 1080p frames/s
NVDEC_FILL = 0.8  # auto decode keeps NVDEC under this share of its capacity (latency grows
# as a decoder nears its ceiling: 150 cameras at 98% of NVDEC did not hold, results-h200.md)


@dataclass(frozen=True)
class SourceLoad:
    """What one source costs a pipeline per second.

    Attributes:
        name: the source's name.
        width, height: its frame size in pixels (> 0).
        fps: its frames per second (> 0).
        cpu_decode: it is decoded on the CPU (``decode: cpu``), by its worker (its threads, or
            its decode processes on the GPU path).
    """

    name: str
    width: int
    height: int
    fps: float
    cpu_decode: bool = False

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
    width, height, fps = *CAMERA_SIZE, CAMERA_FPS
    if not is_stream_url(source.uri):
        try:
            width, height, fps = _probe_file(source.uri, os.stat(source.uri).st_mtime_ns)
        except (av.FFmpegError, OSError, IndexError):
            pass
    return SourceLoad(source.name, width, height, source.pace_fps or fps,
                      source.decode == "cpu")


@functools.lru_cache(maxsize=256)
def _probe_file(uri: str, _mtime_ns: int) -> tuple[int, int, float]:
    """(width, height, frame rate) of ``uri``'s first video stream (cached per file version:
    a hundred cameras playing one clip open it once)."""
    width, height = CAMERA_SIZE
    with av.open(uri) as container:
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        return stream.width or width, stream.height or height, float(rate) if rate else CAMERA_FPS


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
              max_moves: int = 0, stay: Collection[str] = ()) -> dict[str, int]:
    """The placement after a change (module docstring).

    Args:
        current: source name -> host now; sources not in ``loads`` are removed, sources on a
            host not in ``hosts`` (dead) are placed again.
        loads: every source to place (the current set: added ones included).
        hosts: the live hosts.
        max_moves: most sources moved between live hosts to even the loads (0: only the
            sources without a live host are placed).
        stay: sources never moved between live hosts to even the loads (the supervisor's
            running live sources: a move cuts a camera, and its frames meanwhile are lost).

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
    for item in sorted(loads, key=lambda s: (not s.cpu_decode, -s.load, s.name)):
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
                   if host == heavy and by_name[name].load < gap and name not in stay]
        if heavy == light or not movable:
            break
        item = min(movable, key=lambda s: (abs(gap / 2 - s.load), s.name))
        placement[item.name] = light
        totals[heavy] -= item.load
        totals[light] += item.load
    return {name: placement[name] for name in names}


def plan_cpu_decode(sources: Sequence[SourceConfig], loads: Sequence[SourceLoad],
                    nvdec_fps: float, cpu_fps: float) -> list[str]:
    """The ``decode: auto`` sources to decode on the CPU so that neither decoder is pushed
    to its ceiling (module docstring), by name, in config order.

    Args:
        sources: every source, in config order.
        loads: their loads, in the same order.
        nvdec_fps: 1080p frames/s NVDEC decodes, on every GPU of the run together (> 0).
        cpu_fps: 1080p frames/s CPU decode gives, on every usable core together (> 0).
    """
    if len(sources) != len(loads):
        raise ValueError(f"{len(sources)} sources but {len(loads)} loads")
    if not (nvdec_fps > 0 and cpu_fps > 0):
        raise ValueError(f"decode capacities must be > 0, got NVDEC {nvdec_fps}, CPU {cpu_fps}")
    demand = [item.load / FULL_HD for item in loads]
    pinned_gpu = sum(d for s, d in zip(sources, demand) if s.decode == "gpu")
    pinned_cpu = sum(d for s, d in zip(sources, demand) if s.decode == "cpu")
    auto = [i for i, s in enumerate(sources) if s.decode == "auto"]
    paced = [i for i in auto if sources[i].is_live or sources[i].pace_fps]
    unpaced = [i for i in auto if i not in set(paced)]
    proportional = cpu_fps / (cpu_fps + nvdec_fps)
    total = sum(demand[i] for i in paced)
    overflow = total - max(0.0, NVDEC_FILL * nvdec_fps - pinned_gpu)
    if overflow <= 0:
        share = 0.0
    elif overflow <= cpu_fps - pinned_cpu:
        share = overflow / total
    else:
        share = proportional
    chosen = _evenly(paced, demand, share) + _evenly(unpaced, demand, proportional)
    return [sources[i].name for i in sorted(chosen)]


def _evenly(indices: Sequence[int], demand: Sequence[float], share: float) -> list[int]:
    """Of ``indices``, those that carry ``share`` of their summed ``demand``, evenly spaced
    (a source is taken when the CPU's part so far, with half of it, stays within the share
    of the demand so far)."""
    taken, so_far, on_cpu = [], 0.0, 0.0
    for i in indices:
        so_far += demand[i]
        if share > 0 and on_cpu + demand[i] / 2 <= share * so_far:
            taken.append(i)
            on_cpu += demand[i]
    return taken
