"""A progress bar over the frames of the file sources (tqdm, on a terminal only)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

if TYPE_CHECKING:
    from pipeline.stage import SourceStage


class Progress:
    """Counts frames that reached their sinks; shows a bar when stderr is a terminal."""

    def __init__(self, enabled: bool) -> None:
        self._bar = tqdm(total=None, unit="frame", file=sys.stderr, dynamic_ncols=True,
                         disable=None if enabled else True)

    def set_total(self, sources: list[SourceStage]) -> None:
        """Total = frames announced by the file sources (unknown when any is live)."""
        counts = [s.expected_frames for s in sources]
        if all(c is not None for c in counts) and not any(s.live for s in sources):
            self._bar.reset(total=sum(counts))  # type: ignore[arg-type]

    def frames_done(self, count: int) -> None:
        """Count ``count`` frames that reached their sinks: one call (one update) per batch slice."""
        if count:
            self._bar.update(count)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._bar.close()
