"""Structured logging with structlog: readable console lines or one JSON object per line."""

from __future__ import annotations

import logging
import sys

import structlog


class _Stderr:
    """``sys.stderr`` as it is at each write: a logger configured while something had
    swapped it (pytest's capture, a tool) keeps writing after it is swapped back."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(fmt: str = "console", level: str = "info") -> None:
    """Send structlog output to stderr as console text (``console``) or JSON (``json``)."""
    renderer = (structlog.processors.JSONRenderer() if fmt == "json"
                else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=False),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(_Stderr()),
        cache_logger_on_first_use=False,
    )
