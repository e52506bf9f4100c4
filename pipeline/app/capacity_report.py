"""What ``run.py capacity`` prints and saves (``pipeline.app.capacity`` measures): a row per
camera count tried (``RunRow``), the ceilings, the table, the answer, and the JSON of it all.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.app.measurement import DELIVERED_SHARE, P99_LIMIT_S, Window, bucket_text

if TYPE_CHECKING:
    from pipeline.app.capacity import Options


@dataclass
class RunRow:
    """One N tried: its window (None when it could not be measured: ``error`` says why)."""

    cameras: int
    fps: float
    window: Window | None = None
    error: str | None = None
    start_s: float | None = None  # launch until every camera delivered
    took_s: float | None = None  # launch until the child exited
    exit_code: int | None = None

    @property
    def held(self) -> bool:
        return self.window is not None and self.error is None and self.window.held


def largest_held(rows: list[RunRow]) -> int:
    """The largest camera count that held (0: none)."""
    return max((row.cameras for row in rows if row.held), default=0)



def plural(count: int, one: str, many: str | None = None) -> str:
    return f"{count} {one if count == 1 else (many or one + 's')}"


def latency_text(found: tuple[float, float] | None) -> str:
    return bucket_text(found).split(" (")[0]


def busiest_text(window: Window) -> str:
    """``infer 92% (27.6 s work, 0.3 s blocked)``: the busiest stage of any host, with its
    work and blocked seconds summed over the hosts."""
    if window.busiest is None:
        return "-"
    host, stage, share = window.busiest
    work, blocked = window.stages.get(stage, (0.0, 0.0))
    where = f"{host} " if len(window.hosts) > 1 else ""
    return f"{where}{stage} {share:.0f}% ({work:,.1f} s work, {blocked:,.1f} s blocked)"


def held_text(row: RunRow) -> str:
    if row.window is None or row.error is not None:
        return f"no: failed ({row.error})"
    if row.window.held:
        return "yes"
    return "no: " + ", ".join(row.window.why_not_held())


def table(rows: list[RunRow]) -> str:
    """The markdown table, one row per N tried, in camera order."""
    gpu = any(row.window is not None and row.window.gpu_util is not None for row in rows)
    head = ["cameras", "offered fps", "delivered fps", "dropped", "p50 latency", "p99 latency",
            "held", "busiest stage"] + (["GPU"] if gpu else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in sorted(rows, key=lambda r: r.cameras):
        w = row.window or Window(offered=row.cameras * row.fps)
        cells = [str(row.cameras), f"{w.offered:,.1f}",
                 "-" if w.delivered is None else f"{w.delivered:,.1f}",
                 "-" if w.dropped is None else str(w.dropped), latency_text(w.p50),
                 latency_text(w.p99), held_text(row), busiest_text(w)]
        if gpu:
            cells.append("-" if w.gpu_util is None else f"{w.gpu_util:.0f}%")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ceiling_lines(ceilings: dict[str, Any], fps: float) -> list[str]:
    lines = []
    decode = ceilings.get("decode")
    if isinstance(decode, dict):
        where = (plural(decode["processes"], "worker process", "worker processes")
                 if decode["mode"] == "cpu" else "NVDEC")
        lines.append(f"decode alone: {decode['fps']:,.0f} frames/s ({decode['decoders']} "
                     f"decoders, {decode['mode']}, {where}): at most "
                     f"{decode['fps'] / fps:,.0f} cameras at {fps:g} fps")
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
    """Every stage's work and blocked seconds in ``row``'s window, busiest first."""
    if row.window is None or not row.window.stages:
        return "-"
    return "; ".join(f"{stage} {work:,.1f} s work, {blocked:,.1f} s blocked"
                     for stage, (work, blocked) in sorted(row.window.stages.items(),
                                                          key=lambda item: -item[1][0]))


def report(header: str, rows: list[RunRow], ceilings: dict[str, Any],
           notes: list[str], fps: float) -> str:
    """What is printed and saved: the header, the ceilings, the table, the answer."""
    best = largest_held(rows)
    lines = [header, "", *ceiling_lines(ceilings, fps), "", table(rows), ""]
    focus = min((r for r in rows if not r.held and r.window is not None),
                key=lambda r: r.cameras, default=None)
    if focus is not None:
        lines.append(f"Stages at {plural(focus.cameras, 'camera')} (the fewest that did not hold), "
                     f"summed over the window: {stage_lines(focus)}")
    lines += [f"Note: {note}" for note in notes]
    if best:
        lines.append(f"Largest held: {plural(best, 'camera')} at {fps:g} fps "
                     f"({best * fps:,.0f} frames/s).")
    else:
        lines.append("Largest held: none of the counts tried held.")
    return "\n".join(lines) + "\n"


def results_json(options: Options, rows: list[RunRow], ceilings: dict[str, Any],
                 notes: list[str], fps: float) -> dict[str, Any]:
    def window(w: Window | None) -> dict[str, Any] | None:
        if w is None:
            return None
        found = asdict(w)
        found.update(held=w.held, delivered_pct=w.delivered_pct)
        return found

    return {"clip": str(options.clip), "config": str(options.config), "fps": fps,
            "warmup_s": options.warmup_s, "seconds": options.seconds,
            "held_limits": {"dropped": 0, "p99_s": P99_LIMIT_S,
                            "delivered_share": DELIVERED_SHARE},
            "largest_held": largest_held(rows), "ceilings": ceilings, "notes": notes,
            "runs": [{**{k: v for k, v in asdict(row).items() if k != "window"},
                      "held": row.held, "window": window(row.window)} for row in rows]}


def header_text(options: Options, config: Any, clip: Path, played: Path, frames: int,
                fps: float) -> str:
    from pipeline.app.clips import clip_frames

    inference = config.inference
    copies = clip_frames(played) // max(frames, 1) if played != clip else 1
    looped = f", looped {copies}x" if copies > 1 else ""
    return (f"Capacity: {clip.name} ({frames:,} frames{looped}) as paced live cameras at "
            f"{fps:g} fps through `run.py run` with {options.config} (model "
            f"{Path(config.model.path).name}, inference {inference.backend} on "
            f"{inference.device}, batch {inference.batch_size}); warm-up {options.warmup_s:g} s,"
            f" window {options.seconds:g} s. Held: 0 dropped, p99 <= {1000 * P99_LIMIT_S:g} ms,"
            f" delivered >= {100 * DELIVERED_SHARE:g}% of offered. Latencies are histogram "
            f"buckets (bounds 5, 10, 20, 50, 100, 200, 500 ms, ...).")
