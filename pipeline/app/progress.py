"""A progress bar over the frames of the file sources (tqdm, on a terminal only)."""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


class Progress:
    """Counts frames that reached their sinks; shows a bar when stderr is a terminal."""

    def __init__(self, enabled: bool) -> None:
        self._bar = tqdm(total=None, unit="frame", file=sys.stderr, dynamic_ncols=True,
                         disable=None if enabled else True)

    def set_total(self, counts: list[int | None]) -> None:
        """Total = frames announced by each source (unknown when one is not: a camera)."""
        if counts and all(c is not None for c in counts):
            self._bar.reset(total=sum(counts))  # type: ignore[arg-type]

    def frames_done(self, count: int) -> None:
        """Count ``count`` frames that reached their sinks: one call (one update) per batch slice."""
        if count:
            self._bar.update(count)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._bar.close()
