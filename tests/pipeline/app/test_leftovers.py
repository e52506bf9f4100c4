"""pipeline.app.leftovers: the shared memory and engine folders a run killed whole left are
removed by the next run's sweep; those of a run still alive are not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pipeline.app.leftovers import SHARED_NAME, sweep, temp_folder
from pipeline.slots import SlotRing, shared_name


def gone_pid() -> int:
    """The pid of a process that has ended."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_shared_ring_is_named_after_its_creator() -> None:
    ring = SlotRing(2, 8, shared=True)
    try:
        matched = SHARED_NAME.fullmatch(ring.shm_name)
        assert matched is not None and int(matched.group(1)) == os.getpid()
        assert Path("/dev/shm", ring.shm_name).exists()
    finally:
        ring.close()


def test_the_sweep_removes_what_dead_creators_left_and_keeps_the_living_ones(tmp_path) -> None:
    shm, temp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    temp.mkdir()
    dead = gone_pid()
    left = [shm / f"streamdet_{dead}_0a1b2c3d", temp / f"streamdet-engine-{dead}-x1y2z3"]
    ours = [shm / shared_name(), temp / f"streamdet-engine-{os.getpid()}-abcdef"]
    others = [shm / "psm_0a1b2c3d", temp / "streamdet-mps-xyz", shm / f"streamdet_{dead}"]
    for path in left + ours + others:
        if path.parent == temp:  # a folder with the engine's socket
            path.mkdir()
            (path / "engine.sock").write_text("")
        else:  # a shared memory block
            path.write_bytes(b"\0" * 16)
    assert sorted(sweep(shm, temp)) == sorted(left)
    assert not any(path.exists() for path in left)
    assert all(path.exists() for path in ours + others)


def test_an_engine_folder_carries_its_creator_s_pid(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    folder = temp_folder("engine")
    assert folder.parent == tmp_path and folder.name.startswith(f"streamdet-engine-{os.getpid()}-")
