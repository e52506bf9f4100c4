"""Who holds the interpreter lock: a py-spy sample of this process, summarised by thread.

The pipeline process runs many threads (one per source, one per stage, one per sink). When
none of them is near 100% work and the GPU idles, the limit is usually the interpreter lock
they share: this module names which threads and which functions hold it.

``GilProfile(path, seconds).start()`` runs ``py-spy record --gil --threads`` on this very
process for ``seconds`` (samples only taken while a thread holds the lock), writing py-spy's
raw folded stacks to ``path``; ``summary(path, seconds)`` turns them into one line: how often
the lock was held, the share of those samples held by each group of threads (``source:*`` for
every source thread, ``sink:*``, each stage) and the functions that held it most. Needs the
``py-spy`` executable (PATH, or beside the interpreter); without it ``start`` says why and
nothing is recorded.
"""

from __future__ import annotations

import collections
import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1)
SAMPLES_PER_S = 250
THREAD = re.compile(r"^thread \((?:0x)?[0-9a-fA-F]+\)(?::\s*(?P<name>.*))?$")


def py_spy() -> str | None:
    """The py-spy executable, or None."""
    beside = Path(sys.executable).with_name("py-spy")
    return shutil.which("py-spy") or (str(beside) if beside.exists() else None)


class GilProfile:
    """A py-spy recording of this process (module docstring).

    Args:
        path: where the raw folded stacks go.
        seconds: how long to sample.
    """

    def __init__(self, path: Path, seconds: float) -> None:
        self.path, self.seconds = path, seconds
        self.process: subprocess.Popen | None = None
        self.error: str | None = None

    def start(self) -> GilProfile:
        """Start sampling now (returns at once); ``error`` says why not when it cannot."""
        exe = py_spy()
        if exe is None:
            self.error = "py-spy not found"
            return self
        try:  # Yama (ptrace_scope 1) lets only an allowed process attach to us
            ctypes.CDLL(None).prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0)
        except (OSError, AttributeError):
            pass
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [exe, "record", "--pid", str(os.getpid()), "--gil", "--threads", "--nonblocking",
             "--format", "raw", "--rate", str(SAMPLES_PER_S), "--duration",
             str(max(1, round(self.seconds))), "--output", str(self.path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        return self

    def wait(self) -> str:
        """Wait for the recording to end; returns its summary (or why there is none)."""
        if self.process is None:
            return self.error or "not started"
        try:
            _, stderr = self.process.communicate(timeout=self.seconds + 30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return "py-spy did not finish"
        if self.process.returncode != 0 or not self.path.exists():
            last = (stderr or "").strip().splitlines()
            return f"py-spy failed: {last[-1] if last else self.process.returncode}"
        return summary(self.path, self.seconds)


def thread_group(name: str) -> str:
    """``source:cam012`` -> ``source:*``; ``sink:cam012`` -> ``sink:*``; others unchanged."""
    head, sep, _ = name.partition(":")
    return f"{head}:*" if sep and head in ("source", "sink", "decode") else name


def summary(path: Path, seconds: float, top: int = 6) -> str:
    """One line from py-spy's raw output of ``seconds`` of sampling: how often some thread
    held the GIL, each thread group's share of those samples, then the top functions."""
    groups: collections.Counter[str] = collections.Counter()
    functions: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        match = THREAD.match(frames[0])
        name = (match.group("name") or "unnamed") if match else frames[0]
        groups[thread_group(name.strip())] += int(count)
        if len(frames) > 1:  # the innermost Python function, without its line number
            functions[re.sub(r":\d+\)$", ")", frames[-1])] += int(count)
        total += int(count)
    if not total:
        return "no samples held the interpreter lock"
    by_group = ", ".join(f"{g} {100 * n / total:.0f}%" for g, n in groups.most_common(top))
    by_function = ", ".join(f"{f} {100 * n / total:.0f}%" for f, n in functions.most_common(top))
    held = 100 * total / (SAMPLES_PER_S * seconds)
    return (f"held in {held:.0f}% of {SAMPLES_PER_S * seconds:.0f} samples; threads {by_group}; "
            f"functions {by_function}")
