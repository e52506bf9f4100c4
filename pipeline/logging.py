"""Structured logging with structlog: readable console lines or one JSON object per line."""

from __future__ import annotations

import logging
import os
import sys

import structlog


class _Stderr:
    """``sys.stderr`` as it is at each write: a logger configured while something had
    swapped it (pytest's capture, a tool) keeps writing after it is swapped back.

    A reader that went away (``run.py ... 2>&1 | head -3``) makes every write fail with
    ``BrokenPipeError``; a log call in a stage's thread then ended that thread and the run
    hung. From the first such failure on, this process's log lines go nowhere
    (``silence_stderr``) and the run goes on to its end, its outputs written."""

    def write(self, text: str) -> int:
        try:
            return sys.stderr.write(text)
        except BrokenPipeError:
            silence_stderr()
            return len(text)

    def flush(self) -> None:
        try:
            sys.stderr.flush()
        except BrokenPipeError:
            silence_stderr()


def silence_stderr() -> None:
    """Send this process's stderr (Python's, and file descriptor 2: FFmpeg's messages) to
    the null device, for good."""
    null = open(os.devnull, "w")  # noqa: SIM115 - the process's stderr from now on
    try:
        os.dup2(null.fileno(), 2)
    except OSError:
        pass
    sys.stderr = null


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
        # one write per line (the message and its newline together): print() writes them
        # apart, and unbuffered (PYTHONUNBUFFERED), the processes sharing a stderr pipe (the
        # supervisor, the engine, the workers) ran their lines together
        logger_factory=structlog.WriteLoggerFactory(_Stderr()),
        cache_logger_on_first_use=False,
    )


def register_stack_dump() -> None:
    """On SIGUSR1, write every thread's stack (``faulthandler``): to stderr, or to
    ``$STREAMDET_STACKS_DIR/stack-PID.txt`` when that is set (one file per process, so the
    dumps of several processes do not interleave). For a run that hangs: ``pkill -USR1
    streamdet``."""
    import faulthandler
    import os
    import signal

    folder = os.environ.get("STREAMDET_STACKS_DIR")
    out = open(os.path.join(folder, f"stack-{os.getpid()}.txt"), "w") if folder else None  # noqa: SIM115 - open for the process's life
    faulthandler.register(signal.SIGUSR1, file=out or sys.stderr, all_threads=True)
