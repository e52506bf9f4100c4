"""What a run killed whole leaves behind, named so that the next run can tell and remove it.

A run's processes clean up as they end (the shared frame rings are unlinked, the engine's
socket folder removed), and a process killed alone is cleaned up after by the others
(Python's resource tracker, the supervisor). A run killed as a whole (``kill -9`` of its
process group: a container stopped, ``timeout -s KILL``) leaves its shared memory in
``/dev/shm`` (hundreds of MB at many cameras) and its engine's socket folder. Each carries its
creator's pid in its name (``pipeline.slots.shared_name``, ``temp_folder``); ``sweep``
removes those whose creator is no longer alive, at the start of every run.

    /dev/shm/streamdet_<pid>_<random>          SlotRing(shared=True)
    <tmp>/streamdet-engine-<pid>-<random>/     the engine's socket (EngineProcess)
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import structlog

log = structlog.get_logger("leftovers")

SHM_FOLDER = Path("/dev/shm")
SHARED_NAME = re.compile(r"streamdet_(\d+)_[0-9a-f]+")  # pipeline.slots.shared_name
TEMP_FOLDER = re.compile(r"streamdet-engine-(\d+)-.+")


def temp_folder(kind: str) -> Path:
    """A new folder under the temporary folder for this process's ``kind`` (``engine``)."""
    return Path(tempfile.mkdtemp(prefix=f"streamdet-{kind}-{os.getpid()}-"))


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts: it cannot be signalled)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(shm_folder: Path = SHM_FOLDER, temp: Path | None = None) -> list[Path]:
    """Remove the shared memory blocks and folders (module docstring) whose creator is gone;
    returns what was removed (logged once)."""
    found = [(path, SHARED_NAME) for path in _entries(shm_folder)] + [
        (path, TEMP_FOLDER) for path in _entries(temp or Path(tempfile.gettempdir()))]
    removed = []
    for path, pattern in found:
        matched = pattern.fullmatch(path.name)
        if matched is None or alive(int(matched.group(1))):
            continue
        try:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError:  # another run's sweep took it first, or not ours to remove
            continue
        removed.append(path)
    if removed:
        log.info("removed what a killed run left", paths=[str(p) for p in removed])
    return removed


def _entries(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:  # no /dev/shm (not Linux)
        return []
