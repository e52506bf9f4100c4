"""Test helpers with real parts: a GStreamer RTSP server process and small generated clips."""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import tempfile
import threading
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from tests.support.browser import chromium_missing, headless_page, require_chromium  # noqa: F401
from tests.support.ci import skip_unless_ci
from tests.support.mosquitto import MosquittoBroker, require_mosquitto  # noqa: F401

SERVER_SCRIPT = Path(__file__).with_name("rtsp_server.py")
SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's, where the gi GStreamer bindings live
GST_CHECK = """
import gi
gi.require_version("Gst", "1.0"); gi.require_version("GstRtspServer", "1.0")
from gi.repository import Gst, GstRtspServer
Gst.init(None)
missing = [e for e in ("x264enc", "rtph264pay", "qtdemux", "h264parse", "videotestsrc", "valve")
           if Gst.ElementFactory.find(e) is None]
assert not missing, "missing GStreamer elements: " + ", ".join(missing)
"""


@functools.cache
def rtsp_server_missing() -> str | None:
    """Why the GStreamer RTSP server cannot run here (to skip with), or None when it can."""
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        return f"{SYSTEM_PYTHON} not found (the RTSP server runs on Debian's python3)"
    result = subprocess.run([SYSTEM_PYTHON, "-c", GST_CHECK], capture_output=True, text=True,
                            timeout=60)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["?"])[-1]
        return (f"GStreamer RTSP server unavailable ({last}); install it with "
                ".ci/install-system-packages.sh")
    return None


