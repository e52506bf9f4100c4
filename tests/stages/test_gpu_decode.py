"""GpuDecodeStage: the source contract where no GPU decoder exists (CPU), and on a GPU the
whole pipeline with GPU decode against CPU decode (the same pictures, the same detections);
the live view's pictures of a GPU-decoded source, downloaded only while it is watched."""

from __future__ import annotations

import itertools
import threading
from types import SimpleNamespace

import pytest

from pipeline.config import SourceConfig
from pipeline.records import EndOfStream
from stages.gpu_decode import HWACCEL_OPTIONS, cuda_hwaccel, gpu_decode_unavailable_reason


def test_hwaccel_keeps_frames_on_the_device_in_the_current_context():
    from av.codec.hwaccel import HWAccel

    accel = cuda_hwaccel(HWAccel, 0)
    assert accel.options == HWACCEL_OPTIONS == {"primary_ctx": "0", "current_ctx": "1"}
    assert accel.allow_software_fallback is False
    assert getattr(accel, "is_hw_owned", True)


def test_without_a_gpu_decoder_the_source_ends_with_the_reason(samples):
    reason = gpu_decode_unavailable_reason()
    if reason is None:
        pytest.skip("a GPU decoder is usable here")
    from stages.gpu_decode import GpuDecodeStage

    stage = GpuDecodeStage(SourceConfig(name="bikes", uri=str(samples.bikes)))
    assert stage.expected_frames == 250  # probed like any file source
    items = list(stage.frames(threading.Event()))
    assert items == [EndOfStream("bikes", 0, error=items[0].error)]
    assert "GPU decode unavailable" in items[0].error and reason in items[0].error
    assert str(samples.bikes) in items[0].error


ON_GPU = SimpleNamespace(device_id=0)  # decoder_kind reads only whether there is a GPU context


@pytest.mark.parametrize("decode, video, gpu, host_frames, expected", [
    ("auto", None, None, False, "cpu"),
    ("cpu", None, ON_GPU, False, "cpu"),
    ("auto", "{source}.mp4", ON_GPU, False, "cpu"),
    ("auto", None, ON_GPU, True, "cpu"),  # the Python API's frames (Pipeline(frames=...))
    ("gpu", None, None, False, "cannot be used: inference does not run on the GPU"),
    ("gpu", "{source}.mp4", ON_GPU, False,
     "cannot be used: output.video needs the frames on the host"),
    ("gpu", None, ON_GPU, True,
     "cannot be used: the Python API's frames are handed over from host memory"),
])
def test_the_source_kind_follows_the_config(samples, decode, video, gpu, host_frames, expected):
    from pipeline.app.build import DeviceUnavailable, decoder_kind
    from pipeline.config import parse_config

    config = parse_config({"sources": [{"name": "b", "uri": str(samples.bikes), "decode": decode}],
                           "model": {"path": str(samples.model)}, "output": {"video": video}})
    if expected.startswith("cannot"):
        with pytest.raises(DeviceUnavailable, match=r"sources\[0\]\.decode: 'gpu' " + expected):
            decoder_kind(config, config.sources[0], "sources[0]", gpu, host_frames)
    else:
        assert decoder_kind(config, config.sources[0], "sources[0]", gpu, host_frames) == expected


@pytest.mark.parametrize("decode, media, expected", [
    ("auto", {"clip": None}, "gpu"),  # a snapshot downloads its one frame
    ("gpu", {"clip": None}, "gpu"),
    ("auto", {}, "cpu"),  # a clip without a recording: a ring of every frame
    ("gpu", {}, "cannot be used: output.event_media.clip needs the frames on the host"),
])
def test_event_snapshots_keep_gpu_decode_and_clips_do_not(samples, monkeypatch, decode, media,
                                                           expected):
    import pipeline.app.build as build
    from pipeline.config import parse_config

    monkeypatch.setattr(build, "gpu_decode_unavailable_reason", lambda: None)  # a usable NVDEC
    config = parse_config({"sources": [{"name": "b", "uri": str(samples.bikes), "decode": decode}],
                           "model": {"path": str(samples.model)},
                           "output": {"video": None, "events": "{source}.events.jsonl",
                                      "event_media": media}})
    if expected.startswith("cannot"):
        with pytest.raises(build.DeviceUnavailable, match=expected):
            build.decoder_kind(config, config.sources[0], "sources[0]", ON_GPU)
    else:
        assert build.decoder_kind(config, config.sources[0], "sources[0]", ON_GPU) == expected


