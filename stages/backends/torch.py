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

**CUDA graphs at bucket sizes.** One graph per bucket (``buckets``, default 2, 4, 8, 16, 24,
32, 40, 48, 56, 64, ... up to ``max_batch``: ``pipeline.config.default_batch_buckets``), all
captured by ``warmup()``. A batch of ``n`` images runs in the graph of the smallest bucket >= ``n``: the
graph also computes the rows past ``n`` (whatever an earlier batch left in the static input)
and ``infer`` returns the first ``n`` rows of its output only, so the padding never reaches
the NMS. Capturing a few buckets instead of every size 1..max_batch is what makes a start
take seconds, at the cost of computing a few padding images. cuDNN's algorithm search
(``torch.backends.cudnn.benchmark``) is left off: on the H200 it cost 1.2 s per bucket at
start for no measurable gain (YOLOv8s 640 FP16 compiled, batch 64: 7,267 images/s with it,
7,240 without, ``python -m benchmarks.startup inference``). All graphs read one static input of ``max_batch``
images (bucket ``B`` reads its first ``B``) and share one memory pool: a graph may reuse
memory that another graph uses for intermediates, so a graph's output is only valid until the
next ``infer`` call, which is the backend contract anyway. The pipeline's preprocess can
write straight into the static input (:meth:`TorchBackend.input_buffer`); ``infer`` then copies
nothing. Captures use ``thread_local`` mode, so other threads' CUDA calls stay legal. A
model whose forward still cannot be captured (an op reading device values on the host) runs
eagerly, with a warning in the log.

