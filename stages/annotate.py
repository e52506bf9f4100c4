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

from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from typing import Any

import cv2
import numpy as np

from pipeline.records import AnalyticsEvent, BatchDetections, Detections, EndOfStream
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


Rect = tuple[int, int, int, int]  # x1, y1, x2, y2: pixels, both corners included
LABEL_GAP = 2  # px kept between a box label and a zone or line label (chroma is 2x2 pixels)


def label_size(label: str, scale: float) -> tuple[int, int]:
    """The (width, height) in pixels of ``label``'s filled box (``draw_label``)."""
    (text_w, text_h), baseline = cv2.getTextSize(label, FONT, scale, 1)
    return text_w + 2, text_h + baseline + 2


def label_at(size: tuple[int, int], x: int, top: int, width: int, height: int) -> Rect:
    """The rectangle of a label of ``size`` with its top-left corner at (x, top), moved to lie
    wholly in the ``width`` x ``height`` frame (as far as it fits)."""
    w, h = size
    x = min(max(0, x), max(0, width - 1 - w))
    top = min(max(0, top), max(0, height - 1 - h))
    return x, top, x + w, top + h


def overlaps(a: Rect, b: Rect, gap: int = LABEL_GAP) -> bool:
    """Whether rectangles ``a`` and ``b`` come closer than ``gap`` pixels."""
    return a[0] <= b[2] + gap and b[0] <= a[2] + gap and a[1] <= b[3] + gap and b[1] <= a[3] + gap