@pytest.mark.parametrize("decode", ["auto", "gpu"])
def test_the_live_view_keeps_gpu_decode(samples, monkeypatch, decode):
    import pipeline.app.build as build
    from pipeline.config import parse_config

    monkeypatch.setattr(build, "gpu_decode_unavailable_reason", lambda: None)  # a usable NVDEC
    config = parse_config({"sources": [{"name": "b", "uri": str(samples.bikes), "decode": decode}],
                           "model": {"path": str(samples.model)}, "output": {"video": None},
                           "runtime": {"http": {"port": 0}}})
    assert build.decoder_kind(config, config.sources[0], "sources[0]", ON_GPU) == "gpu"


class RecordingTap:
    """A ``PictureTap`` that says whether the source is wanted and keeps what it is given."""

    period_s = 0.0  # ask at every frame

    def __init__(self, want: bool) -> None:
        self.want, self.asked, self.offered = want, 0, []

    def wanted(self, source: str) -> bool:
        self.asked += 1
        return self.want

    def offer_picture(self, source, index, nv12, width, height) -> None:
        self.offered.append((source, index, nv12, width, height))


def first_frames(stage, count: int) -> list:
    """The first ``count`` items of ``stage.frames``, the stage then closed."""
    items = stage.frames(threading.Event())
    try:
        return list(itertools.islice(items, count))
    finally:
        items.close()


def test_pictures_are_asked_for_once_per_period_and_downloaded_only_when_wanted(monkeypatch):
    """The stage's preview logic on fake NVDEC frames (CPU): at most one ``wanted`` question
    per ``period_s``, a download only on a yes, handed over with the frame's index."""
    import numpy as np

    import stages.gpu_decode as gpu_decode
    from stages.gpu_decode import GpuDecodeStage

    now = [100.0]
    monkeypatch.setattr(gpu_decode.time, "monotonic", lambda: now[0])
    planes = (np.zeros((4, 6), np.uint8), np.zeros((2, 3, 2), np.uint8))
    monkeypatch.setattr(gpu_decode, "device_planes", lambda picture: planes)
    downloads = []
    monkeypatch.setattr(gpu_decode, "download_nv12", lambda y, uv: downloads.append(1) or
                        np.full((6, 6), len(downloads), np.uint8))
    tap = RecordingTap(want=False)
    tap.period_s = 0.2
    stage = GpuDecodeStage(SourceConfig(name="cam", uri="rtsp://host/cam"), 0, None, tap)
    stage._checked = True  # no CUDA context to compare here
    picture = SimpleNamespace(format=SimpleNamespace(name="cuda"), width=6, height=4, time=None)

    def frame_at(index: int, t: float):
        now[0] = t
        return stage.make_frame(picture, index, None)

    for index, t in enumerate([100.0, 100.1, 100.19, 100.25, 100.3]):
        frame_at(index, t)
    assert tap.asked == 2 and downloads == [] and tap.offered == []  # at 100.0 and 100.25
    tap.want = True
    assert frame_at(5, 100.4).index == 5 and tap.asked == 2  # not due yet: not even asked
    frame_at(6, 100.5)
    frame_at(7, 100.6)
    assert tap.asked == 3 and downloads == [1]
    [(name, index, nv12, width, height)] = tap.offered
    assert (name, index, width, height) == ("cam", 6, 6, 4) and nv12.shape == (6, 6)


def gpu_reason() -> str | None:
    import importlib.util

    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed"
    return gpu_decode_unavailable_reason()


def cpu_pictures(path, count: int) -> list:
    import av

    with av.open(str(path)) as container:
        return [p for p, _ in zip(container.decode(video=0), range(count))]


