"""A real headless Chromium (Debian's ``chromium`` package) driven by Playwright, for the
live view's page tests."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tests.support.ci import skip_unless_ci

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
# Headless, no sandbox (containers run as root), and nothing that talks to the network.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]


def chromium_path() -> str | None:
    """The Chromium executable: ``$CHROMIUM`` if set (None when it is not executable),
    else Debian's, else one on PATH; None when there is none."""
    if os.environ.get("CHROMIUM"):
        return os.environ["CHROMIUM"] if os.access(os.environ["CHROMIUM"], os.X_OK) else None
    found = [p for p in CHROMIUM_CANDIDATES if os.access(p, os.X_OK)]
    return found[0] if found else shutil.which("chromium")


@functools.cache
def chromium_missing() -> str | None:
    """Why the browser tests cannot run here (to skip with), or None when they can."""
    if chromium_path() is None:
        return ("Chromium not found (Debian package chromium); install it with "
                ".ci/install-system-packages.sh")
    try:
        import playwright.sync_api  # noqa: F401 - the driver of the browser
    except ImportError:
        return "playwright is not installed (pip install -e .[dev])"
    return None


def require_chromium() -> str:
    """The Chromium executable; skips the calling test when Chromium or Playwright is
    missing (fails in CI: ``skip_unless_ci``)."""
    if (reason := chromium_missing()) is not None:
        skip_unless_ci(reason, "browser")
    return str(chromium_path())


@contextmanager
def headless_page(executable: str, width: int = 1280, height: int = 900) -> Iterator[Any]:
    """A Playwright ``Page`` of a fresh headless Chromium (its own throw-away profile),
    closed on exit."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="chromium-") as profile, sync_playwright() as driver:
        context = driver.chromium.launch_persistent_context(
            profile, executable_path=executable, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": width, "height": height})
        try:
            yield context.pages[0] if context.pages else context.new_page()
        finally:
            context.close()
