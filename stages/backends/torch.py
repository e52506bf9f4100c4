"""The torch backend: the ONNX model converted by onnx2torch, run in FP16 as CUDA graphs.

This is the GPU backend where TensorRT cannot run (the H200 test machine: TensorRT-RTX refuses
compute capability 9.0, full TensorRT is not obtainable).

**Capture safety.** onnx2torch keeps an ONNX graph's constant inputs (Split sizes, Reshape
shapes, Resize scales, Slice bounds) as buffers, which ``.to("cuda")`` moves to the GPU, and
its modules read them back in ``forward`` with ``tolist()`` or ``bool()``; its ``Shape`` copies
the shape from the host to the device. Each is a host-device copy with a synchronisation on every
call, and an error during CUDA graph capture. :func:`make_capture_safe` resolves them once,
after conversion: every value that only ever serves as such a size (a constant, a ``Shape``,
arithmetic on those) stays on the host, where reading it costs no GPU work, and a ``Shape``
that feeds data is filled on the device by kernels. onnx2torch's modules, hence the ONNX
semantics, are untouched; a constant that also feeds data (a factor in a ``Mul``) keeps its
device copy for that use; an integer scalar constant (a ``Gather`` index) stays on the host
for every use, since torch reads 0-d host tensors as plain numbers.

**CUDA graphs.** One graph per batch size, captured the first time that batch size is seen
(``warmup()`` captures ``max_batch``); smaller batches are not padded to ``max_batch``, so a
lightly loaded pipeline does not pay for empty slots. All graphs read one static input of
``max_batch`` images (batch ``B`` reads its first ``B``) and share one memory pool: a graph may
reuse memory that another graph uses for intermediates, so a graph's output is only valid until
the next ``infer`` call, which is the backend contract anyway. The pipeline's preprocess can
write straight into the static input (:meth:`TorchBackend.input_buffer`); ``infer`` then copies
nothing. A new batch size met mid-stream costs one capture (a device synchronise and a few
milliseconds); captures use ``thread_local`` mode, so other threads' CUDA calls stay legal. A
model whose forward still cannot be captured (an op reading device values on the host) runs
eagerly, with a warning in the log.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import numpy as np
import onnx2torch
import structlog
import torch
from onnx2torch.node_converters.constant import OnnxConstant
from onnx2torch.node_converters.shape import OnnxShape
from onnx2torch.utils.common import OnnxToTorchModule
from torch import fx, nn

from stages.backends.base import InferenceBackend, ModelInfo

log = structlog.get_logger("torch")

PRECISIONS = ("fp16", "fp32")
WARMUP_RUNS = 3  # eager runs on a side stream before a capture (cuDNN autotuning, workspaces)
# Parameter names of onnx2torch modules' forward() that take sizes, shapes, axes or scales:
# values read on the host, never data that kernels read.
SHAPE_PARAMETERS = frozenset({"split", "shape", "roi", "scales", "sizes", "starts", "ends", "axes",
                              "steps", "repeats", "pads", "k", "start", "limit", "delta"})


class HostConstant(nn.Module):
    """A constant kept on the host: a plain attribute, which ``.to()`` and ``.half()`` skip."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value.detach().cpu() if isinstance(value, torch.Tensor) else value

    def forward(self) -> Any:
        return self.value


class StaticShape(nn.Module):
    """ONNX ``Shape`` without onnx2torch's host-to-device copy (illegal during a capture).

    Args:
        start, end: the dimensions to report, as in ONNX.
        on_host: return a host tensor (the shape serves as sizes only), or fill a device
            tensor with kernels (the shape feeds data).
    """

    def __init__(self, start: int, end: int | None, on_host: bool) -> None:
        super().__init__()
        self.start, self.end, self.on_host = start, end, on_host

    def forward(self, input_tensor: torch.Tensor) -> torch.Tensor:
        dims, device = input_tensor.shape[self.start:self.end], input_tensor.device
        if self.on_host:
            return torch.tensor(dims, dtype=torch.int64)
        if not dims:
            return torch.zeros(0, dtype=torch.int64, device=device)
        return torch.stack([torch.full((), d, dtype=torch.int64, device=device) for d in dims])


