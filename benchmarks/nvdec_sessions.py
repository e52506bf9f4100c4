"""How much NVDEC decodes with many sessions, split over processes, beside GPU compute.

    python -m benchmarks.nvdec_sessions --clip C.mp4 [--rows 16x1,100x5,150x5@30+load]
                                        [--seconds 8] [--warmup-s 6]

Each row is ``SESSIONSxPROCESSES[@FPS][+load][+copy]``: SESSIONS ``GpuDecodeStage`` decoders
of the clip (looped; threads, dealt evenly over PROCESSES spawned processes, each process
one CUDA context, as the source workers are), unpaced or paced at FPS each (as
``capacity``'s cameras), with ``+load``: one more process keeping the GPU's SMs busy with
FP16 matrix products in its own context (as the engine's model does), with ``+copy``: each
picture's planes copied on the device by its decoding thread (as a source worker copies it
into the engine's ring). Otherwise nothing but decoding: each picture stays on the device
and is dropped. The rows run one after another; each is counted over ``--seconds`` after
``--warmup-s``, and prints:

- delivered frames/s, and offered frames/s for a paced row;
- late: the share of the window's frames delivered more than 100 ms after they were due
  (paced rows; a decoder that cannot keep up delivers ever later);
- NVDEC and GPU busy (the decoder and GPU utilisation, mean of samples every 250 ms over the
  window: ``pipeline.app.measurement.UtilisationSampler``, as ``capacity``'s);
- CPU: the machine's cores busy over the window (``/proc/stat``: ``measurement.cores_busy``).

So the question "what lowers NVDEC's frames per busy second in a run" is answered by rows
that differ in one thing: the session count, the processes (CUDA contexts), compute load, or
the copy. And the other way round: the load's products per second (``0x0+load``: alone) say
how much GPU time the decoders' contexts take from a compute process such as the engine.
"""

from __future__ import annotations

import argparse
import multiprocessing
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.app.measurement import UtilisationSampler, cores_busy, cpu_ticks

ROW = re.compile(r"^(\d+)x(\d+)(?:@(\d+(?:\.\d+)?))?(\+load)?(\+copy)?$")
LATE_S = 0.1  # a paced frame delivered later than this after its due time is late
SAMPLE_S = 0.25  # GPU and NVDEC utilisation sampled this often (NVML, else nvidia-smi)
FLUSH_S = 0.25  # each child adds its threads' counts to the shared counters this often


@dataclass(frozen=True)
class Row:
    """One measurement: ``sessions`` decoders over ``processes`` processes, paced at ``fps``
    each (None: as fast as they can), with a compute load beside them or not, each picture
    copied on the device (``copy``: as a source worker copies it into the engine's ring) or
    dropped."""

    sessions: int
    processes: int
    fps: float | None
    load: bool
    copy: bool = False

    @property
    def label(self) -> str:
        return (f"{self.sessions}x{self.processes}" + (f"@{self.fps:g}" if self.fps else "")
                + ("+load" if self.load else "") + ("+copy" if self.copy else ""))


def parse_rows(text: str) -> list[Row]:
    """``--rows``: comma-separated ``SESSIONSxPROCESSES[@FPS][+load][+copy]`` (``0x0+load``:
    the load alone).

    Raises:
        ValueError: a row that does not parse, more processes than sessions, or no sessions
            and no load.
    """
    rows = []
    for part in text.split(","):
        match = ROW.match(part.strip())
        if match is None:
            raise ValueError(f"--rows: {part!r} is not SESSIONSxPROCESSES[@FPS][+load][+copy]")
        sessions, processes = int(match[1]), int(match[2])
        if sessions == processes == 0 and match[4]:
            rows.append(Row(0, 0, None, True))
            continue
        if not 0 < processes <= sessions:
            raise ValueError(f"--rows: {part!r}: 1 to {sessions} processes")
        rows.append(Row(sessions, processes, float(match[3]) if match[3] else None,
                        bool(match[4]), bool(match[5])))
    return rows


def deal(sessions: int, processes: int) -> list[list[int]]:
    """Session numbers dealt round-robin over ``processes`` (none for no processes)."""
    return [list(range(k, sessions, processes)) for k in range(processes)]


