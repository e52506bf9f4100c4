"""What a GPU-machine call needs that the machine lacks, packed under the 64 MiB a call
carries, and unpacked there first.

    python -m benchmarks.device_pack build tests|benchmarks [--pack .pack]  # here
    python3 -m benchmarks.device_pack unpack [--pack .pack]    # on the GPU machine, first

``build`` (it needs the network, and the assets of ``python -m samples.fetch`` and
``python -m samples.yolov8``) writes into ``--pack`` (git ignores ``/.pack/``), for the GPU
tests (``tests``: YOLOv3-tiny and the sample videos) or for the benchmarks (``benchmarks``:
YOLOv8s, bikes.mp4 and the 1080p clip); both at once would not fit:

- ``site.tar.xz``: the wheels ``../shared/gpu/fetch-wheels.sh`` downloads (PyAV, numpy,
  structlog, onnx2torch, and the live view's packages: ``EXTRA_WHEELS``), unzipped into one
  folder, their test suites left out, xz-compressed;
- ``NAME.f16.onnx`` for its model under ``assets/models`` (``PACKS``): its float32
  weights stored as float16 (half the bytes), ``NAME.names`` beside it. ``unpack`` makes them
  float32 again, so the models hold their weights rounded to float16: the GPU path runs FP16
  anyway, and on the GPU machine its CPU reference reads the same rounded weights;
- its videos: from ``assets/video``, and the benchmarks' 1080p clip (``assets/cache``).

``unpack`` untars the site into ``/tmp/site`` (put it first on ``PYTHONPATH``), and writes
the models and videos where ``python -m samples.fetch`` and ``samples.yolov8`` would have.
It needs numpy and onnx, which the GPU machine has. A device call then reads::

    python3 -m benchmarks.device_pack unpack && export PYTHONPATH=/tmp/site:$PWD &&
    bash benchmarks/gpu_check.sh tests

with ``carry: [".pack"]``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FETCH_WHEELS = REPO.parent / "shared" / "gpu" / "fetch-wheels.sh"
# beside fetch-wheels.sh's own: the live view's (runtime.http). Not the analytics extra's:
# supervision needs SciPy, too big to carry with the rest (gpu_check's CAP_ANALYTICS=1 does)
EXTRA_WHEELS = ("starlette", "uvicorn", "h11", "anyio", "sniffio", "click")
# what each pack holds: (model, its class names, the videos of assets/video, the 1080p clip)
PACKS = {"tests": ("yolov3-tiny", "coco.names", ("bikes", "bigbuckbunny", "carphone_pristine"),
                   False),
         "benchmarks": ("yolov8s-fall", "yolov8s-fall.names", ("bikes",), True)}
CARRY_LIMIT = 64 * 2**20  # bytes a call carries, the tracked tree (about 3 MB) included
F32_MARK = "streamdet:f32"  # the doc_string of an initializer stored as float16 here


def shrink_model(source: Path, target: Path) -> None:
    """``source``'s ONNX with every float32 initializer stored as float16 and marked
    (``F32_MARK``) for ``grow_model``."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(source))
    for tensor in model.graph.initializer:
        if tensor.data_type == onnx.TensorProto.FLOAT:
            half = numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float16),
                                           tensor.name)
            half.doc_string = F32_MARK
            tensor.CopyFrom(half)
    onnx.save(model, str(target))


