"""End-to-end fixtures: real RTSP servers on loopback and the pipeline run as users run it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import RtspServer, require_rtsp_server


@pytest.fixture()
def rtsp_server() -> Iterator[Callable[[dict[str, str]], RtspServer]]:
    """Start GStreamer RTSP servers: ``rtsp_server({"cam": "live"})`` returns a started one
    (``.kill()`` and ``.start()`` it again on the same port); all are killed at teardown.
    Skips when the GStreamer packages are missing (.ci/install-system-packages.sh), fails
    in CI."""
    require_rtsp_server()
    servers: list[RtspServer] = []

    def start(mounts: dict[str, str]) -> RtspServer:
        server = RtspServer(mounts)
        servers.append(server)
        server.start()
        return server

    yield start
    for server in servers:
        server.kill()


def pipeline_config(samples, out: Path, sources: list[dict[str, Any]], **sections: Any) -> dict:
    """A CPU configuration for ``sources`` writing into ``out`` (sections override keys)."""
    config: dict[str, Any] = {
        "sources": sources,
        "model": {"path": str(samples.model), "class_names": str(samples.names)},
        "inference": {"backend": "onnxruntime", "device": "cpu", "batch_size": 2},
        "output": {"dir": str(out), "video": None, "jsonl": "{source}.jsonl"},
        "runtime": {"log_format": "json", "progress": False, "queue_size": 4},
    }
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values} if isinstance(values, dict) \
            else values
    return config


class Run:
    """``python run.py --config ...`` as a subprocess, its stderr (JSON log) in a file;
    ``new_session``: in a process group of its own (to signal the whole group);
    ``extra_args``: more command-line arguments (``--ray local``)."""

    def __init__(self, repo_root: Path, config: dict, out: Path, new_session: bool = False,
                 extra_args: list[str] | None = None) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.config_path = out / "config.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = out / "stderr.log"
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "run.py", "--config", str(self.config_path), "--no-progress",
             *(extra_args or [])],
            cwd=repo_root, stdout=subprocess.DEVNULL, stderr=self._log, text=True,
            start_new_session=new_session)

    def signal(self, signum: int = signal.SIGINT) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout_s: float = 60.0) -> int:
        try:
            return self.process.wait(timeout_s)
        finally:
            self._log.close()

    def stderr(self) -> str:
        return self.log_path.read_text()

    def events(self, name: str) -> list[dict]:
        """The JSON log events called ``name`` (lines that are not ours, Ray's, are skipped)."""
        return [e for e in map(json.loads, (line for line in self.stderr().splitlines()
                                            if line.startswith("{")))
                if e.get("event") == name]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture()
def run_pipeline(repo_root: Path) -> Iterator[Callable[[dict, Path], Run]]:
    """Start the pipeline on a config; any run still going at teardown is killed."""
    runs: list[Run] = []

    def start(config: dict, out: Path, new_session: bool = False,
              extra_args: list[str] | None = None) -> Run:
        runs.append(Run(repo_root, config, out, new_session, extra_args))
        return runs[-1]

    yield start
    for run in runs:
        run.kill()


def records(path: Path) -> list[dict]:
    """The JSON Lines of ``path`` (complete lines only: the file may still be written)."""
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


# x264 (preset veryfast) holds this many frames before the first packet comes out: its
# lookahead (10) and one more. A killed run's MP4 lacks them, as well as its open fragment.
X264_DELAY_FRAMES = 11


def check_killed_recording(video: Path, jsonl: Path, rate: float, batch_size: int) -> int:
    """After ``kill -9``: the ``.partial`` MP4 ``video`` decodes, to at least the frames
    written minus one fragment (``FRAGMENT_S`` x ``rate`` frames), the encoder's delay and
    the part being written, and ``jsonl`` has a record for each decoded frame (video frame k
    is the k-th record: a part's records are written before its video). Returns the
    number of decoded frames."""
    import av

    from stages.sinks import FRAGMENT_S

    written = records(jsonl)
    with av.open(str(video)) as container:
        decoded = [frame.time for frame in container.decode(video=0)]
    fragment = round(FRAGMENT_S * rate)
    print(f"\nkilled: {len(written)} records, {len(decoded)} frames decode from "
          f"{video.name} ({fragment} frames per fragment)")
    assert len(decoded) <= len(written), (len(decoded), len(written))
    assert len(decoded) >= len(written) - fragment - X264_DELAY_FRAMES - batch_size, \
        (len(decoded), len(written))
    frames = [r["frame"] for r in written]
    assert frames == sorted(set(frames))  # one record per frame, in order
    # Video frame k is record k, at its frame number's time (a live source's drops leave
    # gaps); times start at x264's B-frame delay, not 0.
    assert [round((t - decoded[0]) * rate, 3) for t in decoded] == \
        [f - frames[0] for f in frames[:len(decoded)]]
    return len(decoded)