**Compiled inference** (``compile=True``). The capture-safe module is compiled with
``torch.compile(backend="inductor")`` in the *default* mode, and our own CUDA graphs capture the
compiled callable per batch size exactly as above (inductor's triton kernels and its calls into
cuDNN are capturable; the side-stream runs before each capture take the compilation, the
autotuning and the kernel loading out of the capture). Not ``mode="reduce-overhead"``: torch's
cudagraph trees copy every input into a placeholder of their own, an extra device copy of the
model input per batch, where our graphs read the static input the preprocess writes, so the
model's input and output are never copied. The batch dimension is marked dynamic
(``torch._dynamo.mark_dynamic``), so one compilation serves batches 2..max_batch; batch 1 is
specialised separately. Before compiling, :func:`make_compile_friendly` bakes the sizes that
onnx2torch's ``Reshape``, ``Split``, ``Resize`` and ``Slice`` read from host tensors (with
``tolist()``, which dynamo cannot trace: a graph break each) into the FX graph as Python numbers
(:func:`bake_host_sizes`): the same torch calls with the same ONNX semantics (a Reshape's 0
copies that input dimension, so a dynamic batch stays dynamic), hence the same outputs, and
dynamo traces YOLOv3-tiny or a YOLOv8 export as a single graph (no graph break), once per
shape variant. A size computed at run time (a ``Reshape`` of a ``Shape``) is still read on the
host, with :class:`SizeListReshape` (onnx2torch's ``Reshape`` fails inside dynamo): a graph
break, and the frames dynamo resumes after it are compiled for the first batch size, then once
more as dynamic at the second. ``warmup()`` therefore captures max_batch first, then the
other buckets in ascending order (the first of them compiles the dynamic graph; batch 1, when
it is a bucket, is specialised and compiled once more). A compilation that fails is logged as a
warning with the reason and the eager module is captured instead.

**Compile cache.** inductor's caches (FX graphs, AOTAutograd, triton kernels) live under
``<cache_dir>/torch-<key>/`` (``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` point there
while the backend compiles, then are restored). The key, like the TensorRT engines', hashes the
ONNX file's sha256, the GPU (name and compute capability), the torch version, the precision,
max_batch and channels_last; ``key.json`` beside the caches records it, and a miss logs which
fields changed. A start with a warm cache still traces the model with dynamo but loads every
compiled graph instead of compiling it. Not cached, hence redone at every start: the ONNX
conversion, dynamo's trace of the module (seconds) and the CUDA graph captures (graphs live in
their process); cuDNN's algorithm search, which torch does not cache on disk, is off (above).
``warmup()`` logs a heartbeat every few seconds while it compiles and one ``model ready`` line
with ``seconds`` (construction and warm-up), ``cache="hit"`` (every compiled graph came from
the cache) or ``"miss"``, ``cache_counts`` (the FX graph and AOTAutograd caches' hits,
misses and bypasses during the warm-up: a miss says which), ``compiled``, ``buckets``,
``capture_s`` (the seconds each bucket took to compile or load and capture) and ``build_s``
(converting the ONNX, moving it to the device).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import operator
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx2torch
import structlog
import torch
from onnx2torch.node_converters.constant import OnnxConstant
from onnx2torch.node_converters.reshape import OnnxReshape
from onnx2torch.node_converters.shape import OnnxShape
from onnx2torch.utils.common import OnnxToTorchModule
from torch import fx, nn

from pipeline.config import default_batch_buckets
from stages.backends.base import InferenceBackend, ModelInfo

log = structlog.get_logger("torch")

PRECISIONS = ("fp16", "fp32")
WARMUP_RUNS = 3  # eager runs on a side stream before a capture (cuDNN autotuning, workspaces)
HEARTBEAT_SECONDS = 5.0  # log interval while warm-up compiles
NO_GPU = "no-gpu"
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
    return _recompiled(module)


def _recompiled(module: fx.GraphModule) -> fx.GraphModule:
    """``module`` after a graph rewrite: checked, unused submodules dropped, code regenerated."""
    module.graph.lint()
    module.delete_all_unused_submodules()
    module.recompile()
    return module


def convert(model_path: str | Path) -> fx.GraphModule:
    """The ONNX model as a capture-safe torch module (fp32, CPU, eval mode)."""
    return make_capture_safe(onnx2torch.convert(str(model_path))).eval()


def prepare_module(model_path: str | Path, compile: bool) -> fx.GraphModule:
    """What :class:`TorchBackend` does before it touches the GPU, done ahead: the ONNX model
    converted (:func:`convert`; made compile-friendly when ``compile``) and, when compiling,
    dynamo imported (``torch.compile`` imports it: seconds). A standby engine
    (``pipeline.app.engine``) calls this while the engine it will replace still serves, and
    hands the module to ``TorchBackend(module=...)`` when it takes over."""
    if compile:
        import torch._dynamo  # noqa: F401 - imported ahead
    module = convert(model_path)
    if compile:
        make_compile_friendly(module)
    return module


class SizeListReshape(nn.Module):
    """ONNX ``Reshape`` (allowzero=0) reading its shape as a list of ints, which dynamo traces.

    onnx2torch's ``OnnxReshape`` builds ``torch.Size`` from a list of 0-d tensors, which fails
    inside dynamo; this reads the host shape with ``tolist()`` (a graph break, no GPU work). Used
    only for a shape computed at run time (from a ``Shape``); a constant shape is baked in by
    :func:`bake_host_sizes`.
    """

    def forward(self, input_tensor: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
        dims = shape.tolist()
        return torch.reshape(input_tensor, [input_tensor.shape[i] if d == 0 else d
                                            for i, d in enumerate(dims)])


def onnx_reshape(input_tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """ONNX ``Reshape`` (allowzero=0) to a shape of Python ints: a 0 copies the input's dimension
    at that index (the batch of a dynamic-batch export), a -1 is inferred."""
    return torch.reshape(input_tensor, [input_tensor.shape[i] if d == 0 else d
                                        for i, d in enumerate(shape)])


def onnx_resize_to(input_tensor: torch.Tensor, sizes: tuple[int, ...], mode: str,
                   align_corners: bool | None, check_batch_channels: bool) -> torch.Tensor:
    """ONNX ``Resize`` to ``sizes`` (all dimensions, as in ONNX), as onnx2torch's ``OnnxResize``."""
    if check_batch_channels and list(input_tensor.shape[:2]) != list(sizes[:2]):
        raise NotImplementedError("Pytorch's interpolate cannot resize channel or batch dimensions.")
    return nn.functional.interpolate(input_tensor, size=list(sizes[2:]), mode=mode,
                                     align_corners=align_corners)


def _host_list(value: Any) -> list | None:
    """A host size value as a Python list (``tolist()``); None for a missing or empty one."""
    if value is None:
        return None
    value = torch.as_tensor(value)
    return value.tolist() if value.numel() else None


def _plain(value: Any) -> Any:
    """A slice bound or axis from onnx2torch's ``_get_slices`` (0-d tensor, NumPy scalar) as int."""
    return None if value is None else int(value)


def _baked_calls(mod: nn.Module, sizes: dict[str, Any]) -> list[tuple[Any, tuple, dict]] | None:
    """The torch calls, with Python-number sizes, that do what ``mod`` does with these host
    ``sizes`` (its size parameters); None where ``mod`` is not one we bake.

    Each call is (function, args after the data input, kwargs); calls chain, each taking the
    previous one's output as its first argument.
    """
    from onnx2torch.node_converters.resize import _MODES_MAPPING, OnnxResize, OnnxResizeV10
    from onnx2torch.node_converters.slice import OnnxSlice, _get_slices
    from onnx2torch.node_converters.split import OnnxSplit13

    if isinstance(mod, (OnnxReshape, SizeListReshape)):
        shape = tuple(int(d) for d in torch.as_tensor(sizes["shape"]).tolist())
        if 0 in shape:
            return [(onnx_reshape, (shape,), {})]
        return [(torch.reshape, (shape,), {})]
    if isinstance(mod, OnnxSplit13) and sizes.get("split") is not None:
        return [(torch.split, ([int(d) for d in torch.as_tensor(sizes["split"]).tolist()],),
                 {"dim": mod.axis})]
    if isinstance(mod, OnnxResizeV10):
        mod, sizes = mod._resize, {"scales": sizes["scales"]}
    if isinstance(mod, OnnxResize):
        roi, scales, target = (_host_list(sizes.get(k)) for k in ("roi", "scales", "sizes"))
        if roi is not None and not mod.ignore_roi:
            return None  # onnx2torch raises NotImplementedError: leave it to
        if target is not None and scales is not None:
            return None  # interpolate refuses both: leave the error to onnx2torch
        spatial = len(target or scales or []) - 2
        mode = _MODES_MAPPING.get((mod.onnx_mode, spatial))
        if mode is None:
            return None
        if target is not None:
            return [(onnx_resize_to, (tuple(int(d) for d in target), mode, mod.align_corners,
                                      not mod.ignore_bs_ch_size), {})]
        if scales is None or scales[:2] != [1, 1]:
            return None
        return [(nn.functional.interpolate, (), {"size": None, "scale_factor": scales[2:],
                                                  "mode": mode,
                                                  "align_corners": mod.align_corners})]
    if isinstance(mod, OnnxSlice):
        tensors = {k: None if sizes.get(k) is None else torch.as_tensor(sizes[k])
                   for k in ("starts", "ends", "axes", "steps")}
        flip, positive, negative = _get_slices(tensors["starts"], tensors["ends"], tensors["axes"],
                                               tensors["steps"])
        calls: list[tuple[Any, tuple, dict]] = []
        if flip:
            calls.append((torch.flip, (), {"dims": [int(d) for d in flip]}))
        for index in (positive, negative):
            if index:
                calls.append((operator.getitem, (tuple(
                    i if i is Ellipsis else slice(_plain(i.start), _plain(i.stop), _plain(i.step))
                    for i in index),), {}))
        return calls
    return None


def bake_host_sizes(module: fx.GraphModule) -> fx.GraphModule:
    """Replace onnx2torch's Reshape, Split, Resize and Slice, where their sizes are host constants
    (after :func:`make_capture_safe`), by torch calls with those sizes as Python numbers in the
    FX graph; ``module`` in place.

    onnx2torch's modules read their sizes from tensors (``tolist()``), which dynamo cannot trace:
    every one is a graph break. The calls are the ones onnx2torch's modules make (same ONNX
    semantics: a Reshape's 0 copies the input's dimension, -1 is inferred), so the outputs are
    identical. Host values computed from constants only (arithmetic on constants) are evaluated
    once here; sizes computed at run time (from a ``Shape``) stay as they are.
    """
    modules = dict(module.named_modules())
    graph = module.graph
    known: dict[fx.Node, Any] = {}  # host nodes whose value is a constant
    for node in list(graph.nodes):
        mod = modules.get(node.target) if node.op == "call_module" else None
        if isinstance(mod, HostConstant):
            known[node] = mod.value
            continue
        inputs = node.all_input_nodes
        if node.op not in ("call_module", "call_function") or not inputs:
            continue
        if all(i in known for i in inputs):  # host arithmetic on constants: fold it
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: known[n])
            try:
                known[node] = (mod if mod is not None else node.target)(*args, **kwargs)
            except Exception:  # noqa: BLE001 - not foldable here; it runs as before
                pass
            continue
        if mod is None:
            continue
        try:
            bound = inspect.signature(mod.forward).bind(*node.args, **node.kwargs).arguments
        except TypeError:
            continue
        data = list(bound.values())[0]
        sizes = {name: arg for name, arg in bound.items() if name in SHAPE_PARAMETERS}
        if not sizes or not isinstance(data, fx.Node) or data in sizes.values() or not all(
                arg is None or isinstance(arg, fx.Node) and arg in known for arg in sizes.values()):
            continue
        calls = _baked_calls(mod, {name: None if arg is None else known[arg]
                                   for name, arg in sizes.items()})
        if calls is None:
            continue
        with graph.inserting_before(node):
            value = data
            for function, args, kwargs in calls:
                value = graph.call_function(function, (value, *args), kwargs)
        node.replace_all_uses_with(value)
        graph.erase_node(node)
    for node in reversed(list(known)):  # constants and folded values nothing reads any more
        if not node.users:
            graph.erase_node(node)
    return _recompiled(module)


def make_compile_friendly(module: fx.GraphModule) -> fx.GraphModule:
    """Make a capture-safe module traceable by dynamo without graph breaks; ``module`` in place.

    Constant sizes are baked into the graph (:func:`bake_host_sizes`); a Reshape whose shape is
    computed at run time gets :class:`SizeListReshape` (onnx2torch's fails inside dynamo).
    """
    bake_host_sizes(module)
    for name, sub in list(module.named_modules()):
        if isinstance(sub, OnnxReshape):
            module.add_submodule(name, SizeListReshape())
    return module


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def gpu_target(device: torch.device | None) -> str:
    """``"<name> sm_<major><minor>"`` of a CUDA device (as the TensorRT engine keys), else NO_GPU."""
    if device is None or device.type != "cuda":
        return NO_GPU
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"


@dataclass(frozen=True)
class CompileKey:
    """Everything the compiled artefacts depend on: a cache folder is reused only for an equal key."""

    model_sha256: str
    gpu: str
    torch_version: str
    precision: str
    max_batch: int
    channels_last: bool

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def folder(self, cache_dir: str | Path) -> Path:
        """``<cache_dir>/torch-<digest>``: where the compile caches for this key live."""
        return Path(cache_dir) / f"torch-{self.digest()}"


def compile_cache_key(model_path: str | Path, gpu: str, precision: str, max_batch: int,
                      channels_last: bool, torch_version: str | None = None) -> CompileKey:
    """The compile cache key of a model and settings (``torch_version``: None for this torch)."""
    return CompileKey(file_sha256(model_path), gpu, torch_version or torch.__version__, precision,
                      max_batch, channels_last)


def _miss_reason(cache_dir: Path, model_name: str, key: CompileKey) -> str:
    """Which key fields differ from the newest compile cache recorded for the same model name."""
    records = sorted(cache_dir.glob("torch-*/key.json"), key=lambda p: p.stat().st_mtime)
    for record in reversed(records):
        try:
            old = json.loads(record.read_text())
        except (OSError, ValueError):
            continue
        if old.get("model") != model_name:
            continue
        changed = [f"{k} {old.get(k)!r} -> {v!r}" for k, v in asdict(key).items()
                   if old.get(k) != v]
        return "key changed: " + ", ".join(changed)
    return f"no compile cache for {model_name} in {cache_dir} yet"


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block, then restore them."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


CACHE_COUNTERS = (("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
                  ("inductor", "fxgraph_cache_bypass"), ("aot_autograd", "autograd_cache_hit"),
                  ("aot_autograd", "autograd_cache_miss"),
                  ("aot_autograd", "autograd_cache_bypass"))


def _cache_counters() -> dict[str, int]:
    """Hits, misses and bypasses of inductor's FX graph and AOTAutograd caches so far in this
    process, by torch's counter name."""
    from torch._dynamo.utils import counters

    return {name: counters[group][name] for group, name in CACHE_COUNTERS}


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
        channels_last: run convolutions in NHWC memory layout (often faster with FP16); None:
            on when compiling, else off. The static input stays NCHW either way.
        compile: compile the module with ``torch.compile`` (inductor, default mode) before
            capturing the graphs; the compilation happens in ``warmup()`` (or at the first
            ``infer`` of a batch size). On the CPU (tests) inductor generates C++ and needs a
            compiler.
        cache_dir: folder of the compile caches (``torch-<key>/`` in it, created when missing);
            None: inductor's default cache folder.
        buckets: the batch sizes captured as CUDA graphs (each 1..max_batch; max_batch is
            added); None: ``default_batch_buckets(max_batch)``.
        module: the model as :func:`prepare_module` (with the same ``compile``) gave it, on
            the host in fp32; None: converted here.

    Raises:
        ValueError: an unknown precision or device; "int8" (only the tensorrt backend has it).
    """

    name = "torch"

    def __init__(self, model_path: str | Path, info: ModelInfo, max_batch: int, precision: str,
                 gpu: Any, *, device: str = "cuda", cuda_graphs: bool = True,
                 channels_last: bool | None = None, compile: bool = False,
                 cache_dir: str | Path | None = None, buckets: Sequence[int] | None = None,
                 module: fx.GraphModule | None = None) -> None:
        started = time.perf_counter()
        super().__init__(info, max_batch)
        if buckets is not None and (not buckets or min(buckets) < 1 or max(buckets) > max_batch):
            raise ValueError(f"torch backend: buckets must be batch sizes 1..{max_batch}, "
                             f"got {list(buckets)}")
        self.buckets = (default_batch_buckets(max_batch) if buckets is None
                        else sorted({*buckets, max_batch}))
        # batch size n -> the bucket whose graph runs it (the smallest bucket >= n)
        self._bucket_of = [0] + [next(b for b in self.buckets if b >= n)
                                 for n in range(1, max_batch + 1)]
        self.capture_seconds: dict[int, float] = {}  # bucket -> seconds warmup() spent on it
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
        else:
            self._device = torch.device("cpu")
        self.compile = compile
        self.channels_last = self.compile if channels_last is None else channels_last
        begun = time.perf_counter()
        if module is None:
            module = prepare_module(model_path, self.compile)
        converted = time.perf_counter()
        module = module.to(self._device, self._dtype)
        self.module = module.to(memory_format=torch.channels_last) if self.channels_last else module
        # A model with a fixed batch of 1 runs image by image (inside the same graph).
        self._forward = self.module if info.dynamic_batch else self._per_image
        self._compiled: Any = None  # the torch.compile'd forward; None: eager
        self.compiled = False  # the graphs run compiled code (False after a failed compilation)
        self.cache_hit: bool | None = None  # set by warmup() when compiling
        self.ready_seconds: float | None = None  # construction and warm-up, set by warmup()
        self._cache_env: dict[str, str] = {}
        self._cache_folder: Path | None = None
        self.cache_key: CompileKey | None = None
        # where a start's seconds go: ONNX to torch, then the weights to the device
        self.build_seconds = {"convert": round(converted - begun, 2),
                              "to_device": round(time.perf_counter() - converted, 2)}
        if self.compile:
            # A fixed-batch model compiles its batch-1 module, called image by image.
            self._compiled = torch.compile(self.module, backend="inductor")
            self.compiled = True
            self.cache_key = compile_cache_key(model_path, gpu_target(self._device), precision,
                                               max_batch, self.channels_last)
            if cache_dir is not None:
                self._cache_folder = self.cache_key.folder(cache_dir)
                self._open_cache(Path(model_path).name)
        shape = (max_batch, 3, info.input_height, info.input_width)
        self._input = torch.empty(shape, dtype=self._dtype, device=self._device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, Any]] = {}
        if device == "cuda":
            import cupy

            self._input_array = cupy.from_dlpack(self._input)
            self._pool = torch.cuda.graph_pool_handle()
        else:
            self._input_array = self._input.numpy()
        self._init_seconds = time.perf_counter() - started

    def _open_cache(self, model_name: str) -> None:
        """Point inductor's and triton's caches at this key's folder; log whether it exists."""
        folder, key = self._cache_folder, self.cache_key
        record = folder / "key.json"
        if record.exists():
            log.info("using cached torch compile artefacts", path=str(folder))
        else:
            log.info("no cached torch compile artefacts match; compiling takes a while",
                     path=str(folder), reason=_miss_reason(folder.parent, model_name, key))
        folder.mkdir(parents=True, exist_ok=True)
        self._record = {"model": model_name, **asdict(key)}  # written once warm-up compiled
        device = str(self._device.index or 0)
        self._cache_env = {"TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"),
                           "TRITON_CACHE_DIR": str(folder / "triton" / device)}

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
            CuPy view of the first B rows of the static output of the graph of B's bucket,
            written on ``stream`` and valid until the next call. cpu: a NumPy array.
        """
        batch = images.shape[0]
        expected = (3, self.info.input_height, self.info.input_width)
        if not 1 <= batch <= self.max_batch or tuple(images.shape[1:]) != expected:
            raise ValueError(f"torch backend: images must be (1..{self.max_batch}, {expected[0]}, "
                             f"{expected[1]}, {expected[2]}), got {tuple(images.shape)}")
        if self.device == "cpu":
            with _environment(self._cache_env):
                return self._run(torch.from_numpy(np.asarray(images)).to(self._dtype)).numpy()
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
                bucket = self._bucket_of[batch]  # its rows past `batch` are padding
                captured = self._graphs.get(bucket) or self._capture(bucket)
                if captured is not None:  # None: the capture failed, graphs are now off
                    captured[0].replay()
                    return captured[2][:batch]
            with _environment(self._cache_env):
                return cupy.from_dlpack(self._run(x.to(self._dtype)))

    def warmup(self) -> Any:
        """Compile (``compile=True``) and capture the graph of every bucket (or run once
        eagerly), so neither the first frame nor a partial batch later pays for a compilation
        or a capture; logs ``model ready`` (seconds, cache hit or miss, compiled, buckets and
        each bucket's seconds).

        Returns:
            The output of that run, (max_batch, 4 + classes, anchors), as ``infer`` returns it.
        """
        started = time.perf_counter()
        before = _cache_counters()
        # On the CPU (no graphs): compile at max_batch, 2 (frames after graph breaks turn
        # dynamic) and 1 (specialised), the sizes a partial batch can meet.
        first = [b for b in (self.max_batch, 2, 1) if b <= self.max_batch] if self.compile else []
        with self._heartbeat():
            if self.device == "cpu":
                images = np.full((self.max_batch, *self._input.shape[1:]), 0.5, self.input_dtype)
                for batch in first:
                    self.infer(images[:batch])
                output = self.infer(images)
            else:
                import cupy

                stream = self._stream or cupy.cuda.get_current_stream()
                images = self.input_buffer(self.max_batch)
                with stream:
                    images.fill(0.5)
                # max_batch first (the first compilation), then the others ascending (the
                # first of them compiles the dynamic graph): every graph a batch can need.
                for bucket in [self.max_batch, *self.buckets[:-1]]:
                    begun = time.perf_counter()
                    self.infer(images[:bucket], stream)
                    stream.synchronize()
                    self.capture_seconds[bucket] = round(time.perf_counter() - begun, 2)
                output = self.infer(images, stream)
                stream.synchronize()
        after = _cache_counters()
        counts = {name.replace("_cache", ""): after[name] - before[name]
                  for name in after if after[name] != before[name]}
        self.cache_hit = (self.compiled and not counts.get("fxgraph_miss")
                          and counts.get("fxgraph_hit", 0) + counts.get("autograd_hit", 0) > 0)
        if self.compiled and self._cache_folder is not None:
            record = self._cache_folder / "key.json"
            if not record.exists():
                record.write_text(json.dumps(self._record, indent=1))
        self.ready_seconds = self._init_seconds + time.perf_counter() - started
        log.info("model ready", seconds=round(self.ready_seconds, 1),
                 cache="hit" if self.cache_hit else "miss", compiled=self.compiled,
                 cache_counts=counts or None,
                 cuda_graphs=self.cuda_graphs, max_batch=self.max_batch,
                 buckets=self.buckets if self.cuda_graphs else None,
                 capture_s=self.capture_seconds or None, build_s=self.build_seconds)
        return output

    @contextlib.contextmanager
    def _heartbeat(self) -> Iterator[None]:
        """Log every HEARTBEAT_SECONDS while the block runs (compiling takes tens of seconds)."""
        if not self.compile:
            yield
            return
        done, started = threading.Event(), time.perf_counter()

        def beat() -> None:
            while not done.wait(HEARTBEAT_SECONDS):
                log.info("compiling the model", seconds=round(time.perf_counter() - started),
                         buckets_captured=len(self._graphs), buckets=len(self.buckets))

        thread = threading.Thread(target=beat, name="torch-compile-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def close(self) -> None:
        """Drop the graphs and the module."""
        self._graphs.clear()
        self.module = self._forward = self._compiled = None

    def _per_image(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.module(x[i:i + 1]) for i in range(x.shape[0])])

    def _call(self, x: torch.Tensor) -> torch.Tensor:
        """The compiled forward (the batch dimension marked dynamic), or the eager one."""
        if self._compiled is None:
            return self._forward(x)
        if not self.info.dynamic_batch:
            return torch.cat([self._compiled(x[i:i + 1]) for i in range(x.shape[0])])
        if x.shape[0] > 1:  # batch 1 specialises: a size-1 dimension cannot be marked dynamic
            torch._dynamo.mark_dynamic(x, 0)
        return self._compiled(x)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        """``_call``, falling back to the eager module (with a warning) when compiling fails."""
        if self._compiled is not None:
            try:
                return self._call(x)
            except Exception as e:  # dynamo, inductor or triton: any failure means eager
                self._drop_compiled("torch.compile failed, running the eager module", e)
        return self._forward(x)

    def _drop_compiled(self, message: str, error: BaseException) -> None:
        log.warning(message, error=f"{type(error).__name__}: {error}"[:2000])
        self._compiled = None
        self.compiled = False  # graphs captured already keep their (working) compiled kernels

    def _capture(self, batch: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, Any] | None:
        """Capture the graph for ``batch`` images (called on the infer stream); None: failed."""
        import cupy

        x = self._input[:batch]
        current = torch.cuda.current_stream(self._device)
        side = torch.cuda.Stream(self._device)
        side.wait_stream(current)
        with _environment(self._cache_env), torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):  # compiles here, never inside the capture
                self._run(x)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                output = self._call(x)
        except Exception as e:
            if self._compiled is not None:  # try the eager module before giving graphs up
                self._drop_compiled("CUDA graph capture of the compiled module failed, "
                                    "capturing the eager module", e)
                return self._capture(batch)
            log.warning("CUDA graph capture failed, running eagerly", error=str(e))
            self.cuda_graphs = False
            return None
        self._graphs[batch] = (graph, output, cupy.from_dlpack(output))
        return self._graphs[batch]
