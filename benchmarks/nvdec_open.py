"""How long NVDEC sources opened at once take to give their first frame.

A spare source worker taking a dead worker's cameras opens them all at once (issue 25: one
engine per GPU, its cameras back within 3 s).

    python -m benchmarks.nvdec_open [--clip PATH] [--sources 20] [--processes 1,2,4] [--cpu]

For each split, side by side in one run: ``--sources`` sources of the clip (default: the
benchmarks' 1080p clip, ``benchmarks.overlap_benchmark.make_1080p_clip``) opened at the same
moment, ``--sources / P`` threads in each of P processes, each thread as a
``GpuDecodeStage`` opens its source (``activate_primary_context``, ``av.open`` with NVDEC)
and decodes until its first picture. A process first opens one source alone (its one-time
costs: not counted). Printed per split: the seconds from the start to each source's first
frame (min / median / max, over every process's sources) and the longest that a 1 ms sleep
of another thread of the first process took meanwhile (the GIL held by PyAV or CuPy shows
as a long sleep). ``--cpu``: the same with CPU decoding (no GPU needed: the check in CI).

If the sources' first frames spread over about the same seconds whatever the split, their
decoders are made one at a time across the GPU, not per process.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import threading
import time
from pathlib import Path

import av

START_DELAY_S = 1.0  # the processes are started, then all open at this moment


def first_frame_s(clip: str, gpu: bool, started: float) -> float:
    """Open ``clip`` (on NVDEC when ``gpu``), decode until its first picture; the seconds
    from ``started`` (``time.time()``) until then."""
    hwaccel = None
    if gpu:
        from av.codec.hwaccel import HWAccel

        from stages.gpu_decode import activate_primary_context, cuda_hwaccel

        activate_primary_context(0)
        hwaccel = cuda_hwaccel(HWAccel, 0)
    with av.open(clip, hwaccel=hwaccel) as container:
        for packet in container.demux(video=0):
            if packet.decode():
                return time.time() - started
    raise RuntimeError(f"{clip}: no picture")


def open_sources(clip: str, gpu: bool, count: int, at: float, gil_check: bool,
                 results: multiprocessing.Queue) -> None:
    """One process: open one source alone (one-time costs), then ``count`` at once at
    ``at`` (``time.time()``); puts (seconds to each first frame, longest 1 ms sleep)."""
    first_frame_s(clip, gpu, time.time())
    seconds: list[float] = []
    longest_sleep = [0.0]
    done = threading.Event()

    def sleeper() -> None:
        while not done.is_set():
            before = time.monotonic()
            time.sleep(0.001)
            longest_sleep[0] = max(longest_sleep[0], time.monotonic() - before)

    def one() -> None:
        seconds.append(first_frame_s(clip, gpu, at))

    threads = [threading.Thread(target=one) for _ in range(count)]
    watcher = threading.Thread(target=sleeper)
    time.sleep(max(0.0, at - time.time()))
    if gil_check:
        watcher.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    if gil_check:
        watcher.join()
    results.put((seconds, longest_sleep[0] if gil_check else None))


def shares_of(sources: int, processes: int) -> list[int]:
    """The sources of each process: ``sources`` dealt as evenly as they go."""
    return [sources // processes + (i < sources % processes) for i in range(processes)]


def measure(clip: str, gpu: bool, sources: int, processes: int) -> dict[str, float | None]:
    """One split: ``sources`` over ``processes`` processes, opened at the same moment."""
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue = context.Queue()
    at = time.time() + START_DELAY_S * processes + 2.0  # spawned and past their first open
    shares = shares_of(sources, processes)
    workers = [context.Process(target=open_sources, args=(clip, gpu, n, at, i == 0, results))
               for i, n in enumerate(shares)]
    for worker in workers:
        worker.start()
    seconds: list[float] = []
    longest_sleep = None
    for _ in workers:
        got, sleep = results.get(timeout=120)
        seconds += got
        longest_sleep = sleep if sleep is not None else longest_sleep
    for worker in workers:
        worker.join()
    return {"min_s": min(seconds), "median_s": statistics.median(seconds),
            "max_s": max(seconds), "longest_sleep_ms": None if longest_sleep is None
            else longest_sleep * 1000}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.nvdec_open",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--clip", type=Path, default=None,
                        help="the video each source plays (default: the benchmarks' 1080p "
                        "clip, made when missing)")
    parser.add_argument("--sources", type=int, default=20,
                        help="sources opened at once (default 20)")
    parser.add_argument("--processes", default="1,2,4",
                        help="the splits: the sources spread over this many processes, "
                        "comma-separated (default 1,2,4)")
    parser.add_argument("--cpu", action="store_true", help="CPU decoding instead of NVDEC")
    args = parser.parse_args(argv)
    try:
        splits = [int(p) for p in args.processes.split(",")]
    except ValueError:
        parser.error(f"--processes: expected numbers separated by commas, got {args.processes!r}")
    if args.sources < 1 or any(not 1 <= p <= args.sources for p in splits):
        parser.error("--sources at least 1, and each of --processes from 1 to --sources")
    clip = args.clip
    if clip is None:
        from benchmarks.live_control import camera_clip

        clip = camera_clip(False, Path("assets"))
    if not clip.is_file():
        parser.error(f"--clip: {clip} is not a file")
    print(f"python -m benchmarks.nvdec_open --clip {clip} --sources {args.sources} "
          f"--processes {args.processes}{' --cpu' if args.cpu else ''}")
    print("| processes x threads | first frame: min / median / max | longest 1 ms sleep |")
    print("|---|---|---|")
    for processes in splits:
        row = measure(str(clip), not args.cpu, args.sources, processes)
        sleep = row["longest_sleep_ms"]
        threads = sorted(set(shares_of(args.sources, processes)), reverse=True)  # 2-1: uneven
        print(f"| {processes} x {'-'.join(map(str, threads))} | {row['min_s']:.3f} / "
              f"{row['median_s']:.3f} / {row['max_s']:.3f} s | "
              f"{'-' if sleep is None else f'{sleep:.1f} ms'} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
