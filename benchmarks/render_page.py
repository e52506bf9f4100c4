"""A PNG of the live view as ``benchmarks.live_control`` saved it, rendered locally: the
machine that ran it (the H200) has no browser.

    python -m benchmarks.render_page OUT [--png OUT/page.png] [--width 1600] [--height 1000]
        [--viewport-only] [--wait-s 8] [--chromium PATH]

``OUT`` is a ``live_control --out`` folder. A headless Chromium (Playwright) opens the saved
page with every request answered from the saved files (``page.route``), never from a
network:

=========================================  ===============================================
request                                    answer
=========================================  ===============================================
``/``                                      ``OUT/index.html``
``/api/sources``                           ``OUT/sources.json``
``/api/health``                            ``OUT/health.json``
``/api/sources/NAME/snapshot.jpg``,        ``OUT/snapshots/NAME.jpg`` (header ``X-Picture:
``/api/sources/NAME/stream.mjpg``          1``), or 404 when that camera was not watched
anything else                              404 (listed on stdout)
=========================================  ===============================================

So the page shows the counters, states and health of the moment they were saved, and the
pictures of the watched cameras; the other cards keep their empty frames, as they would for
a camera with no picture yet. It waits until every saved picture is on the page (at most
``--wait-s``), then writes the screenshot (the whole page unless ``--viewport-only``).
Chromium: ``--chromium``, else ``$CHROMIUM``, else Debian's ``/usr/bin/chromium``, else
Playwright's own.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

BASE = "http://live-view.invalid"  # every request is routed: nothing is resolved or fetched
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
PICTURE_SUFFIXES = ("/snapshot.jpg", "/stream.mjpg")


def answer_for(out: Path, path: str) -> tuple[int, str, bytes]:
    """(status, content type, body) the saved files give for a request ``path``."""
    path = unquote(path)
    files = {"/": ("index.html", "text/html; charset=utf-8"),
             "/index.html": ("index.html", "text/html; charset=utf-8"),
             "/api/sources": ("sources.json", "application/json"),
             "/api/health": ("health.json", "application/json")}
    if path in files:
        name, kind = files[path]
        target = out / name
        return (200, kind, target.read_bytes()) if target.exists() else (404, "text/plain",
                                                                          b"not saved")
    if path.startswith("/api/sources/") and path.endswith(PICTURE_SUFFIXES):
        name = path[len("/api/sources/"):].rsplit("/", 1)[0]
        jpeg = out / "snapshots" / f"{name}.jpg"
        if "/" not in name and jpeg.exists():
            return 200, "image/jpeg", jpeg.read_bytes()
        return 404, "text/plain", b"no saved picture"
    return 404, "text/plain", b"not saved"


def chromium(explicit: str | None) -> str | None:
    """The Chromium executable to drive, or None for Playwright's own."""
    for candidate in (explicit, os.environ.get("CHROMIUM"), "/usr/bin/chromium",
                      shutil.which("chromium")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def render(out: Path, png: Path, width: int, height: int, full_page: bool, wait_s: float,
           executable: str | None) -> tuple[int, list[str]]:
    """Render the saved page into ``png``; returns (pictures shown, paths answered 404)."""
    from playwright.sync_api import sync_playwright

    pictures = len(list((out / "snapshots").glob("*.jpg")))
    missed: list[str] = []

    def route(route: Any) -> None:
        path = urlsplit(route.request.url).path
        status, kind, body = answer_for(out, path)
        if status == 404 and not path.endswith(PICTURE_SUFFIXES):
            missed.append(path)
        headers = {"X-Picture": "1"} if kind == "image/jpeg" else {}
        route.fulfill(status=status, content_type=kind, body=body, headers=headers)

    with sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=executable, headless=True,
                                         args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.route("**/*", route)
            page.goto(f"{BASE}/", wait_until="load")
            deadline = time.monotonic() + wait_s
            shown = 0
            while time.monotonic() < deadline:
                shown = page.evaluate(
                    "() => [...document.images].filter((i) => i.src.startsWith('blob:') && "
                    "i.complete && i.naturalWidth > 0).length")
                if shown >= pictures:
                    break
                page.wait_for_timeout(200)
            page.wait_for_timeout(1200)  # one refresh of the counters from sources.json
            png.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(png), full_page=full_page)
        finally:
            browser.close()
    return shown, sorted(set(missed))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.render_page",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="a benchmarks.live_control --out folder")
    parser.add_argument("--png", type=Path, default=None, help="default OUT/page.png")
    parser.add_argument("--width", type=int, default=1600)
    parser.add_argument("--height", type=int, default=1000)
    parser.add_argument("--viewport-only", action="store_true",
                        help="only the first screen, not the whole page")
    parser.add_argument("--wait-s", type=float, default=8.0,
                        help="longest wait for the saved pictures to show")
    parser.add_argument("--chromium", default=None, help="Chromium executable")
    args = parser.parse_args(argv)
    out: Path = args.out
    if not (out / "index.html").exists():
        print(f"error: {out / 'index.html'} not found: not a benchmarks.live_control --out "
              f"folder", file=sys.stderr)
        return 2
    png = args.png or out / "page.png"
    try:
        shown, missed = render(out, png, args.width, args.height, not args.viewport_only,
                               args.wait_s, chromium(args.chromium))
    except ImportError:
        print("error: playwright is not installed (pip install playwright)", file=sys.stderr)
        return 1
    except Exception as error:  # noqa: BLE001 - Playwright's errors: one line for the user
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        print(f"error: rendering failed: {type(error).__name__}: {first}", file=sys.stderr)
        return 1
    saved = len(list((out / "snapshots").glob("*.jpg")))
    print(f"wrote {png}: {shown} of {saved} saved pictures shown"
          + (f"; not saved, answered 404: {', '.join(missed)}" if missed else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