def grow_model(source: Path, target: Path) -> None:
    """``shrink_model`` undone: the marked initializers float32 again (their values rounded
    to float16)."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(source))
    for tensor in model.graph.initializer:
        if tensor.doc_string == F32_MARK:
            tensor.CopyFrom(numpy_helper.from_array(
                numpy_helper.to_array(tensor).astype(np.float32), tensor.name))
    onnx.save(model, str(target))


def pack_site(wheels: Path, target: Path) -> None:
    """The wheels under ``wheels`` unzipped into one site folder (tests left out), as
    ``target`` (.tar.xz)."""
    with tempfile.TemporaryDirectory() as temp:
        site = Path(temp)
        for wheel in sorted(wheels.glob("*.whl")):
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(site)
        for tests in [*site.glob("*/tests"), *site.glob("*/*/tests")]:
            shutil.rmtree(tests, ignore_errors=True)
        with tarfile.open(target, "w:xz") as tar:
            for path in sorted(site.iterdir()):
                tar.add(path, arcname=path.name)


def build(pack: Path, kind: str) -> int:
    """Fill ``pack`` for ``kind`` (``PACKS``; module docstring), anew; says its size against
    the carry limit (exit status 1 past it)."""
    assets = REPO / "assets"
    model, names, videos, clip = PACKS[kind]
    needed = [assets / "models" / f"{model}.onnx", assets / "models" / names,
              *(assets / "video" / f"{video}.mp4" for video in videos)]
    missing = [str(path) for path in needed if not path.exists()]
    if missing:
        print(f"error: missing {', '.join(missing)}: run python -m samples.fetch and "
              "python -m samples.yolov8", file=sys.stderr)
        return 2
    shutil.rmtree(pack, ignore_errors=True)
    pack.mkdir(parents=True)
    subprocess.run(["bash", str(FETCH_WHEELS), *EXTRA_WHEELS], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pack_site(REPO / ".whl", pack / "site.tar.xz")
    shrink_model(needed[0], pack / f"{model}.f16.onnx")
    for path in needed[1:]:
        shutil.copy(path, pack)
    if clip:
        from benchmarks.live_control import camera_clip

        shutil.copy(camera_clip(False, assets), pack)
    packed = sum(p.stat().st_size for p in pack.iterdir())
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True,
                             capture_output=True).stdout.decode().split("\0")
    tree = sum((REPO / name).stat().st_size for name in tracked if (REPO / name).is_file())
    print(f"{pack}: {packed / 2**20:.1f} MiB, with the tracked tree {(packed + tree) / 2**20:.1f} "
          f"MiB of the {CARRY_LIMIT / 2**20:.0f} MiB a call carries")
    return 0 if packed + tree < CARRY_LIMIT else 1


def unpack(pack: Path, site: Path = Path("/tmp/site"), assets: Path = REPO / "assets") -> int:
    """Unpack ``pack`` on the GPU machine (module docstring): the site into ``site``, the
    models and videos under ``assets``."""
    with tarfile.open(pack / "site.tar.xz") as tar:
        tar.extractall(site, filter="data")
    sys.path.insert(0, str(site))  # PyAV, which the clip's name comes with, is there
    from benchmarks.overlap_benchmark import CLIP_NAME

    (assets / "models").mkdir(parents=True, exist_ok=True)
    for shrunk in pack.glob("*.f16.onnx"):
        grow_model(shrunk, assets / "models" / shrunk.name.replace(".f16", ""))
    for names in pack.glob("*.names"):
        shutil.copy(names, assets / "models")
    for video in pack.glob("*.mp4"):
        folder = assets / ("cache" if video.name == CLIP_NAME else "video")
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(video, folder)
    print(f"unpacked {pack}: site {site}, models and videos under {assets}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.device_pack",
                                     description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_command = commands.add_parser("build", help="pack here")
    build_command.add_argument("kind", choices=sorted(PACKS))
    unpack_command = commands.add_parser("unpack", help="unpack on the GPU machine")
    unpack_command.add_argument("--site", type=Path, default=Path("/tmp/site"))
    unpack_command.add_argument("--assets", type=Path, default=REPO / "assets")
    parser.add_argument("--pack", type=Path, default=REPO / ".pack")
    args = parser.parse_args(argv)
    if args.command == "build":
        return build(args.pack, args.kind)
    return unpack(args.pack, args.site, args.assets)


if __name__ == "__main__":
    sys.exit(main())
