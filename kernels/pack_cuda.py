"""Pack GPU-decoded planes into a batch's device frame rows: one kernel launch per batch.

A GPU-decoded frame's NV12 planes live in NVDEC surfaces whose rows are further apart than
the picture is wide (the surface pitch). The preprocess kernel reads packed frames (Y rows,
then UV rows, no padding: ``stages.batcher.pack_nv12``), so each plane is copied into the
batch's frame row. Done with one ``cudaMemcpy2DAsync`` per plane, that is two driver calls per
frame, and each waits for the driver while dozens of NVDEC threads of the same CUDA context
are calling it too: on the H200 at 64 GPU-decoded cameras the batcher spent about 1 ms per
frame there and became the pipeline's bottleneck (``benchmarks/results-h200.md``). Instead the
batcher writes one row per plane into a small table that travels with the batch's other
tables (one H2D), and one launch of ``pack_planes`` copies every plane of the batch.

Table rows (int64, ``COPY_COLUMNS``): source address, source row pitch in bytes, destination
offset in bytes from the start of the frame rows, bytes per row, rows. Rows whose addresses,
pitch and width are all multiples of 16 bytes are copied 16 bytes per thread, others byte by
byte. The kernel is CUDA C compiled by CuPy (NVRTC) on first use: call ``compile_pack`` at
start.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

COPY_COLUMNS = ("src", "src_pitch", "dst_offset", "width", "rows")
THREADS = 256
BLOCKS_PER_PLANE = 64  # grid x; each thread then copies a 1080p Y plane in ~8 steps

_SOURCE = r"""
extern "C" __global__ void pack_planes(const long long* jobs, int n_jobs, unsigned char* dst) {
    int job = blockIdx.y;
    if (job >= n_jobs) return;
    const long long* row = jobs + 5LL * job;
    const unsigned char* src = (const unsigned char*) row[0];
    long long pitch = row[1];
    unsigned char* out = dst + row[2];
    long long width = row[3], rows = row[4];
    long long stride = (long long) gridDim.x * blockDim.x;
    long long first = (long long) blockIdx.x * blockDim.x + threadIdx.x;
    if (((row[0] | pitch | (long long) out | width) & 15) == 0) {
        long long words = width / 16, total = words * rows;
        for (long long i = first; i < total; i += stride) {
            long long r = i / words, c = i - r * words;
            ((uint4*) (out + r * width))[c] = ((const uint4*) (src + r * pitch))[c];
        }
    } else {
        long long total = width * rows;
        for (long long i = first; i < total; i += stride) {
            long long r = i / width, c = i - r * width;
            out[r * width + c] = src[r * pitch + c];
        }
    }
}
"""


@functools.cache
def _kernel() -> Any:
    import cupy

    return cupy.RawKernel(_SOURCE, "pack_planes")


def compile_pack() -> None:
    """Compile the kernel now (NVRTC, about a second), so no batch pays for it."""
    _kernel().compile()


def nv12_copies(y: Any, uv: Any, dst_offset: int) -> list[tuple[int, int, int, int, int]]:
    """The two table rows (``COPY_COLUMNS``) that pack one NV12 frame at ``dst_offset``.

    Args:
        y: (height, width) uint8 device array (CuPy), any row pitch.
        uv: (height // 2, width // 2, 2) uint8 device array of interleaved U, V, any row pitch.
        dst_offset: byte offset of the frame's row in the batch's frame rows.
    """
    height, width = y.shape
    return [(y.data.ptr, y.strides[0], dst_offset, width, height),
            (uv.data.ptr, uv.strides[0], dst_offset + width * height, width, height // 2)]


def launch_pack(jobs: Any, count: int, frames: Any, stream: Any) -> None:
    """Queue one launch copying ``count`` planes described by ``jobs`` into ``frames``.

    Args:
        jobs: (>= count, 5) int64 device array (CuPy), rows as ``COPY_COLUMNS``; already on
            the device, or copied there earlier on ``stream``.
        count: table rows to copy (0: nothing is launched).
        frames: the batch's frame rows: a uint8 device array (CuPy) whose start the
            destination offsets count from.
        stream: the CuPy stream; the caller orders it after whatever wrote the sources and
            keeps them alive until the copies have run.
    """
    if count == 0:
        return
    with stream:
        _kernel()((BLOCKS_PER_PLANE, count), (THREADS,), (jobs, np.int32(count), frames))