def place_label(size: tuple[int, int], box: Rect, width: int, height: int,
                keep_clear: Sequence[Rect], others: Sequence[Rect] = ()) -> Rect | None:
    """Where a box's label goes: the first of these places (each moved into the frame) that
    covers none of ``keep_clear`` (zone and line labels) and, if one can, none of ``others``
    (labels placed before): above the box's top-left corner (the usual place), inside its
    top-left corner, below it, above and below its right end; else the place nearest above
    the box in its column that is clear of ``keep_clear``. None when no place is clear (the
    label is left out: it never covers a zone or line label).

    Args:
        size: the label's (width, height) (``label_size``).
        box: the detection's box, frame pixels.
        keep_clear, others: rectangles already drawn.
    """
    w, h = size
    x1, y1, x2, y2 = box
    candidates = [label_at(size, x, top, width, height)
                  for x, top in ((x1, y1 - h), (x1, y1), (x1, y2), (x2 - w, y1 - h), (x2 - w, y2))]
    for blocked in ([*keep_clear, *others], keep_clear):
        for rect in candidates:
            if not any(overlaps(rect, other) for other in blocked):
                return rect
    step = max(2, h // 2)
    tops = sorted(range(0, max(1, height - h), step), key=lambda top: abs(top - (y1 - h)))
    for top in tops:
        rect = label_at(size, x1, top, width, height)
        if not any(overlaps(rect, other) for other in keep_clear):
            return rect
    return None


def draw_label(planes: tuple[np.ndarray, ...], label: str, rect: Rect,
               colour: tuple[int, int, int], scale: float) -> None:
    """Write ``label`` on a filled box of ``colour`` (Y, U, V) at ``rect`` (``label_at``:
    the size ``label_size`` gives), in place."""
    y_plane, u_plane, v_plane = planes
    x, top, right, bottom = rect
    cv2.rectangle(y_plane, (x, top), (right, bottom), colour[0], -1)
    for plane, value in ((u_plane, colour[1]), (v_plane, colour[2])):
        cv2.rectangle(plane, (x // 2, top // 2), (right // 2, bottom // 2), value, -1)
    (_, text_h), _ = cv2.getTextSize(label, FONT, scale, 1)
    text_luma = 16 if colour[0] > 120 else 235
    cv2.putText(y_plane, label, (x + 1, top + text_h + 1), FONT, scale, text_luma, 1,
                cv2.LINE_AA)


def draw_detections(image: np.ndarray, width: int, height: int, detections: Detections,
                    class_names: list[str] | None = None,
                    keep_clear: Sequence[Rect] = ()) -> list[Rect]:
    """Draw boxes and labels (class, score and ``#track`` when tracked) in place, each label
    where it covers no rectangle of ``keep_clear`` (``place_label``).

    Args:
        image: (height * 3 // 2, width) uint8 I420 host array, C-contiguous; modified.
        detections: host arrays in frame pixel coordinates.
        class_names: names indexed by class id, or None to print ids.
        keep_clear: rectangles (frame pixels) no label may cover: the zone and line labels.

    Returns:
        The rectangles of the labels drawn, in detection order.
    """
    planes = i420_planes(image, width, height)
    y_plane, u_plane, v_plane = planes
    thickness, scale = _sizes(width, height)
    keep_clear = list(keep_clear)
    placed: list[Rect] = []
    track_ids = ([-1] * len(detections) if detections.tracker_id is None
                 else detections.tracker_id.tolist())
    boxes = [tuple(int(round(float(c))) for c in box) for box in detections.xyxy]
    for (x1, y1, x2, y2), cls in zip(boxes, detections.class_id.tolist()):
        colour = class_colour_yuv(int(cls))  # every box first: no box line crosses a label
        cv2.rectangle(y_plane, (x1, y1), (x2, y2), colour[0], thickness)
        for plane, value in ((u_plane, colour[1]), (v_plane, colour[2])):
            cv2.rectangle(plane, (x1 // 2, y1 // 2), (x2 // 2, y2 // 2), value, thickness // 2)
    for (x1, y1, x2, y2), score, cls, track_id in zip(boxes, detections.confidence.tolist(),
                                                      detections.class_id.tolist(), track_ids):
        colour = class_colour_yuv(int(cls))
        name = class_names[cls] if class_names and 0 <= cls < len(class_names) else str(int(cls))
        label = f"{name} {float(score):.2f}" + (f" #{track_id}" if track_id >= 0 else "")
        rect = place_label(label_size(label, scale), (x1, y1, x2, y2), width, height,
                           keep_clear, placed)
        if rect is not None:
            draw_label(planes, label, rect, colour, scale)
            placed.append(rect)
    return placed


def count_text(total: dict[str, int]) -> str:
    """A count by class as one number (the classes summed)."""
    return str(sum(total.values()))


def region_text(region: Region, counts: dict[str, Any]) -> str:
    """A zone's or line's label, saying what its numbers are: ``kerb: 3 inside, 19 in / 16
    out`` (objects inside now, entries and exits so far), ``middle: 2 in / 5 out``
    (crossings each way); ``counts`` is ``AnalyticsCounts.to_json()``."""
    if region.type == "zone":
        zone = counts["zones"][region.name]
        return (f"{region.name}: {count_text(zone['inside'])} inside, "
                f"{count_text(zone['entered'])} in / {count_text(zone['exited'])} out")
    line = counts["lines"][region.name]
    return f"{region.name}: {count_text(line['in'])} in / {count_text(line['out'])} out"


def region_labels(regions: list[Region], counts: AnalyticsCounts, width: int, height: int
                  ) -> list[tuple[str, Rect, tuple[int, int, int]]]:
    """The labels of the zones and lines drawn on a ``width`` x ``height`` frame: (text,
    rectangle, colour (Y, U, V)) each, above the region's first point (a line's start, a
    zone's first corner), moved into the frame and down below an earlier region's label it
    would cover; a region with a point outside the frame has none."""
    _, scale = _sizes(width, height)
    now = counts.to_json()
    labels: list[tuple[str, Rect, tuple[int, int, int]]] = []
    for region in regions:
        if region.frame_error(width, height) is not None:
            continue
        text = region_text(region, now)
        size = label_size(text, scale)
        x, y = (int(round(v)) for v in region.points[0])
        rect = label_at(size, x & ~1, y - size[1], width, height)
        for _ in range(len(labels)):
            clash = [r for _, r, _ in labels if overlaps(rect, r)]
            if not clash:
                break
            rect = label_at(size, rect[0], max(r[3] for r in clash) + LABEL_GAP + 1, width,
                            height)
        colour = yuv_of_bgr(ZONE_BGR if region.type == "zone" else LINE_BGR)
        labels.append((text, rect, colour))
    return labels


def draw_regions(image: np.ndarray, width: int, height: int, regions: list[Region],
                 counts: AnalyticsCounts | None = None,
                 labels: list[tuple[str, Rect, tuple[int, int, int]]] | None = None) -> None:
    """Draw zones (outline) and lines (with an arrow to the side that counts as in) in place,
    and their labels (``region_labels``; given, or made from ``counts``); a region with a
    point outside the frame is not drawn (the analytics stage left it out).

    Args:
        image: (height * 3 // 2, width) uint8 I420 host array, C-contiguous; modified.
        regions: the source's zones and lines.
        counts: the source's counts as of this frame (for the labels when none are given).
        labels: the labels to draw, or None to make them from ``counts``; [] for none.
    """
    planes = i420_planes(image, width, height)
    thickness, scale = _sizes(width, height)
    for region in regions:
        if region.frame_error(width, height) is not None:
            continue
        colour = yuv_of_bgr(ZONE_BGR if region.type == "zone" else LINE_BGR)
        points = np.round(region.points).astype(np.int32)
        if region.type == "zone":
            for plane, value, shift in zip(planes, colour, (0, 1, 1)):
                cv2.polylines(plane, [points >> shift], True, value, max(1, thickness >> shift))
            continue
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
    if labels is None:
        labels = region_labels(regions, counts, width, height) if counts is not None else []
    for text, rect, colour in labels:
        draw_label(planes, text, rect, colour, scale)


def draw_trail(image: np.ndarray, width: int, height: int, points: np.ndarray,
               ages: np.ndarray, length: int, colour: tuple[int, int, int]) -> None:
    """Draw one track's trail in place: a line through its last centres, each segment
    blended over the picture with an opacity that fades from 1 (now) to 0 (``length``
    frames ago); only the rectangle around the trail is touched.

    Args:
        image: (height * 3 // 2, width) uint8 I420 host array, C-contiguous; modified.
        points: (k, 2) float host array, the centres, oldest first, frame pixels.
        ages: (k,) int host array, frames since each centre (0: this frame).
        length: the trail's length in frames (``output.trails``).
        colour: (Y, U, V).
    """
    if len(points) < 2:
        return
    thickness, _ = _sizes(width, height)
    pixels = np.round(points).astype(np.int32)
    pad = thickness + 2
    x0, y0 = (max(0, (int(v) - pad) & ~1) for v in pixels.min(axis=0))
    x1 = min(width, (int(pixels[:, 0].max()) + pad + 2) & ~1)
    y1 = min(height, (int(pixels[:, 1].max()) + pad + 2) & ~1)
    if x1 <= x0 or y1 <= y0:
        return
    mask = np.zeros((y1 - y0, x1 - x0), np.uint8)
    local = pixels - [x0, y0]
    opacity = np.clip(1.0 - ages[:-1] / float(length), 0.0, 1.0)
    for k in range(len(local) - 1):  # newer segments drawn last, over older ones
        cv2.line(mask, tuple(local[k].tolist()), tuple(local[k + 1].tolist()),
                 int(round(255 * opacity[k])), thickness)
    chroma_mask = mask.reshape(mask.shape[0] // 2, 2, mask.shape[1] // 2, 2).max(axis=(1, 3))
    for plane, value, m, (a, b, c, d) in zip(
            i420_planes(image, width, height), colour, (mask, chroma_mask, chroma_mask),
            ((y0, y1, x0, x1), (y0 // 2, y1 // 2, x0 // 2, x1 // 2),
             (y0 // 2, y1 // 2, x0 // 2, x1 // 2))):
        roi = plane[a:b, c:d]
        weight = m.astype(np.uint16)
        roi[:] = ((roi * (255 - weight) + value * weight + 127) // 255).astype(np.uint8)


class AnnotateStage(Stage[BatchDetections, BatchDetections]):
    """Draws every frame's detections onto its own image (in place), the zones and lines of
    the sources with analytics, and the tracks' trails, and passes the batch on.

    On a frame, in this order: the zones' and lines' outlines, the trails, the boxes with
    their labels (each placed where it covers no zone or line label), the zone and line
    labels.

    Args:
        name: stage name.
        class_names: names indexed by class id (printed in the labels), or None to print ids.
        regions: source name -> its zones and lines, for the sources with analytics.
        trails: the trail of each track shown on a frame: the centres of its boxes on the
            source's last ``trails`` frames, fading; 0 for none (``output.trails``).
    """

    def __init__(self, name: str, class_names: list[str] | None,
                 regions: dict[str, list[Region]] | None = None, trails: int = 0) -> None:
        super().__init__(name)
        self.class_names = class_names
        self.regions = regions or {}
        self.trails = trails
        self._counts = {source: AnalyticsCounts(found, class_names)
                        for source, found in self.regions.items()}
        # source -> track id -> (frame index, centre x, centre y) of its latest boxes
        self._trails: dict[str, dict[int, deque[tuple[int, float, float]]]] = defaultdict(dict)

    def add_source(self, source: str, regions: list[Region]) -> None:
        """Draw the zones and lines of one more source (added while the pipeline runs; any
        thread)."""
        self._counts = {**self._counts, source: AnalyticsCounts(regions, self.class_names)}
        self.regions = {**self.regions, source: regions}

    def _trail_points(self, source: str, index: int, detections: Detections
                      ) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Add frame ``index``'s centres to its source's trails; return the trails of the
        tracks on it: (class id, centres (k, 2) oldest first, their ages in frames (k,))."""
        trails = self._trails[source]
        oldest = index - self.trails + 1
        shown = []
        if detections.tracker_id is not None:
            for box, cls, track_id in zip(detections.xyxy.tolist(), detections.class_id.tolist(),
                                          detections.tracker_id.tolist()):
                if track_id < 0:
                    continue
                trail = trails.get(track_id)
                if trail is None:
                    trail = trails[track_id] = deque(maxlen=self.trails)
                trail.append((index, (box[0] + box[2]) / 2, (box[1] + box[3]) / 2))
                while trail[0][0] < oldest:
                    trail.popleft()
                points = np.array(trail, np.float64)
                shown.append((cls, points[:, 1:], index - points[:, 0]))
        for track_id in [t for t, trail in trails.items() if trail[-1][0] < oldest]:
            del trails[track_id]
        return shown

    def process(self, item: BatchDetections) -> Iterable[BatchDetections]:
        """Draw frame ``row``'s zones and lines (with the counts after that frame's events),
        trails and detections (``item[row]``) on ``item.frames.images[row]`` ((height * 3 //
        2, width) uint8 I420 host array, modified in place); frames without an image (None:
        decoded on the GPU) are skipped (their centres still join the trails). Returns
        ``(item,)``, the same batch."""
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
            width, height = widths[row], heights[row]
            regions = self.regions.get(source)
            labels: list[tuple[str, Rect, tuple[int, int, int]]] = []
            if regions:
                for event in events.get((source, index), ()):
                    self._counts[source].apply(event)
                if image is not None:
                    labels = region_labels(regions, self._counts[source], width, height)
                    draw_regions(image, width, height, regions, labels=[])
            trails = (self._trail_points(source, index, item[row])
                      if self.trails and counts[row] else [])
            if image is None:
                continue
            for cls, points, ages in trails:
                draw_trail(image, width, height, points, ages, self.trails,
                           class_colour_yuv(int(cls)))
            if counts[row]:
                draw_detections(image, width, height, item[row], self.class_names,
                                [rect for _, rect, _ in labels])
            if labels:
                draw_regions(image, width, height, [], labels=labels)
        return (item,)

    def end_of_stream(self, eos: EndOfStream) -> Iterable[EndOfStream]:
        self._trails.pop(eos.source, None)  # a source that ended sends no more frames
        return (eos,)