def make_capture_safe(module: fx.GraphModule) -> fx.GraphModule:
    """Keep the sizes, shapes and scales an onnx2torch module reads in ``forward`` on the host.

    Afterwards, ``module.to(device)`` moves only the data the kernels read, and ``forward``
    reads no device value on the host: it can be captured in a CUDA graph.

    Args:
        module: a module from ``onnx2torch.convert``; rewritten in place.

    Returns:
        ``module``.
    """
    modules = dict(module.named_modules())
    graph = module.graph

    def target(node: fx.Node) -> Any:
        return modules.get(node.target) if node.op == "call_module" else None

    def is_constant(node: fx.Node) -> bool:
        return node.op == "get_attr" or isinstance(target(node), OnnxConstant)

    def reads_as_size(user: fx.Node, node: fx.Node) -> bool:
        """True when ``user`` takes ``node`` only through size parameters (SHAPE_PARAMETERS)."""
        mod = target(user)
        if not isinstance(mod, OnnxToTorchModule):
            return False
        names = list(inspect.signature(mod.forward).parameters)
        used = [names[min(i, len(names) - 1)] for i, arg in enumerate(user.args) if arg is node]
        used += [name for name, arg in user.kwargs.items() if arg is node]
        return all(name in SHAPE_PARAMETERS for name in used)

    nodes = list(graph.nodes)
    host: set[fx.Node] = set()
    for node in nodes:
        inputs = node.all_input_nodes
        if is_constant(node) or isinstance(target(node), OnnxShape) or (
                node.op in ("call_module", "call_function") and inputs
                and all(i in host for i in inputs)):
            host.add(node)
    # A host value computed by an op that feeds data to a device op stays on the device, and
    # so do (in turn, walking backwards) the values it is computed from; constants get copied.
    for node in reversed(nodes):
        if node in host and not is_constant(node) and any(
                user not in host and not reads_as_size(user, node) for user in node.users):
            host.discard(node)

    for index, node in enumerate(nodes):
        if isinstance(target(node), OnnxShape):
            shape = target(node)
            module.add_submodule(node.target, StaticShape(shape._start, shape._end, node in host))
        elif node in host and is_constant(node):
            value = module.get_buffer(node.target) if node.op == "get_attr" else target(node).value
            # An integer scalar (a Gather index, say) is read on the host by every op.
            scalar = isinstance(value, torch.Tensor) and value.dim() == 0 and (
                not value.is_floating_point())
            uses = [user for user in node.users
                    if scalar or user in host or reads_as_size(user, node)]
            if not uses:
                continue
            module.add_submodule(f"host_constant_{index}", HostConstant(value))
            with graph.inserting_after(node):
                copy = graph.call_module(f"host_constant_{index}")
            for user in uses:
                user.replace_input_with(node, copy)
            if not node.users:
                graph.erase_node(node)
    graph.lint()
    module.delete_all_unused_submodules()
    module.recompile()
    return module


def convert(model_path: str | Path) -> fx.GraphModule:
    """The ONNX model as a capture-safe torch module (fp32, CPU, eval mode)."""
    return make_capture_safe(onnx2torch.convert(str(model_path))).eval()


