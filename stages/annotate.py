"""Annotate: draw each frame's detections (box, class name, score, track id) onto its I420
planes, and the source's counting zones and lines with their counts.

The stage gets one ``BatchDetections`` per batch and draws on the batch's host images in
place (the images are views of the pipeline's slot ring; the video sink encodes them later).
Drawing on the Y, U and V planes directly (boxes in the class colour, converted to YUV)
avoids two colour conversions per frame: the encoder takes I420 as it is.

The counts shown on a frame are those after its own events: the stage keeps a running sum
of the events it sees (``AnalyticsCounts``, as the analytics stage does), frame by frame.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import cv2
import numpy as np

from pipeline.records import AnalyticsEvent, BatchDetections, Detections
from pipeline.stage import Stage
from stages.analytics import AnalyticsCounts, Region

FONT = cv2.FONT_HERSHEY_SIMPLEX
ZONE_BGR = (0, 220, 255)  # amber
LINE_BGR = (255, 80, 255)  # magenta


def yuv_of_bgr(bgr: tuple[float, float, float]) -> tuple[int, int, int]:
    """An 8-bit BGR colour as limited-range BT.601 (Y, U, V)."""
    b, g, r = (float(c) / 255.0 for c in bgr)
    y = 16 + 65.481 * r + 128.553 * g + 24.966 * b
    u = 128 - 37.797 * r - 74.203 * g + 112.0 * b
    v = 128 + 112.0 * r - 93.786 * g - 18.214 * b
    return round(y), round(u), round(v)


def class_colour_yuv(class_id: int) -> tuple[int, int, int]:
    """A distinct, stable colour per class as limited-range BT.601 (Y, U, V)."""
    hue = (class_id * 47) % 180
    bgr = cv2.cvtColor(np.uint8([[[hue, 220, 255]]]), cv2.COLOR_HSV2BGR)[0, 0]
    return yuv_of_bgr(tuple(float(c) for c in bgr))


def i420_planes(image: np.ndarray, width: int, height: int) -> tuple[np.ndarray, ...]:
    """Views of the Y (h, w), U and V (h/2, w/2) planes of an I420 (h*3/2, w) uint8 array."""
    flat = image.reshape(-1)
    chroma = (height // 2) * (width // 2)
    y = flat[: width * height].reshape(height, width)
    u = flat[width * height: width * height + chroma].reshape(height // 2, width // 2)
    v = flat[width * height + chroma: width * height + 2 * chroma].reshape(height // 2, width // 2)
    return y, u, v


def _sizes(width: int, height: int) -> tuple[int, float]:
    """Line thickness (even: chroma has half the pixels) and font scale for a frame size."""
    return max(2, round(min(width, height) / 360)) & ~1, max(0.4, min(width, height) / 900)


def draw_label(planes: tuple[np.ndarray, ...], label: str, x: int, bottom: int,
               colour: tuple[int, int, int], scale: float) -> None:
    """Write ``label`` on a filled box of ``colour`` (Y, U, V) whose bottom-left corner is at
    (x, bottom) (moved down to stay in the picture), in place."""
    y_plane, u_plane, v_plane = planes
    (text_w, text_h), baseline = cv2.getTextSize(label, FONT, scale, 1)
    top = max(0, bottom - text_h - baseline - 2)
    cv2.rectangle(y_plane, (x, top), (x + text_w + 2, top + text_h + baseline + 2), colour[0], -1)
    for plane, value in ((u_plane, colour[1]), (v_plane, colour[2])):
        cv2.rectangle(plane, (x // 2, top // 2),
                      ((x + text_w + 2) // 2, (top + text_h + baseline + 2) // 2), value, -1)
    text_luma = 16 if colour[0] > 120 else 235
    cv2.putText(y_plane, label, (x + 1, top + text_h + 1), FONT, scale, text_luma, 1,
                cv2.LINE_AA)


def draw_detections(image: np.ndarray, width: int, height: int, detections: Detections,
                    class_names: list[str] | None = None) -> None:
    """Draw boxes and labels (class, score and ``#track`` when tracked) in place.

    Args:
        image: (height * 3 // 2, width) uint8 I420 host array, C-contiguous; modified.
        detections: host arrays in frame pixel coordinates.
        class_names: names indexed by class id, or None to print ids.
    """
    planes = i420_planes(image, width, height)
    y_plane, u_plane, v_plane = planes
    thickness, scale = _sizes(width, height)
    track_ids = ([-1] * len(detections) if detections.tracker_id is None
                 else detections.tracker_id.tolist())
    for box, score, cls, track_id in zip(detections.xyxy, detections.confidence,
                                         detections.class_id, track_ids):
        x1, y1, x2, y2 = (int(round(float(c))) for c in box)
        colour = class_colour_yuv(int(cls))
        cv2.rectangle(y_plane, (x1, y1), (x2, y2), colour[0], thickness)
        for plane, value in ((u_plane, colour[1]), (v_plane, colour[2])):
            cv2.rectangle(plane, (x1 // 2, y1 // 2), (x2 // 2, y2 // 2), value, thickness // 2)
        name = class_names[cls] if class_names and 0 <= cls < len(class_names) else str(int(cls))
        label = f"{name} {float(score):.2f}" + (f" #{track_id}" if track_id >= 0 else "")
        draw_label(planes, label, x1, y1, colour, scale)


def count_text(total: dict[str, int]) -> str:
    """A count by class as one number (the classes summed)."""
    return str(sum(total.values()))


def draw_regions(image: np.ndarray, width: int, height: int, regions: list[Region],
                 counts: AnalyticsCounts) -> None:
    """Draw zones (outline; "name: inside now (entered/exited)") and lines (with an arrow
    to the side that counts as in; "name: in N out M") in place; a region with a point
    outside the frame is not drawn (the analytics stage left it out).

    Args:
        image: (height * 3 // 2, width) uint8 I420 host array, C-contiguous; modified.
        regions: the source's zones and lines.
        counts: the source's counts as of this frame.
    """
    planes = i420_planes(image, width, height)
    thickness, scale = _sizes(width, height)
    now = counts.to_json()
    for region in regions:
        if region.frame_error(width, height) is not None:
            continue
        colour = yuv_of_bgr(ZONE_BGR if region.type == "zone" else LINE_BGR)
        points = np.round(region.points).astype(np.int32)
        if region.type == "zone":
            zone = now["zones"][region.name]
            label = (f"{region.name}: {count_text(zone['inside'])} "
                     f"({count_text(zone['entered'])}/{count_text(zone['exited'])})")
            for plane, value, shift in zip(planes, colour, (0, 1, 1)):
                cv2.polylines(plane, [points >> shift], True, value, max(1, thickness >> shift))
        else:
            line = now["lines"][region.name]
            label = f"{region.name}: in {count_text(line['in'])} out {count_text(line['out'])}"
            start, end = region.points
            middle = (start + end) / 2
            direction = (end - start) / float(np.hypot(*(end - start)))
            # In is to the right of start -> end as shown (y down): normal (-dy, dx).
            tip = middle + np.array([-direction[1], direction[0]]) * 6 * thickness
            for plane, value, shift in zip(planes, colour, (0, 1, 1)):
                scale_to = 1 / (1 << shift)
                cv2.line(plane, tuple(np.round(start * scale_to).astype(int).tolist()),
                         tuple(np.round(end * scale_to).astype(int).tolist()), value,
                         max(1, thickness >> shift))
                cv2.arrowedLine(plane, tuple(np.round(middle * scale_to).astype(int).tolist()),
                                tuple(np.round(tip * scale_to).astype(int).tolist()), value,
                                max(1, thickness >> shift), tipLength=0.4)
        x, y = int(points[0][0]) & ~1, int(points[0][1])
        draw_label(planes, label, min(x, max(0, width - 8)), max(y, 12), colour, scale)


class AnnotateStage(Stage[BatchDetections, BatchDetections]):
    """Draws every frame's detections onto its own image (in place), and the zones and lines
    of the sources with analytics, and passes the batch on.

    Args:
        name: stage name.
        class_names: names indexed by class id (printed in the labels), or None to print ids.
        regions: source name -> its zones and lines, for the sources with analytics.
    """

    def __init__(self, name: str, class_names: list[str] | None,
                 regions: dict[str, list[Region]] | None = None) -> None:
        super().__init__(name)
        self.class_names = class_names
        self.regions = regions or {}
        self._counts = {source: AnalyticsCounts(found, class_names)
                        for source, found in self.regions.items()}

    def add_source(self, source: str, regions: list[Region]) -> None:
        """Draw the zones and lines of one more source (added while the pipeline runs; any
        thread)."""
        self._counts = {**self._counts, source: AnalyticsCounts(regions, self.class_names)}
        self.regions = {**self.regions, source: regions}

    def process(self, item: BatchDetections) -> Iterable[BatchDetections]:
        """Draw frame ``row``'s zones and lines (with the counts after that frame's events),
        then its detections (``item[row]``), on ``item.frames.images[row]`` ((height * 3 //
        2, width) uint8 I420 host array, modified in place); frames without an image (None:
        decoded on the GPU) are skipped. Returns ``(item,)``, the same batch."""
        if not len(item.xyxy) and not self.regions:
            return (item,)
        frames = item.frames
        events: dict[tuple[str, int], list[AnalyticsEvent]] = defaultdict(list)
        for event in item.events:
            events[event.source, event.frame].append(event)
        counts = item.counts.tolist()
        widths, heights = frames.width.tolist(), frames.height.tolist()
        for row, (image, index) in enumerate(zip(frames.images, frames.index.tolist())):
            source = frames.source_name(row)
            regions = self.regions.get(source)
            if regions:
                for event in events.get((source, index), ()):
                    self._counts[source].apply(event)
                if image is not None:
                    draw_regions(image, widths[row], heights[row], regions, self._counts[source])
            if image is not None and counts[row]:
                draw_detections(image, widths[row], heights[row], item[row], self.class_names)
        return (item,)
