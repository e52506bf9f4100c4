"""A clip long enough to play as a camera for a whole measurement: the file's video repeated
end to end by a stream copy (PyAV remux, no re-encode), for ``capacity`` and the benchmarks.

    clip.mp4 (N frames) ──remux x R, timestamps shifted per copy──> clip_xR.mp4 (R x N frames)
"""

from __future__ import annotations

import math
from pathlib import Path

import av


def clip_frames(clip: Path) -> int:
    """Frames of a file's first video stream (counted by demuxing when the header has none)."""
    with av.open(str(clip)) as container:
        stream = container.streams.video[0]
        if stream.frames:
            return int(stream.frames)
        return sum(1 for packet in container.demux(stream) if packet.size)


def clip_rate(clip: Path) -> float | None:
    """The average frame rate of a file's first video stream, or None when it has none."""
    with av.open(str(clip)) as container:
        rate = container.streams.video[0].average_rate
    return float(rate) if rate else None


def make_looped_clip(source: Path, target: Path, repeats: int) -> Path:
    """``source``'s video repeated ``repeats`` times end to end, by a stream copy (no
    re-encode; timestamps shifted per copy so they keep rising); once, cached at ``target``."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.stem + ".partial" + target.suffix)
    with av.open(str(partial), "w") as out:
        ostream = None
        offset = 0  # in the source stream's time base
        for _ in range(repeats):
            with av.open(str(source)) as inp:
                istream = inp.streams.video[0]
                if ostream is None:
                    ostream = out.add_stream_from_template(istream)
                end = offset
                for packet in inp.demux(istream):
                    if packet.dts is None or not packet.size:  # the demuxer's flush packet
                        continue
                    pts = packet.pts if packet.pts is not None else packet.dts
                    end = max(end, offset + pts + (packet.duration or 0))
                    packet.pts, packet.dts = offset + pts, offset + packet.dts
                    packet.stream = ostream
                    out.mux(packet)
                offset = end
    partial.replace(target)
    return target


def repeats_for(frames: int, seconds: float, fps: float) -> int:
    """How many copies of a clip of ``frames`` one camera reading ``fps`` frames a second
    needs to read for ``seconds``."""
    return max(1, math.ceil(fps * seconds / max(frames, 1)))


def clip_for(clip: Path, seconds: float, fps: float, folder: Path) -> Path:
    """``clip`` itself when one camera at ``fps`` reads it for ``seconds`` without reaching
    its end, else a looped copy of it in ``folder`` (``make_looped_clip``)."""
    repeats = repeats_for(clip_frames(clip), seconds, fps)
    if repeats == 1:
        return clip
    return make_looped_clip(clip, folder / f"{clip.stem}_x{repeats}{clip.suffix or '.mp4'}",
                            repeats)
