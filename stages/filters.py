"""Per-source detection filters: the classes to keep and a region of interest.

Runs on the host after the postprocess stage (both paths), once per batch: each source's
detections are kept when their class is one of the source's ``classes`` and their anchor
point, the bottom centre of the box (where an object stands: supervision's default zone
anchor), lies inside or on the edge of its ``roi`` polygon (OpenCV's ``pointPolygonTest``).
Frames are never dropped, only detections.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import cv2
import numpy as np

from pipeline.config import ConfigError, SourceConfig
from pipeline.records import BatchDetections
from pipeline.stage import Stage


@dataclass(frozen=True)
class SourceFilter:
    """One source's filters.

    Attributes:
        class_ids: the class ids to keep, or None for all.
        roi: (k, 1, 2) float32 host array, the polygon in frame pixels (OpenCV's contour
            layout), or None for the whole frame.
    """

    class_ids: frozenset[int] | None
    roi: np.ndarray | None

    @classmethod
    def from_config(cls, key: str, source: SourceConfig, class_names: list[str] | None,
                    num_classes: int) -> SourceFilter | None:
        """The filter a source's configuration asks for, or None when it asks for none.

        Raises:
            ConfigError: a class that the model does not have (``key``: ``sources[i]``).
        """
        if source.classes is None and source.roi is None:
            return None
        ids = None
        if source.classes is not None:
            ids = set()
            for value in source.classes:
                if isinstance(value, int) and (0 <= value < num_classes or not num_classes):
                    ids.add(value)
                elif isinstance(value, str) and class_names and value in class_names:
                    ids.add(class_names.index(value))
                else:
                    names = class_names or []
                    known = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
                    raise ConfigError(f"{key}.classes: the model has no class {value!r} (its "
                                      f"classes: {known or f'ids 0-{num_classes - 1}'})")
            ids = frozenset(ids)
        roi = None if source.roi is None else np.asarray(source.roi, np.float32).reshape(-1, 1, 2)
        return cls(ids, roi)

    def mask(self, detections: BatchDetections, rows: np.ndarray) -> np.ndarray:
        """(len(rows),) bool: which of the detections at ``rows`` pass."""
        keep = np.ones(len(rows), bool)
        if self.class_ids is not None:
            keep &= np.isin(detections.class_id[rows], list(self.class_ids))
        if self.roi is not None:
            boxes = detections.xyxy[rows]
            anchors = np.stack([(boxes[:, 0] + boxes[:, 2]) / 2, boxes[:, 3]], axis=1)
            keep &= np.array([cv2.pointPolygonTest(self.roi, (float(x), float(y)), False) >= 0
                              for x, y in anchors], bool).reshape(len(rows))
        return keep


class DetectionFilterStage(Stage[BatchDetections, BatchDetections]):
    """``BatchDetections`` in, the same batch with the filtered-out detections removed.

    Args:
        name: stage name.
        filters: source id (position in the configuration) -> its ``SourceFilter``; sources
            without one keep every detection.
    """

    def __init__(self, name: str, filters: dict[int, SourceFilter]) -> None:
        super().__init__(name)
        self.filters = filters

    def add_source(self, source_id: int, source_filter: SourceFilter) -> None:
        """Filter one more source (added while the pipeline runs; any thread)."""
        self.filters = {**self.filters, source_id: source_filter}

    def process(self, item: BatchDetections) -> Iterable[BatchDetections]:
        source_of_row = np.repeat(item.frames.source, item.counts)
        keep = np.ones(len(source_of_row), bool)
        for source_id, source_filter in self.filters.items():
            rows = np.flatnonzero(source_of_row == source_id)
            if len(rows):
                keep[rows] = source_filter.mask(item, rows)
        return (item if keep.all() else item.keep(keep),)