def _decoding_child(clip: str, sessions: list[int], fps: float | None, copy: bool,
                    device: int, frames: object, late: object, stop: object) -> None:
    """A process decoding ``sessions`` in threads until ``stop`` is set, adding its frames
    (and its paced frames delivered more than ``LATE_S`` late) to the shared counters. With
    ``copy``, each picture's two NV12 planes are copied into a buffer of its session on a
    non-blocking stream of the thread, waited for before the next picture."""
    import cupy

    from pipeline.config import SourceConfig
    from pipeline.records import Frame
    from stages.gpu_decode import GpuDecodeStage

    ended = threading.Event()
    counts = {number: [0, 0] for number in sessions}  # frames, late frames; one writer each

    def decode(number: int) -> None:
        source = SourceConfig(name=f"cam{number:03d}", uri=clip, loop=True, pace_fps=fps)
        stream = cupy.cuda.Stream(non_blocking=True) if copy else None
        target: list = []
        for item in GpuDecodeStage(source, device).frames(ended):
            if isinstance(item, Frame):
                if stream is not None:
                    y, uv = item.device_planes
                    if not target:
                        target = [cupy.empty(y.shape, y.dtype), cupy.empty(uv.shape, uv.dtype)]
                    with stream:
                        target[0][...] = y
                        target[1][...] = uv
                    stream.synchronize()
                counts[number][0] += 1
                if fps and time.time() - item.capture_time > LATE_S:
                    counts[number][1] += 1
            elif item.error:
                print(f"cam{number:03d}: {item.error}", file=sys.stderr)

    threads = [threading.Thread(target=decode, args=(n,), daemon=True) for n in sessions]
    for thread in threads:
        thread.start()
    added = [0, 0]
    while not stop.wait(FLUSH_S):
        total = [sum(c[0] for c in counts.values()), sum(c[1] for c in counts.values())]
        with frames.get_lock():
            frames.value += total[0] - added[0]
        with late.get_lock():
            late.value += total[1] - added[1]
        added = total
    ended.set()
    for thread in threads:
        thread.join(10)


def _load_child(device: int, stop: object, done: object) -> None:
    """FP16 matrix products (8192 x 8192) on ``device`` until ``stop`` is set: the SMs kept
    busy from a context of its own; ``done`` counts the products finished, so the GPU time
    the decoders' contexts take from it shows as a lower rate."""
    import cupy

    with cupy.cuda.Device(device):
        a = cupy.random.random((8192, 8192), dtype=cupy.float32).astype(cupy.float16)
        while not stop.is_set():
            for _ in range(8):
                a = (a @ a) * cupy.float16(1e-4)
            cupy.cuda.Device().synchronize()
            with done.get_lock():
                done.value += 8


def measure(row: Row, clip: Path, seconds: float, warmup_s: float, device: int) -> dict:
    """One row's figures (module docstring)."""
    context = multiprocessing.get_context("spawn")
    frames, late, stop = context.Value("q", 0), context.Value("q", 0), context.Event()
    products = context.Value("q", 0)
    procs = [context.Process(target=_decoding_child, daemon=True,
                             args=(str(clip), part, row.fps, row.copy, device, frames, late,
                                   stop))
             for part in deal(row.sessions, row.processes)]
    if row.load:
        procs.append(context.Process(target=_load_child, args=(device, stop, products),
                                     daemon=True))
    for proc in procs:
        proc.start()
    try:
        time.sleep(warmup_s)
        with UtilisationSampler(True, SAMPLE_S, device) as sampler:
            ticks, f0, l0, p0 = cpu_ticks(), frames.value, late.value, products.value
            t0 = time.perf_counter()
            time.sleep(seconds)
            f1, l1, p1, t1 = frames.value, late.value, products.value, time.perf_counter()
            cores = cores_busy(ticks, cpu_ticks())
        gpu, nvdec = sampler.mean(t0, t1) or (None, None)
    finally:
        stop.set()
        for proc in procs:
            proc.join(20)
            if proc.is_alive():
                proc.kill()
    delivered = (f1 - f0) / (t1 - t0)
    return {"row": row.label, "fps": delivered,
            "offered": row.sessions * row.fps if row.fps else None,
            "late": (l1 - l0) / max(f1 - f0, 1) if row.fps else None,
            "gpu": gpu, "nvdec": nvdec, "cores": cores,
            "load": (p1 - p0) / (t1 - t0) if row.load else None}


def table(results: list[dict]) -> str:
    """The rows as a Markdown table."""
    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}%"

    lines = ["| row | delivered fps | offered fps | late (> 100 ms) | NVDEC | GPU | CPU cores "
             "| load: products/s |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['row']} | {r['fps']:,.1f} | "
                     + ("-" if r["offered"] is None else f"{r['offered']:,.0f}") + " | "
                     + ("-" if r["late"] is None else f"{100 * r['late']:.1f}%")
                     + f" | {pct(r['nvdec'])} | {pct(r['gpu'])} | "
                     + ("-" if r["cores"] is None else f"{r['cores']:.1f}") + " | "
                     + ("-" if r.get("load") is None else f"{r['load']:.1f}") + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clip", type=Path, required=True)
    parser.add_argument("--rows", default="16x1,100x1,100x5,100x5+load,150x5@30,150x5@30+load")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--warmup-s", type=float, default=6.0)
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        rows = parse_rows(args.rows)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not args.clip.is_file():
        print(f"error: --clip: no file {args.clip}", file=sys.stderr)
        return 2
    results = []
    for row in rows:
        results.append(measure(row, args.clip, args.seconds, args.warmup_s, args.device))
        print(table(results[-1:]).splitlines()[-1], flush=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