class TorchBackend(InferenceBackend):
    """Runs the ONNX model converted to torch, in FP16 or FP32, as CUDA graphs on the GPU.

    Args:
        model_path: the ONNX file.
        info: its input/output description.
        max_batch: largest batch passed to ``infer``.
        precision: "fp16" (weights and activations in half precision) or "fp32".
        gpu: the pipeline's GpuContext (its ``device_id`` and ``compute_stream`` are used);
            None on the CPU, or on the GPU for device 0 and CuPy's current stream.
        device: "cuda" (``infer`` takes and returns CuPy arrays) or "cpu" (NumPy; no graphs,
            for tests and machines without a GPU).
        cuda_graphs: replay CUDA graphs (cuda only); False runs the module eagerly.
        channels_last: run convolutions in NHWC memory layout (often faster with FP16).

    Raises:
        ValueError: an unknown precision or device; "int8" (only the tensorrt backend has it).
    """

    name = "torch"

    def __init__(self, model_path: str | Path, info: ModelInfo, max_batch: int, precision: str,
                 gpu: Any, *, device: str = "cuda", cuda_graphs: bool = True,
                 channels_last: bool = False) -> None:
        super().__init__(info, max_batch)
        if precision == "int8":
            raise ValueError("precision 'int8' needs the tensorrt backend; the torch backend runs "
                             "fp16 or fp32")
        if precision not in PRECISIONS or device not in ("cuda", "cpu"):
            raise ValueError(f"torch backend: precision must be one of {PRECISIONS} and device "
                             f"'cuda' or 'cpu', got {precision!r} and {device!r}")
        self.device = device
        self.precision = precision
        self.cuda_graphs = cuda_graphs and device == "cuda"
        self._dtype = torch.float16 if precision == "fp16" else torch.float32
        self._stream = gpu.compute_stream if gpu is not None else None
        if device == "cuda":
            self._device = torch.device("cuda", gpu.device_id if gpu is not None else 0)
            torch.backends.cudnn.benchmark = True  # fixed shapes: pick the fastest kernels once
        else:
            self._device = torch.device("cpu")
        module = convert(model_path).to(self._device, self._dtype)
        self.module = module.to(memory_format=torch.channels_last) if channels_last else module
        # A model with a fixed batch of 1 runs image by image (inside the same graph).
        self._forward = self.module if info.dynamic_batch else self._per_image
        shape = (max_batch, 3, info.input_height, info.input_width)
        self._input = torch.empty(shape, dtype=self._dtype, device=self._device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, Any]] = {}
        if device == "cuda":
            import cupy

            self._input_array = cupy.from_dlpack(self._input)
            self._pool = torch.cuda.graph_pool_handle()
        else:
            self._input_array = self._input.numpy()

    @property
    def input_dtype(self) -> type[np.floating]:
        """The dtype ``infer`` wants (others are cast): np.float16 for fp16, else np.float32."""
        return np.float16 if self.precision == "fp16" else np.float32

    def input_buffer(self, batch: int) -> Any:
        """The static input for a batch: write images here and ``infer`` copies nothing.

        Args:
            batch: number of images, 1..max_batch.

        Returns:
            (batch, 3, H, W) array of ``input_dtype``: a CuPy view of the device buffer the
            graphs read (cuda; write it on the stream later passed to ``infer``, or before it),
            or a NumPy view (cpu). The same memory on every call.
        """
        return self._input_array[:batch]

    @torch.inference_mode()
    def infer(self, images: Any, stream: Any = None) -> Any:
        """Run the model.

        Args:
            images: (B, 3, H, W) array, B at most ``max_batch``, RGB in 0..1, ``input_dtype``
                (float32 is cast); CuPy on the device valid on ``stream`` (cuda), NumPy (cpu).
                Preferably ``input_buffer(B)`` itself, which saves a device copy.
            stream: the CuPy stream to run on; None for the GpuContext's compute stream (or
                CuPy's current stream without one). Ignored on the CPU.

        Returns:
            (B, 4 + classes, anchors) array of the module's dtype (float16 for fp16). cuda: a
            CuPy view of the graph's static output, written on ``stream`` and valid until the
            next call. cpu: a NumPy array.
        """
        batch = images.shape[0]
        expected = (3, self.info.input_height, self.info.input_width)
        if not 1 <= batch <= self.max_batch or tuple(images.shape[1:]) != expected:
            raise ValueError(f"torch backend: images must be (1..{self.max_batch}, {expected[0]}, "
                             f"{expected[1]}, {expected[2]}), got {tuple(images.shape)}")
        if self.device == "cpu":
            return self._forward(torch.from_numpy(np.asarray(images)).to(self._dtype)).numpy()
        import cupy

        stream = stream or self._stream or cupy.cuda.get_current_stream()
        with stream, torch.cuda.device(self._device), torch.cuda.stream(
                torch.cuda.ExternalStream(stream.ptr, device=self._device)):
            static = self._input[:batch]
            own = (images.data.ptr == static.data_ptr() and images.flags.c_contiguous
                   and images.dtype == self.input_dtype)
            x = static if own else torch.from_dlpack(images)
            if self.cuda_graphs:
                if not own:
                    static.copy_(x)  # device to device, cast to the module's dtype
                captured = self._graphs.get(batch) or self._capture(batch)
                if captured is not None:  # None: the capture failed, graphs are now off
                    captured[0].replay()
                    return captured[2]
            return cupy.from_dlpack(self._forward(x.to(self._dtype)))

    def warmup(self) -> Any:
        """Capture the graphs of batch sizes 1..max_batch (or run once eagerly), so neither the
        first frame nor a partial batch later pays for a capture.

        Returns:
            The output of that run, (max_batch, 4 + classes, anchors), as ``infer`` returns it.
        """
        if self.device == "cpu":
            return super().warmup()
        import cupy

        stream = self._stream or cupy.cuda.get_current_stream()
        images = self.input_buffer(self.max_batch)
        with stream:
            images.fill(0.5)
        # Every size a partial batch can have, so nothing is captured in the steady state.
        for batch in range(1, self.max_batch):
            self.infer(images[:batch], stream)
        output = self.infer(images, stream)
        stream.synchronize()
        return output

    def close(self) -> None:
        """Drop the graphs and the module."""
        self._graphs.clear()
        self.module = self._forward = None

    def _per_image(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.module(x[i:i + 1]) for i in range(x.shape[0])])

    def _capture(self, batch: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, Any] | None:
        """Capture the graph for ``batch`` images (called on the infer stream); None: failed."""
        import cupy

        x = self._input[:batch]
        current = torch.cuda.current_stream(self._device)
        side = torch.cuda.Stream(self._device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._forward(x)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                output = self._forward(x)
        except RuntimeError as e:
            log.warning("CUDA graph capture failed, running eagerly", error=str(e))
            self.cuda_graphs = False
            return None
        self._graphs[batch] = (graph, output, cupy.from_dlpack(output))
        return self._graphs[batch]
