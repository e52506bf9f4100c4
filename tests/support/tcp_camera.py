"""A camera on loopback without GStreamer: an MPEG-TS clip sent over TCP in real time.

    clip.ts ──each video packet's bytes at start + its dts──> tcp://127.0.0.1:PORT ──> FFmpeg

A ``tcp://`` URL is a live source that is not paced: its frames come as the camera sends
them, so a reader that falls behind finds them waiting in the socket, as with RTSP.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import av


class TcpCamera:
    """Serves ``clip`` (MPEG-TS) once, to the first client, in real time, then closes.

    Args:
        clip: an MPEG-TS file with one video stream.

    Attributes:
        url: the ``tcp://`` URL to read it from.
        sent_at: ``time.monotonic()`` when each video packet (frame, in decode order) was
            handed to the socket, by packet number; filled while it sends.
    """

    def __init__(self, clip: Path) -> None:
        self.data = clip.read_bytes()
        with av.open(str(clip)) as container:
            packets = [p for p in container.demux(video=0) if p.size]
            # Where each packet's bytes start, and when it is due (seconds from the first).
            self.packets = [(p.pos, float((p.dts - packets[0].dts) * p.time_base)) for p in packets]
        self.sent_at: list[float] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, name="tcp-camera", daemon=True)

    def _serve(self) -> None:
        with self._listener:
            self._listener.settimeout(10.0)
            connection, _ = self._listener.accept()
        with connection:
            started, done = time.monotonic(), 0
            for number, (_, due) in enumerate(self.packets):
                time.sleep(max(0.0, started + due - time.monotonic()))
                # This packet's bytes and what lies before them, up to the next packet's.
                end = self.packets[number + 1][0] if number + 1 < len(self.packets) else len(self.data)
                try:
                    connection.sendall(self.data[done:end])
                except OSError:
                    return  # the reader went away
                done = end
                self.sent_at.append(time.monotonic())

    def __enter__(self) -> TcpCamera:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join(15.0)