def require_rtsp_server() -> None:
    """Skip the calling test when the GStreamer RTSP server cannot run here (fail in CI:
    ``skip_unless_ci``)."""
    if (reason := rtsp_server_missing()) is not None:
        skip_unless_ci(reason, "live-camera")


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RtspServer:
    """tests/support/rtsp_server.py as a subprocess on a loopback port; can be killed and
    started again on the same port (a camera that drops and comes back).

    Args:
        mounts: mount name -> spec (``live``, ``stall:SECONDS`` or an MP4 path).
        port: the port, or None for a free one.
    """

    def __init__(self, mounts: dict[str, str], port: int | None = None) -> None:
        self.mounts = mounts
        self.port = port or free_port()
        self.process: subprocess.Popen[str] | None = None

    def url(self, mount: str, credentials: str = "") -> str:
        """The rtsp:// URL of ``mount`` (``credentials`` like ``user:pw@`` are accepted and
        ignored by the server)."""
        return f"rtsp://{credentials}127.0.0.1:{self.port}/{mount}"

    def start(self, timeout_s: float = 20.0) -> None:
        """Start the server and return once it listens."""
        args = [SYSTEM_PYTHON, str(SERVER_SCRIPT), str(self.port),
                *(f"{name}={spec}" for name, spec in self.mounts.items())]
        errors = tempfile.TemporaryFile("w+")  # a pipe nobody reads could fill and block it
        self.process = process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=errors,
                                                  text=True)
        first: list[str] = []
        reader = threading.Thread(target=lambda: first.append(process.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not first or first[0].strip() != "ready":
            self.kill()
            errors.seek(0)
            raise RuntimeError(f"RTSP server did not start: {errors.read()[-2000:]}")

    def kill(self) -> None:
        """Kill the server at once (SIGKILL: connections drop as in a crash or power cut)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def __enter__(self) -> RtspServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def read_frames(path: Path, limit: int | None = None) -> list[av.VideoFrame]:
    """The decoded frames of the first video stream of ``path`` (at most ``limit``)."""
    frames = []
    with av.open(str(path)) as container:
        for frame in container.decode(video=0):
            frames.append(frame)
            if limit is not None and len(frames) == limit:
                break
    return frames


def add_video(container: av.container.OutputContainer, size: tuple[int, int],
              rate: int = 25, gop: int | None = None) -> av.video.stream.VideoStream:
    """An H.264 yuv420p stream of ``size`` (width, height) in ``container``; with ``gop``, a
    keyframe every ``gop`` frames exactly (else x264's choice: the first, and scene cuts)."""
    stream = container.add_stream("libx264", rate=rate)
    stream.width, stream.height = size
    stream.pix_fmt = "yuv420p"
    stream.options = {"preset": "ultrafast"}
    if gop is not None:
        stream.options["x264-params"] = f"keyint={gop}:min-keyint={gop}:scenecut=0"
    return stream


def encode_pictures(container: av.container.OutputContainer, stream: av.video.stream.VideoStream,
                    pictures: list[av.VideoFrame]) -> None:
    """Scale ``pictures`` to the stream's size, encode and mux them, then flush the stream."""
    for i, picture in enumerate(pictures):
        frame = picture.reformat(width=stream.width, height=stream.height, format="yuv420p")
        frame.pts, frame.time_base = i, Fraction(1, 25)
        container.mux(stream.encode(frame))
    container.mux(stream.encode(None))


def write_clip(path: Path, pictures: list[av.VideoFrame], size: tuple[int, int],
               fmt: str = "mp4", gop: int | None = None) -> Path:
    """Encode ``pictures`` at ``size`` into ``path`` (MP4 with its index first, or mpegts),
    with a keyframe every ``gop`` frames when given (``add_video``)."""
    options = {"movflags": "+faststart"} if fmt == "mp4" else {}
    with av.open(str(path), "w", format=fmt, options=options) as container:
        encode_pictures(container, add_video(container, size, gop=gop), pictures)
    return path


def write_multitrack(path: Path, first: list[av.VideoFrame], second: list[av.VideoFrame],
                     sizes: tuple[tuple[int, int], tuple[int, int]]) -> Path:
    """An MP4 with an audio track first, then two video tracks of different sizes and
    lengths (``first`` at ``sizes[0]``, ``second`` at ``sizes[1]``)."""
    with av.open(str(path), "w", format="mp4") as container:
        audio = container.add_stream("aac", rate=16000)
        audio.layout = "mono"
        videos = [add_video(container, size) for size in sizes]
        silence = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp",
                                             layout="mono")
        silence.sample_rate = 16000
        for i in range(len(first) * 16000 // 25 // 1024):
            silence.pts = i * 1024
            container.mux(audio.encode(silence))
        container.mux(audio.encode(None))
        for stream, pictures in zip(videos, (first, second)):
            encode_pictures(container, stream, pictures)
    return path


def write_size_change(path: Path, first: list[av.VideoFrame], second: list[av.VideoFrame],
                      sizes: tuple[tuple[int, int], tuple[int, int]]) -> Path:
    """One MPEG-TS stream whose picture size changes mid-stream: two separately encoded
    segments (``first`` at ``sizes[0]``, then ``second`` at ``sizes[1]``) back to back, as
    a camera produces after a resolution change."""
    parts = [write_clip(path.with_suffix(f".{i}.ts"), pictures, size, "mpegts")
             for i, (pictures, size) in enumerate(zip((first, second), sizes))]
    path.write_bytes(b"".join(part.read_bytes() for part in parts))
    for part in parts:
        part.unlink()
    return path


def truncate(source: Path, path: Path, keep: float) -> Path:
    """A copy of ``source`` cut to its first ``keep`` fraction of bytes (a copy that died)."""
    data = source.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def damage_packets(source: Path, path: Path, packets: set[int]) -> Path:
    """A copy of ``source``'s first video stream whose packets numbered ``packets`` carry
    0xff bytes instead of their data (undecodable: the decoder rejects them)."""
    with av.open(str(source)) as inp, av.open(str(path), "w", format="mp4") as out:
        stream = out.add_stream_from_template(inp.streams.video[0])
        for number, packet in enumerate(p for p in inp.demux(video=0) if p.dts is not None):
            if number in packets:
                bad = av.Packet(b"\xff" * packet.size)
                bad.pts, bad.dts, bad.time_base = packet.pts, packet.dts, packet.time_base
                packet = bad
            packet.stream = stream
            out.mux(packet)
    return path
