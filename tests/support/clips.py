"""Small H.264 clips for tests, made once per session and shared: ``ClipFactory`` (the
``make_clip`` fixture) and ``defect_clips``, one clip with each defect a decoder meets.

    samples' videos ──decode once──> frames ──scale, encode──> <session tmp>/<key>.mp4
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path

import av
import cv2
import numpy as np

from tests.support import (
    damage_packets,
    read_frames,
    truncate,
    write_clip,
    write_multitrack,
    write_size_change,
)

SMALL, WIDE = (176, 144), (320, 136)


def draw_picture(width: int, height: int, t: int = 0) -> np.ndarray:
    """A (height, width, 3) uint8 RGB test picture: gradients, saturated shapes and text;
    the shapes move with ``t``."""
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None]
    img = np.stack([x + 0 * y, y + 0 * x, (x + y) / 2], axis=-1).astype(np.uint8)
    s = min(width, height)
    cv2.circle(img, (width // 3 + 3 * t, height // 2), s // 4, (255, 20, 20), -1)
    cv2.rectangle(img, (width // 2, s // 8), (width // 2 + s // 3, s // 2 + t), (0, 0, 255), -1)
    cv2.line(img, (0, height - 1), (width - 1, 0), (255, 255, 0), max(1, s // 40))
    cv2.putText(img, "streamdet", (s // 10, height - s // 8), 0, s / 200, (250, 250, 250), 2)
    return img


class ClipFactory:
    """Clips of a scene at a size, each made once and cached by its parameters.

    Scenes: the sample videos by name (``bikes``: a street with people, cars and bicycles,
    detections on most frames; ``carphone``: a person in a car; ``bigbuckbunny``: cartoon)
    and ``shapes`` (drawn: gradients and shapes moving 4 pixels a frame, no detections).

    Args:
        folder: where the clips are written (a session's temporary folder).
        videos: sample name -> its video file.
    """

    def __init__(self, folder: Path, videos: Mapping[str, Path]) -> None:
        self.folder = folder
        self.videos = dict(videos)
        self._made: dict[tuple, Path] = {}

    @functools.cache  # noqa: B019 - one factory per session
    def frames(self, scene: str, count: int, start: int = 0) -> tuple[av.VideoFrame, ...]:
        """Frames ``start`` to ``start + count`` of ``scene`` at its own size (``shapes``:
        640x360)."""
        if scene == "shapes":
            return tuple(av.VideoFrame.from_ndarray(draw_picture(640, 360, 4 * t), format="rgb24")
                         for t in range(start, start + count))
        if scene not in self.videos:
            raise ValueError(f"unknown scene {scene!r}; scenes: shapes, {', '.join(self.videos)}")
        frames = read_frames(self.videos[scene], start + count)[start:]
        assert len(frames) == count, f"{scene} has only {start + len(frames)} frames"
        return tuple(frames)

    def __call__(self, scene: str, frames: int, size: tuple[int, int], *, start: int = 0,
                 reverse: bool = False, fmt: str = "mp4", gop: int | None = None) -> Path:
        """A clip of ``frames`` frames of ``scene`` from frame ``start`` (backwards with
        ``reverse``), scaled to ``size`` (width, height), as H.264 at 25 fps in ``fmt``
        (``mp4``, with its index first, or ``mpegts``); with ``gop``, a keyframe every ``gop``
        frames exactly (else x264 places them: the first, and scene cuts). Do not change the
        file: it is shared."""
        key = (scene, frames, size, start, reverse, fmt, gop)
        if key not in self._made:
            pictures = list(self.frames(scene, frames, start))
            if reverse:
                pictures.reverse()
            name = (f"{scene}-{start}-{frames}{'-rev' if reverse else ''}"
                    f"{f'-gop{gop}' if gop else ''}-{size[0]}x{size[1]}"
                    f".{'ts' if fmt == 'mpegts' else fmt}")
            self._made[key] = write_clip(self.folder / name, pictures, size, fmt, gop)
        return self._made[key]


def make_defect_clips(make_clip: ClipFactory, out: Path) -> dict[str, Path]:
    """Small clips, each with one defect, and the clean clip they were made from; in ``out``.

    ``clean``: 40 frames of bikes at 320x136, its index first (a cut keeps the start);
    ``small``: 30 frames of carphone at 176x144; ``truncated``: clean cut to half its bytes;
    ``damaged``: clean with packets 10 and 25 undecodable; ``multitrack``: an audio track,
    then 30 frames at 176x144 and 20 at 320x136; ``size_change``: MPEG-TS of 20 frames at
    176x144, then 20 at 320x136; ``text``: not a video; ``empty``: no bytes; ``cut_index``:
    the bikes sample cut to half (its index is at the end: none is left).
    """
    car, bikes = list(make_clip.frames("carphone", 30)), list(make_clip.frames("bikes", 40))
    clean = make_clip("bikes", 40, WIDE)
    (out / "text.mp4").write_text("not a video\n")
    (out / "empty.mp4").write_bytes(b"")
    return {
        "clean": clean,
        "small": make_clip("carphone", 30, SMALL),
        "truncated": truncate(clean, out / "truncated.mp4", keep=0.5),
        "damaged": damage_packets(clean, out / "damaged.mp4", {10, 25}),
        "multitrack": write_multitrack(out / "multi.mp4", car, bikes[:20], (SMALL, WIDE)),
        "size_change": write_size_change(out / "size.ts", car[:20], bikes[20:40], (SMALL, WIDE)),
        "text": out / "text.mp4",
        "empty": out / "empty.mp4",
        "cut_index": truncate(make_clip.videos["bikes"], out / "cut_index.mp4", keep=0.5),
    }