@pytest.mark.gpu
def test_gpu_decoded_frames_pack_to_the_cpu_decoded_pictures(samples):
    """The batcher's copies onto the device: a GPU-decoded frame (two pitched D2D copies) and
    a host frame from a pinned ring slot (one H2D) in the same batch, byte for byte."""
    if reason := gpu_reason():
        pytest.skip(f"GPU decode unavailable: {reason}")
    import numpy as np

    from pipeline.gpu import GpuContext
    from pipeline.records import Frame
    from pipeline.slots import SlotRing, i420_bytes
    from stages.batcher import BatcherStage
    from stages.decode import DecodeStage
    from stages.gpu_decode import GpuDecodeStage

    source = SourceConfig(name="bikes", uri=str(samples.bikes))
    slot_bytes = i420_bytes(640, 272)
    gpu = GpuContext(0)
    gpu.allocate(2, 2, slot_bytes, 10)
    ring = SlotRing(4, slot_bytes, pinned=True)
    batcher = BatcherStage("batch", (32, 32), 2, 1000.0, ("bikes",), gpu, ring, threading.Event())
    batcher.open()
    cpu = cpu_pictures(samples.bikes, 12)
    stop = threading.Event()
    host = DecodeStage(source, ring).frames(stop)
    for index, item in enumerate(GpuDecodeStage(source, 0, ring).frames(stop)):
        if index == len(cpu):
            break
        assert isinstance(item, Frame), item
        assert (item.index, item.pixel_format, item.image, item.slot) == (index, "nv12", None, -1)
        assert item.device_planes[0].strides[0] >= item.width  # the surface's pitch
        host_frame = next(host)
        assert item.pts == host_frame.pts and host_frame.slot >= 0
        batch = batcher.make_batch([item, host_frame])
        buffers = batch.buffers
        assert [(fmt, start, end) for _, fmt, start, end in buffers.groups] == [
            ("nv12", 0, 1), ("i420", 1, 2)]
        buffers.copied.synchronize()
        size = item.width * item.height * 3 // 2
        want = cpu[index].to_ndarray(format="nv12").reshape(-1)
        np.testing.assert_array_equal(buffers.frames[0, :size].get(), want)  # bit-exact H.264
        want = cpu[index].to_ndarray(format="yuv420p").reshape(-1)
        np.testing.assert_array_equal(buffers.frames[1, :size].get(), want)
        np.testing.assert_array_equal(buffers.table.device["letterbox"][:2].get(),
                                      batch.letterbox)
        ring.release(batch.slot)
        gpu.batches.release(buffers)
    stop.set()


@pytest.mark.gpu
def test_gpu_decode_reads_a_whole_file_and_reports_a_missing_one(samples, tmp_path):
    if reason := gpu_reason():
        pytest.skip(f"GPU decode unavailable: {reason}")
    from stages.gpu_decode import GpuDecodeStage

    items = list(GpuDecodeStage(SourceConfig(name="bikes", uri=str(samples.bikes)))
                 .frames(threading.Event()))
    assert [f.index for f in items[:-1]] == list(range(250))
    assert items[-1] == EndOfStream("bikes", 250)
    missing = str(tmp_path / "missing.mp4")
    [end] = GpuDecodeStage(SourceConfig(name="gone", uri=missing)).frames(threading.Event())
    assert end.frames == 0 and "missing.mp4" in end.error


@pytest.mark.gpu
def test_a_looped_file_on_nvdec_plays_past_its_end_as_on_the_cpu(make_clip):
    """``loop: true`` on NVDEC (the CPU path's seek back, inherited): frame numbers rise on
    across the passes, pts the same as the CPU decoder's, each pass the file's pictures."""
    if reason := gpu_reason():
        pytest.skip(f"GPU decode unavailable: {reason}")
    import numpy as np

    from pipeline.records import Frame
    from stages.decode import DecodeStage
    from stages.gpu_decode import GpuDecodeStage

    source = SourceConfig(name="loop", uri=str(make_clip("bikes", 12, (320, 136))), loop=True)
    stop = threading.Event()
    host = DecodeStage(source).frames(stop)
    first: list = []
    for index, item in enumerate(GpuDecodeStage(source).frames(stop)):
        if isinstance(item, EndOfStream):
            break
        on_cpu = next(host)
        assert isinstance(item, Frame) and item.index == on_cpu.index == index
        assert item.pts == pytest.approx(on_cpu.pts)
        luma = item.device_planes[0].get()
        np.testing.assert_array_equal(luma, on_cpu.image[:item.height])  # bit-exact H.264
        if item.index < 12:
            first.append(luma)
        else:
            np.testing.assert_array_equal(luma, first[item.index % 12])
        if item.index == 30:
            stop.set()
    assert item == EndOfStream("loop", 31)


