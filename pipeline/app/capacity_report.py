"""What ``run.py capacity`` prints and saves (``pipeline.app.capacity`` measures): a row per
run (``RunRow``), the ceilings, the tables, the verdicts, and the JSON of it all.

- paced rows: held or not (``Window.held``); a row whose cameras offered more than was
  delivered is an overload, not an error: its drops and p99 are the result, and the wish
  there is latency that stays bounded (p99 <= ``OVERLOAD_P99_S``), drops counted;
- the unpaced row: throughput (delivered frames/s), beside the slower of decode alone (as the
  run places its cameras) and engine alone, as a ratio;
- the busiest stage of any process (a host's, from Prometheus; the engine's, from its log),
  device memory, GPU and NVDEC utilisation, and, with ``--http``, the live view's add and remove.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.app.api_client import AddRemove
from pipeline.app.measurement import DELIVERED_SHARE, P99_LIMIT_S, Window, bucket_text

OVERLOAD_P99_S = 1.0  # overloaded, latency should stay bounded: p99 at most this


@dataclass
class Options:
    """What ``capacity`` was asked (the command line's capacity options).

    Attributes:
        config: the user's YAML; its sources are replaced, the rest kept.
        overrides: ``--set KEY=VALUE`` applied to it first.
        clip: the video every camera plays.
        fps: each camera's frames/s (None: the clip's own rate).
        cameras: the counts to try, in order (None: search).
        budget_s: the longest the whole command may take.
        warmup_s: seconds from every camera delivering to the window.
        seconds: the window.
        out: folder for each run's config, log and scrapes and the results (None: a
            temporary one, kept and named under the table).
        decoders: decode alone's parallel decoders (None: its default).
        ceilings: measure decode alone and engine alone.
        unpaced: cameras of the unpaced row (None: none), measured after the paced rows
            (none of those unless ``cameras`` is given too).
        http: the live view on (``runtime.http`` on 127.0.0.1, a free port) and a camera
            added and removed through its API in each window (``pipeline.app.api_client``).
    """

    config: Path
    clip: Path
    overrides: list[str] = field(default_factory=list)
    fps: float | None = None
    cameras: list[int] | None = None
    budget_s: float = 1800.0
    warmup_s: float = 10.0
    seconds: float = 30.0
    out: Path | None = None
    decoders: int | None = None
    ceilings: bool = True
    unpaced: int | None = None
    http: bool = False



@dataclass
class RunRow:
    """One run: ``cameras`` cameras paced at ``fps`` (None: unpaced), its window (None when it
    could not be measured: ``error`` says why) and, with ``--http``, the add and remove."""

    cameras: int
    fps: float | None
    window: Window | None = None
    error: str | None = None
    start_s: float | None = None  # launch until every camera delivered
    took_s: float | None = None  # launch until the child exited
    exit_code: int | None = None
    control: AddRemove | None = None
    events: int | None = None  # event lines written over the whole run (output.events set)
    snapshots: int | None = None  # their snapshot JPEGs (output.event_media)

    @property
    def paced(self) -> bool:
        return self.fps is not None

    @property
    def held(self) -> bool:
        return (self.paced and self.window is not None and self.error is None
                and self.window.held)

    @property
    def overloaded(self) -> bool:
        """A paced row measured whose cameras offered more than it delivered (below
        ``DELIVERED_SHARE`` of it)."""
        w = self.window
        return (self.paced and w is not None and self.error is None and w.delivered is not None
                and bool(w.offered) and w.delivered < DELIVERED_SHARE * w.offered)


def largest_held(rows: list[RunRow]) -> int:
    """The largest camera count of a paced row that held (0: none)."""
    return max((row.cameras for row in rows if row.held), default=0)


def plural(count: int, one: str, many: str | None = None) -> str:
    return f"{count} {one if count == 1 else (many or one + 's')}"


def latency_text(found: tuple[float, float] | None) -> str:
    return bucket_text(found).split(" (")[0]


def busiest_text(window: Window) -> str:
    """``infer 92% of 30.1 s (27.6 s work, 0.3 s blocked)``: the busiest stage of any
    process, its work in % of the time its counts cover (``Window.span_of``: a host's, from
    its metrics report sent by the window's start to the one sent by its end; an engine's,
    between its log lines; left out when not known), with its work and blocked seconds (a
    host stage's summed over the hosts), and where it ran when that is not plain: ``engine
    infer ...``, ``worker3 sinks ...``."""
    if window.busiest is None:
        return "-"
    where, stage, share = window.busiest
    work, blocked = window.stage_numbers(where, stage)
    named = f"{where} " if where in window.engines or len(window.hosts) > 1 else ""
    span = window.span_of(where)
    of = "" if span is None else f" of {span:,.1f} s"
    return f"{named}{stage} {share:.0f}%{of} ({work:,.1f} s work, {blocked:,.1f} s blocked)"


def overload_text(window: Window) -> str:
    """``overload: p99 <= 500 ms, dropped 36,120; latency bounded (p99 <= 1 s): yes``
    (``NO`` when the p99's histogram bucket reaches past ``OVERLOAD_P99_S``)."""
    dropped = "-" if window.dropped is None else f"{window.dropped:,}"
    bounded = window.p99 is not None and window.p99[1] <= OVERLOAD_P99_S
    return (f"overload: p99 {latency_text(window.p99)}, dropped {dropped}; latency bounded "
            f"(p99 <= {OVERLOAD_P99_S:g} s): {'yes' if bounded else 'NO'}")


def held_text(row: RunRow) -> str:
    if row.window is None or row.error is not None:
        return f"no: failed ({row.error})"
    if row.window.held:
        return "yes"
    if row.overloaded:
        return "no: " + overload_text(row.window)
    return "no: " + ", ".join(row.window.why_not_held())


def memory_text(window: Window) -> str:
    """``3,412 MiB in 2 processes (engine 2,900)``: device memory sampled in the window."""
    memory = window.gpu_memory
    if memory is None:
        return "-"
    engine = "" if memory.engine_mib is None else f", engine {memory.engine_mib:,.0f}"
    scope = "" if memory.scope == "run" else "; every process on the GPU"
    return (f"{memory.total_mib:,.0f} MiB in "
            f"{plural(len(memory.by_pid), 'process', 'processes')}{engine}{scope}")


EVENTS_COLUMN = "events written, whole run"


def extra_columns(rows: list[RunRow]) -> list[str]:
    """The columns only some runs have: the machine's CPUs busy, GPU and NVDEC utilisation,
    memory, the live view's calls, the events (and snapshots) written."""
    windows = [row.window for row in rows if row.window is not None]
    return ((["CPU"] if any(w.cpu_busy is not None for w in windows) else [])
            + (["GPU", "NVDEC"] if any(w.gpu_util is not None for w in windows) else [])
            + (["GPU memory"] if any(w.gpu_memory is not None for w in windows) else [])
            + (["live view (--http)"] if any(row.control is not None for row in rows) else [])
            + ([EVENTS_COLUMN] if any(row.events is not None for row in rows) else []))


def extra_cells(row: RunRow, window: Window, columns: list[str]) -> list[str]:
    cells = {"CPU": "-" if window.cpu_busy is None
             else f"{window.cpu_busy:.1f} of {window.cpus} cores",
             "GPU": "-" if window.gpu_util is None else f"{window.gpu_util:.0f}%",
             "NVDEC": "-" if window.nvdec_util is None else f"{window.nvdec_util:.0f}%",
             "GPU memory": memory_text(window),
             "live view (--http)": "-" if row.control is None else row.control.text(),
             EVENTS_COLUMN: "-" if row.events is None
             else f"{row.events:,} ({row.snapshots or 0:,} snapshots)"}
    return [cells[column] for column in columns]


def line(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def table(rows: list[RunRow]) -> str:
    """The markdown table of the paced rows, one per camera count, in camera order."""
    paced = sorted((row for row in rows if row.paced), key=lambda r: r.cameras)
    extra = extra_columns(paced)
    head = ["cameras", "offered fps", "delivered fps", "dropped", "p50 latency", "p99 latency",
            "held", "busiest stage", *extra]
    lines = [line(head), "|" + "---|" * len(head)]
    for row in paced:
        w = row.window or Window(offered=row.cameras * row.fps)
        lines.append(line([str(row.cameras), f"{w.offered:,.1f}",
                           "-" if w.delivered is None else f"{w.delivered:,.1f}",
                           "-" if w.dropped is None else str(w.dropped), latency_text(w.p50),
                           latency_text(w.p99), held_text(row), busiest_text(w),
                           *extra_cells(row, w, extra)]))
    return "\n".join(lines)


def slower_ceiling(ceilings: dict[str, Any]) -> tuple[float, str] | None:
    """(frames/s, its words) of the slower of decode alone, as the run places its cameras
    (``fps``: where ``build.decoder_kind`` puts them), and engine alone; of the one measured
    when the other failed; None when neither was."""
    found = []
    decode, engine = ceilings.get("decode"), ceilings.get("engine")
    if isinstance(decode, dict) and decode.get("both_placed"):
        found.append((decode["both_fps"], f"decode alone ({decode['both_fps']:,.0f} frames/s "
                                          f"as placed: NVDEC and the CPU at once)"))
    elif isinstance(decode, dict):
        where = "NVDEC" if decode["mode"] == "gpu" else "CPU"
        found.append((decode["fps"], f"decode alone ({decode['fps']:,.0f} frames/s as placed: "
                                     f"every camera on {where})"))
    if isinstance(engine, dict):
        found.append((engine["images_s"], f"engine alone ({engine['images_s']:,.0f} images/s)"))
    return min(found, key=lambda item: item[0]) if found else None


def ceiling_ratio(row: RunRow, ceilings: dict[str, Any]) -> float | None:
    """An unpaced row's delivered frames/s over the slower ceiling (None: not measured)."""
    slower = slower_ceiling(ceilings)
    if row.window is None or row.window.delivered is None or slower is None or not slower[0]:
        return None
    return row.window.delivered / slower[0]


def unpaced_table(rows: list[RunRow], ceilings: dict[str, Any]) -> str:
    """The markdown table of the unpaced rows: throughput, not held or not."""
    unpaced = sorted((row for row in rows if not row.paced), key=lambda r: r.cameras)
    extra = extra_columns(unpaced)
    head = ["unpaced cameras", "delivered fps", "x slower ceiling", "dropped", "p50 latency",
            "p99 latency", "busiest stage", *extra]
    lines = [line(head), "|" + "---|" * len(head)]
    for row in unpaced:
        w = row.window or Window()
        ratio = ceiling_ratio(row, ceilings)
        delivered = (f"failed ({row.error})" if row.error is not None or w.delivered is None
                     else f"{w.delivered:,.1f}")
        lines.append(line([str(row.cameras), delivered,
                           "-" if ratio is None else f"{ratio:.2f}x",
                           "-" if w.dropped is None else str(w.dropped), latency_text(w.p50),
                           latency_text(w.p99), busiest_text(w), *extra_cells(row, w, extra)]))
    return "\n".join(lines)


def unpaced_verdict(row: RunRow, ceilings: dict[str, Any]) -> str:
    """One line: the unpaced row's throughput beside the slower ceiling."""
    start = f"Unpaced {plural(row.cameras, 'camera')} (live: true, pace_fps: null)"
    w = row.window
    if w is None or w.delivered is None or row.error is not None:
        return f"{start}: failed ({row.error})"
    slower, ratio = slower_ceiling(ceilings), ceiling_ratio(row, ceilings)
    beside = ("no ceiling measured" if slower is None or ratio is None else
              f"{ratio:.2f}x the slower of decode alone and engine alone: {slower[1]}")
    ended = (f"; {plural(w.ended, 'camera')} reached the clip's end in the window (a longer "
             f"clip is needed: this rate is low)" if w.ended else "")
    return (f"{start}: {w.delivered:,.0f} frames/s delivered over the window, {beside}; "
            f"{w.dropped:,} dropped (a live camera drops what the engine does not take)"
            f"{ended}.")


def ceiling_lines(ceilings: dict[str, Any], fps: float) -> list[str]:
    lines = []
    decode = ceilings.get("decode")
    if isinstance(decode, dict):
        where = (plural(decode["processes"], "worker process", "worker processes")
                 if decode["mode"] == "cpu" else "NVDEC")
        text = (f"decode alone: {decode['fps']:,.0f} frames/s ({decode['decoders']} "
                f"decoders, {decode['mode']}, {where}): at most "
                f"{decode['fps'] / fps:,.0f} cameras at {fps:g} fps")
        if decode.get("cpu_fps") is not None:
            text += (f"; the CPU's decoders alone: {decode['cpu_fps']:,.0f} frames/s "
                     f"({decode['cpu_decoders']} decoders, "
                     f"{plural(decode['cpu_processes'], 'worker process', 'worker processes')})")
        if decode.get("both_fps") is not None:
            text += (f"; NVDEC and the CPU at once: {decode['both_fps']:,.0f} frames/s (NVDEC "
                     f"{decode['both_nvdec_fps']:,.0f} + CPU {decode['both_cpu_fps']:,.0f}; "
                     + ("runtime.cpu_decode_fps is set: decode: auto places cameras on "
                        "both, so the run's decode ceiling is both at once)"
                        if decode.get("both_placed") else
                        "decode: auto places every camera on NVDEC (runtime.cpu_decode_fps: "
                        "0), so the run's decode ceiling is NVDEC alone)"))
        lines.append(text)
    elif decode is not None:
        lines.append(f"decode alone: failed ({decode})")
    engine = ceilings.get("engine")
    if isinstance(engine, dict):
        lines.append(f"engine alone: {engine['images_s']:,.0f} images/s ({engine['backend']} on "
                     f"{engine['device']}, batch {engine['batch']}, warm-up "
                     f"{engine['warmup_s']:.1f} s): at most {engine['images_s'] / fps:,.0f} "
                     f"cameras at {fps:g} fps")
    elif engine is not None:
        lines.append(f"engine alone: failed ({engine})")
    return lines


def stage_lines(row: RunRow) -> str:
    """Every stage's work and blocked seconds in ``row``'s window, busiest first: the hosts'
    (summed over them, each over the time between its metrics reports at the window's ends:
    ``Window.spans``), then each engine's over the span of its log lines."""
    if row.window is None or not (row.window.stages or row.window.engines):
        return "-"
    parts = [f"{stage} {work:,.1f} s work, {blocked:,.1f} s blocked"
             for stage, (work, blocked) in sorted(row.window.stages.items(),
                                                  key=lambda item: -item[1][0])]
    spans = sorted({round(span, 1) for span in row.window.spans.values()})
    if parts and spans:
        over = f"{spans[0]:,.1f}" + ("" if len(spans) == 1 else f"-{spans[-1]:,.1f}")
        parts[-1] += f" (over the {over} s between the metrics reports at the window's ends)"
    for name, engine in row.window.engines.items():
        parts += [f"{name} {stage} {work:,.1f} s work, {blocked:,.1f} s blocked"
                  for stage, (work, blocked, _) in sorted(engine.stages.items(),
                                                          key=lambda item: -item[1][0])]
        parts[-1] += f" ({name}: over the {engine.span_s:,.1f} s between its log lines)"
    return "; ".join(parts)


def overload_verdict(row: RunRow) -> str:
    """One line for an overloaded paced row: its drops and p99, and whether latency stayed
    bounded."""
    w = row.window
    return (f"{plural(row.cameras, 'camera')} at {row.fps:g} fps: {overload_text(w)}; "
            f"delivered {w.delivered:,.0f} of {w.offered:,.0f} frames/s offered "
            f"({w.delivered_pct:.0f}%).")


def report(header: str, rows: list[RunRow], ceilings: dict[str, Any],
           notes: list[str], fps: float) -> str:
    """What is printed and saved: the header, the ceilings, the tables, the verdicts, the
    answer (the largest paced count held, when paced counts were tried)."""
    paced = [row for row in rows if row.paced]
    unpaced = [row for row in rows if not row.paced]
    lines = [header, "", *ceiling_lines(ceilings, fps), ""]
    if paced or not unpaced:
        lines += [table(paced), ""]
        focus = min((r for r in paced if not r.held and r.window is not None),
                    key=lambda r: r.cameras, default=None)
        if focus is not None:
            lines.append(f"Stages at {plural(focus.cameras, 'camera')} (the fewest that did not "
                         f"hold), summed over the window: {stage_lines(focus)}")
        lines += [overload_verdict(row) for row in sorted(paced, key=lambda r: r.cameras)
                  if row.overloaded]
    if unpaced:
        lines += [""] * (lines[-1] != "") + [unpaced_table(unpaced, ceilings), ""]
        for row in unpaced:
            lines += [f"Stages at {plural(row.cameras, 'camera')} unpaced, summed over the "
                      f"window: {stage_lines(row)}", unpaced_verdict(row, ceilings)]
    for row in sorted(rows, key=lambda r: (r.paced, r.cameras)):
        if row.control is not None and row.control.notes:
            how = f"at {row.fps:g} fps" if row.paced else "unpaced"
            lines.append(f"Live view at {plural(row.cameras, 'camera')} {how}: "
                         + "; ".join(row.control.notes))
    lines += [f"Note: {note}" for note in notes]
    if paced or not unpaced:
        best = largest_held(rows)
        lines.append(f"Largest held: {plural(best, 'camera')} at {fps:g} fps "
                     f"({best * fps:,.0f} frames/s)." if best else
                     "Largest held: none of the counts tried held.")
    return "\n".join(lines) + "\n"


def results_json(options: Options, rows: list[RunRow], ceilings: dict[str, Any],
                 notes: list[str], fps: float) -> dict[str, Any]:
    def window(w: Window | None) -> dict[str, Any] | None:
        if w is None:
            return None
        found = asdict(w)
        found.update(held=w.held, delivered_pct=w.delivered_pct)
        if w.gpu_memory is not None:
            found["gpu_memory"].update(total_mib=w.gpu_memory.total_mib,
                                       engine_mib=w.gpu_memory.engine_mib)
        return found

    def run(row: RunRow) -> dict[str, Any]:
        found = {k: v for k, v in asdict(row).items() if k != "window"}
        found.update(paced=row.paced, held=row.held, overloaded=row.overloaded,
                     window=window(row.window))
        if not row.paced:
            found["ceiling_ratio"] = ceiling_ratio(row, ceilings)
        if row.control is not None:
            found["control"].update(added_ok=row.control.added_ok,
                                    removed_ok=row.control.removed_ok,
                                    delivered=row.control.delivered)
        return found

    return {"clip": str(options.clip), "config": str(options.config), "fps": fps,
            "warmup_s": options.warmup_s, "seconds": options.seconds,
            "held_limits": {"dropped": 0, "p99_s": P99_LIMIT_S,
                            "delivered_share": DELIVERED_SHARE},
            "overload_p99_s": OVERLOAD_P99_S, "largest_held": largest_held(rows),
            "ceilings": ceilings, "notes": notes, "runs": [run(row) for row in rows]}


def header_text(options: Options, config: Any, clip: Path, played: Path, frames: int,
                fps: float, engine: Any = None) -> str:
    """The table's first paragraph. ``engine``: the engine-alone ceiling (a dict), whose
    backend and device say what an ``auto`` of the configuration chose (else ``auto``)."""
    from pipeline.app.clips import clip_frames

    inference = config.inference
    chosen = engine if isinstance(engine, dict) else {}
    backend, device = inference.backend, inference.device
    if backend == "auto" and chosen.get("backend"):
        backend = f"{chosen['backend']} (auto)"
    if device == "auto" and chosen.get("device"):
        device = f"{chosen['device']} (auto)"
    copies = clip_frames(played) // max(frames, 1) if played != clip else 1
    looped = f", looped {copies}x" if copies > 1 else ""
    paced = options.cameras is not None or options.unpaced is None
    rows = ([f"as paced live cameras at {fps:g} fps"] if paced else []) + (
        [f"as {plural(options.unpaced, 'unpaced live camera')} (live: true, pace_fps: null: "
         f"each reads as fast as it decodes and drops what the engine does not take)"]
        if options.unpaced else [])
    http = ("; the live view on (runtime.http), a camera added through its API at 20% of "
            "each window and removed at 60%" if options.http else "")
    overrides = "".join(f" --set {item}" for item in options.overrides)
    return (f"Capacity: {clip.name} ({frames:,} frames{looped}) {' and '.join(rows)} through "
            f"`run.py run` with {options.config}{overrides} (model "
            f"{Path(config.model.path).name}, inference {backend} on {device}, batch "
            f"{inference.batch_size}){http}; warm-up "
            f"{options.warmup_s:g} s, window {options.seconds:g} s. Held: 0 dropped, p99 <= "
            f"{1000 * P99_LIMIT_S:g} ms, delivered >= {100 * DELIVERED_SHARE:g}% of offered. "
            f"Latencies are histogram buckets (bounds 5, 10, 20, 50, 100, 200, 500 ms, ...).")
