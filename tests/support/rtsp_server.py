"""A real RTSP server on loopback for the tests: GStreamer's gst-rtsp-server through ``gi``.

Run it with Debian's ``/usr/bin/python3`` (the packages in .ci/install-system-packages.sh),
not the project's virtualenv:

    /usr/bin/python3 tests/support/rtsp_server.py PORT MOUNT=SPEC [MOUNT=SPEC ...]

SPEC is one of:

- ``live`` or ``live:FPS``: an endless live test pattern (320x240, 25 or FPS frames per
  second, H.264, a key frame every second);
- ``stall:SECONDS``: the same, but each session stops sending video after SECONDS while
  the server stays up and the connection open (a stalled camera);
- a path to an H.264 MP4 file, streamed once in real time (then the stream ends).

Each client gets its own media (nothing shared), so a reconnecting client starts afresh.
Prints ``ready`` on stdout once it listens; runs until killed.
"""

from __future__ import annotations

import sys

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstRtspServer", "1.0")
from gi.repository import GLib, Gst, GstRtspServer  # noqa: E402

LIVE = ("videotestsrc is-live=true pattern=ball"
        " ! video/x-raw,width=320,height=240,framerate={fps}/1 ! valve name=gate drop=false"
        " ! x264enc tune=zerolatency speed-preset=ultrafast key-int-max={fps} bitrate=300"
        " ! rtph264pay name=pay0 pt=96 config-interval=1")
FILE = ("filesrc location={path} ! qtdemux ! h264parse"
        " ! rtph264pay name=pay0 pt=96 config-interval=1")


def launch_line(spec: str) -> str:
    """The factory's launch line for a mount SPEC (see the module docstring)."""
    if spec == "live" or spec.startswith("stall:"):
        return f"( {LIVE.format(fps=25)} )"
    if spec.startswith("live:"):
        return f"( {LIVE.format(fps=int(spec.split(':', 1)[1]))} )"
    return f"( {FILE.format(path=spec)} )"


def stall_later(media: GstRtspServer.RTSPMedia, seconds: float) -> None:
    """Close the media's valve after ``seconds``: no more video, connection kept open."""
    gate = media.get_element().get_by_name("gate")

    def close_gate() -> bool:
        gate.set_property("drop", True)
        return False  # run once

    GLib.timeout_add(int(seconds * 1000), close_gate)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not all("=" in m for m in argv[1:]):
        print(__doc__, file=sys.stderr)
        return 2
    Gst.init(None)
    server = GstRtspServer.RTSPServer()
    server.set_address("127.0.0.1")
    server.set_service(argv[0])
    mounts = server.get_mount_points()
    for mount in argv[1:]:
        name, spec = mount.split("=", 1)
        factory = GstRtspServer.RTSPMediaFactory()
        factory.set_launch(launch_line(spec))
        factory.set_shared(False)
        if spec.startswith("stall:"):
            seconds = float(spec.split(":", 1)[1])
            factory.connect("media-configure", lambda _f, media, s=seconds: stall_later(media, s))
        mounts.add_factory(f"/{name}", factory)
    if server.attach(None) == 0:
        print(f"cannot listen on 127.0.0.1:{argv[0]}", file=sys.stderr)
        return 1
    print("ready", flush=True)
    GLib.MainLoop().run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