@pytest.mark.gpu
def test_a_watched_gpu_source_hands_its_pictures_to_the_live_view(samples, monkeypatch):
    """Nothing is downloaded without a viewer; with one, a frame's NV12 download is the CPU
    decode of the same frame, and the hub keeps it with that frame's detections."""
    if reason := gpu_reason():
        pytest.skip(f"GPU decode unavailable: {reason}")
    import numpy as np

    import stages.gpu_decode as gpu_decode
    from pipeline.app.preview import PreviewHub
    from pipeline.records import Frame
    from stages.gpu_decode import GpuDecodeStage
    from tests.support.batches import batch_detections, make_frame

    downloads = []
    download = gpu_decode.download_nv12
    monkeypatch.setattr(gpu_decode, "download_nv12",
                        lambda y, uv: downloads.append(1) or download(y, uv))
    source = SourceConfig(name="bikes", uri=str(samples.bikes))
    count = 12
    cpu = cpu_pictures(samples.bikes, count)

    unwatched = RecordingTap(want=False)
    for tap in (None, unwatched):
        items = first_frames(GpuDecodeStage(source, 0, None, tap), count)
        assert [f.index for f in items] == list(range(count))
    assert unwatched.asked == count and unwatched.offered == [] and downloads == []

    watched = RecordingTap(want=True)
    items = first_frames(GpuDecodeStage(source, 0, None, watched), count)
    assert all(isinstance(f, Frame) and f.image is None for f in items)
    assert [index for _, index, *_ in watched.offered] == list(range(count))
    assert len(downloads) == count
    for (name, index, nv12, width, height), frame in zip(watched.offered, items):
        assert (name, width, height) == ("bikes", frame.width, frame.height)
        want = cpu[index].to_ndarray(format="nv12").reshape(height * 3 // 2, width)
        assert nv12.shape == want.shape and nv12.dtype == np.uint8
        assert np.abs(nv12.astype(np.int16) - want).max() <= 1  # bit-exact in practice

    hub = PreviewHub(preview_fps=30)
    hub.request("bikes")
    [frame] = first_frames(GpuDecodeStage(source, 0, None, hub), 1)  # frame 0: asked, wanted
    width, height = frame.width, frame.height
    box = (10, 10, width // 2, height // 2, 0.9, 0)
    part = batch_detections([(make_frame("bikes", 0, width=width, height=height), [box])])
    hub.offer_part(part, annotated=False)
    assert hub.activity("bikes").picture_seq == 1
    picture, got_width, got_height = hub.picture("bikes")
    assert (got_width, got_height) == (width, height)
    want = cpu[0].to_ndarray(format="yuv420p").reshape(height * 3 // 2, width)
    assert np.abs(picture.astype(np.int16) - want).max() <= 1
    seq, jpeg = hub.jpeg("bikes")  # drawn with frame 0's box
    assert seq == 1 and jpeg[:2] == b"\xff\xd8"


@pytest.mark.parametrize(("bound", "calls"), [
    (True, ["setDevice(0)", "ctxGetCurrent"]),  # CUDA 12: cudaSetDevice binds it
    (False, ["setDevice(0)", "ctxGetCurrent", "memGetInfo", "ctxGetCurrent"]),
])
def test_the_primary_context_is_bound_without_a_runtime_call_where_set_device_binds_it(
        monkeypatch, bound, calls):
    """cudaMemGetInfo, which CuPy runs holding the GIL, took 0.5 s on a busy H200: it is only
    the fallback for a CUDA that binds no context at cudaSetDevice (a stand-in CuPy records
    the calls: none runs here)."""
    import sys

    from stages.gpu_decode import activate_primary_context

    made: list[str] = []
    state = {"context": 0}

    def set_device(device):
        made.append(f"setDevice({device})")
        state["context"] = 0xC0 if bound else 0

    def mem_get_info():
        made.append("memGetInfo")
        state["context"] = 0xC0
        return (1, 2)

    def ctx_get_current():
        made.append("ctxGetCurrent")
        return state["context"]

    cuda = SimpleNamespace(runtime=SimpleNamespace(setDevice=set_device, memGetInfo=mem_get_info),
                           driver=SimpleNamespace(ctxGetCurrent=ctx_get_current))
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=cuda))
    assert activate_primary_context(0) == 0xC0
    assert made == calls

