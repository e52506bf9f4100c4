"""Fixtures shared by every test: the repository root, the sample assets and clips made
from them (once a session)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from samples.fetch import SampleError, SamplePaths, ensure_samples
from tests.support.clips import ClipFactory, make_defect_clips


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


@pytest.fixture(scope="session")
def make_clip(samples: SamplePaths, tmp_path_factory: pytest.TempPathFactory) -> ClipFactory:
    """``make_clip(scene, frames, (width, height))``: an H.264 clip, made once a session
    (``tests.support.clips.ClipFactory``); ``make_clip.frames(scene, count)`` its frames."""
    return ClipFactory(tmp_path_factory.mktemp("clips"),
                       {"bikes": samples.bikes, "carphone": samples.carphone,
                        "bigbuckbunny": samples.bigbuckbunny})


@pytest.fixture(scope="session")
def defect_clips(make_clip: ClipFactory, tmp_path_factory: pytest.TempPathFactory
                 ) -> dict[str, Path]:
    """Small clips, each with one defect a decoder meets, and the clean one they were made
    from (``tests.support.clips.make_defect_clips``)."""
    return make_defect_clips(make_clip, tmp_path_factory.mktemp("defects"))
