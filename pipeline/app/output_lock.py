"""A run's hold on the folders it writes in: one run at a time per folder.

Two runs writing into one folder would each take the other's ``.partial`` files, still being
written, for files cut short and resume them: a new user's two terminals left a records file
of 325 lines for 250 frames, one of them torn, and both runs exited 0. So a run (``run.py``,
and the Python API's ``Pipeline``) takes an exclusive ``flock`` on each folder its configured
sources' outputs land in (``output.dir`` and any subfolder its output names use) before it
looks at any ``.partial`` file, and holds it until it ends; the kernel lets it go when the
process dies (``kill -9`` too), and a run's workers inherit it. The lock is on the folder
itself: no file is added to it. A second run wanting one of those folders is refused with
one line naming the first's pid (``/proc/locks``).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from pipeline.config import ConfigError, PipelineConfig, output_files


def output_folders(config: PipelineConfig) -> list[Path]:
    """``output.dir`` first, then every other folder the configured sources' outputs land in
    (each once, in the order first met)."""
    folders = [Path(config.output.dir)]
    seen = {os.path.realpath(folders[0])}
    for _, _, path in output_files(config, Path(".")):
        real = os.path.realpath(path.parent)
        if real not in seen:
            seen.add(real)
            folders.append(path.parent)
    return folders


class OutputLock:
    """The folders a run holds (``lock_outputs``); ``release`` lets them go.

    Attributes:
        made: the folders ``lock_outputs`` created (subfolders of ``output.dir`` its output
            names use), deepest first: a run refused before it begins removes them.
    """

    def __init__(self, descriptors: list[int], made: list[Path]) -> None:
        self._descriptors = descriptors
        self.made = made

    def release(self) -> None:
        """Let every folder go (once)."""
        descriptors, self._descriptors = self._descriptors, []
        for descriptor in descriptors:
            os.close(descriptor)


def missing_folders(folder: Path) -> list[Path]:
    """``folder`` and those of its parents that do not exist yet, the deepest first: what
    making it creates."""
    return [p for p in (folder, *folder.parents) if not p.exists()]


def remove_made(folders: list[Path]) -> None:
    """Remove the folders a refused run made (the deepest first); one holding something
    stays."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            pass


def lock_outputs(config: PipelineConfig) -> OutputLock:
    """Take every folder of ``output_folders`` (made when missing), or none.

    Raises:
        ConfigError: another run holds one of them, or one cannot be made or opened.
    """
    taken: list[int] = []
    made: list[Path] = []
    try:
        for i, folder in enumerate(output_folders(config)):
            missing = missing_folders(folder)
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise ConfigError(f"output: cannot create the folder {str(folder)!r}: "
                                  f"{error.strerror or error}") from None
            made = missing + made
            taken.append(lock_folder(folder, "output.dir" if i == 0 else
                                     "output (a folder this run writes in)"))
    except ConfigError:
        OutputLock(taken, []).release()
        remove_made(made)
        raise
    return OutputLock(taken, made)


def lock_folder(folder: Path, what: str = "output.dir") -> int:
    """An exclusive ``flock`` on ``folder`` itself; returns the descriptor holding it.

    Raises:
        ConfigError: another run holds it (named by its pid when ``/proc/locks`` gives it);
            ``what`` names the folder in the message.
    """
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError as error:
        raise ConfigError(f"{what}: cannot open {str(folder)!r}: {error.strerror or error}"
                          ) from None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(descriptor)
        holder = lock_holder(folder)
        by = "another run" if holder is None else f"another run (pid {holder})"
        raise ConfigError(f"{what}: {str(folder)!r} is in use by {by}: wait for it to end, "
                          "or give this run another output.dir") from None
    return descriptor


def lock_holder(folder: Path, locks: str = "/proc/locks") -> int | None:
    """The pid ``locks`` (Linux's ``/proc/locks``) names as holding a ``flock`` on ``folder``,
    or None (not Linux, or not found)."""
    try:
        stat = folder.stat()
        text = Path(locks).read_text()
    except OSError:
        return None
    device = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    for line in text.splitlines():
        fields = line.split()  # "1: FLOCK ADVISORY WRITE 1234 00:2f:5678 0 EOF"
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == device:
            return int(fields[4]) if fields[4].isdigit() else None
    return None
