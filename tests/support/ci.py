"""Tests of real components (RTSP server, MQTT broker, browser, Ray) skip where one is
missing, but fail in CI."""

from __future__ import annotations

import importlib.util
import os
from typing import NoReturn


def skip_unless_ci(reason: str, tests: str) -> NoReturn:
    """Skip the calling test for ``reason`` (a real component is missing), except in CI
    (``CI`` set, as `.ci/run` sets it), where that fails the test: CI installs every real
    component, so its ``tests`` must never pass by skipping there."""
    import pytest

    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"CI must run the {tests} tests: {reason}", pytrace=False)
    pytest.skip(reason)


def require_ray_installed() -> None:
    """Skip the calling test when Ray is not installed (a failure in CI: ``skip_unless_ci``),
    without importing it."""
    if importlib.util.find_spec("ray") is None:
        skip_unless_ci("ray is not installed (pip install -e '.[ray]')", "Ray")
