"""configure_logging: each log line reaches stderr in one write (message and newline)."""

from __future__ import annotations

import json
import sys

import structlog

from pipeline.logging import configure_logging


class RecordingStderr:
    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def test_a_line_is_one_write_so_processes_sharing_stderr_never_run_lines_together(monkeypatch):
    """Unbuffered stderr (PYTHONUNBUFFERED) turns each write into its own system call: a
    line written in two parts (print: the message, then the newline) was run together with
    another process's line on the H200 (``...}{"host": ...``)."""
    stderr = RecordingStderr()
    monkeypatch.setattr(sys, "stderr", stderr)
    configure_logging("json")  # (tests/conftest.py puts structlog's config back after)
    structlog.get_logger("test").info("engine ready", pid=7)
    (line,) = stderr.writes
    assert line.endswith("\n") and line.count("\n") == 1
    assert json.loads(line)["event"] == "engine ready"
