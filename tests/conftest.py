"""Fixtures shared by every test: the repository root and the sample assets."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from samples.fetch import SampleError, SamplePaths, ensure_samples


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """Each test leaves structlog as it found it: ``pipeline.logging.configure_logging`` (run
    by ``main()`` and the benchmarks) sets a level that would hide later tests' captured
    lines."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root folder."""
    return Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def samples(repo_root: Path) -> SamplePaths:
    """The sample model and videos under <repo>/assets, fetched once and cached across runs."""
    try:
        return ensure_samples(repo_root / "assets")
    except SampleError as e:
        pytest.fail(f"cannot fetch the sample assets: {e}", pytrace=False)
