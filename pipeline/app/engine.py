"""The engine: one process per GPU (or one on the CPU path) that holds the model and serves
every source worker of that GPU (DESIGN.md v3; the rings and messages: ``pipeline.engine_link``).

```
workers --SUBMIT rows--> intake thread: rows -> frames of the rings -> batcher (across ALL
                         workers' cameras) -> infer (preprocess into the model's input
                         binding, the model, NMS in place: queued on the GPU)
                     --> reply thread: postprocess (one wait, one D2H) -> per worker one
                         RESULTS message with its frames' detections
```

Per-frame Python here is only making the batcher's ``Frame`` records; everything else is
per batch. The model is loaded, compiled (or read from the warm cache) and warmed once, at
start: workers that connect before then wait for the READY answer.

A worker that goes away (killed) is forgotten: its frames still in a batch are computed
and their results dropped; a restarted worker connects again under a new source id, so
results can never reach the wrong process. The engine itself keeps no state a restart
would need: the supervisor restarts it, its workers reconnect and send again what it
never answered.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from pipeline.app.leftovers import temp_folder
from pipeline.app.workers import exit_text, start_shielded
from pipeline.config import PipelineConfig
from pipeline.engine_link import BYE, HELLO, READY, SUBMIT_DTYPE, DeviceRing, EngineLink
from pipeline.metrics import StageMetrics
from pipeline.records import Frame, ModelOutputs
from pipeline.slots import SlotRing

log = structlog.get_logger("engine")

IDLE_WAIT_S = 0.05  # the longest the intake waits for input when no batch is pending
SUMMARY_EVERY_S = 10.0
REPLY_QUEUE = 2  # batches between the infer and reply threads (with 3 batch sets)


@dataclass(frozen=True)
class ConnectedWorker:
    """A source worker connected to the engine (its HELLO).

    Attributes:
        conn: its connection (SUBMIT rows in, RESULTS out).
        worker: its number among the engine's workers (its ring shares).
        source: its source id in the batcher (a worker is one batcher source: its frames'
            detections go back to it).
        pid: its process id (None: an older worker's HELLO without it).
    """

    conn: Connection
    worker: int
    source: int
    pid: int | None


class Engine:
    """The model of one GPU serving its workers (module docstring).

    Args:
        config: the run's configuration (model, inference, nms; the sources only size the
            preprocess geometries of the files).
        link: the rings and address shared with the workers.
        on_gone: called with (worker number, pid) for a worker whose connection closed
            without a bye.
        prepared: what ``stages.infer.prepare_backend`` gave ahead (a standby's), or None.
    """

    def __init__(self, config: PipelineConfig, link: EngineLink,
                 on_gone: Callable[[int, int | None], None] | None = None,
                 prepared: Any = None) -> None:
        self.config, self.link, self.prepared = config, link, prepared
        self.on_gone = on_gone  # (worker number, pid): its connection closed without a bye
        self.stop = threading.Event()
        self.failed = False  # a thread failed: the process exits with status 1
        self.ready = threading.Event()
        self.metrics = {name: StageMetrics(name) for name in ("batch", "infer", "postprocess")}
        self._workers: dict[Connection, ConnectedWorker] = {}  # the connected ones
        self._lock = threading.Lock()
        self._listener: Listener | None = None
        self._device_ring: DeviceRing | None = None
        self._replies: queue.Queue[ModelOutputs | None] = queue.Queue(REPLY_QUEUE)

    # -- build ------------------------------------------------------------------------------
    def build(self) -> None:
        """Load the model, allocate every buffer, warm up (compile or read the cache)."""
        from pipeline.app.build import create_gpu_context, first_file_source, model_setup
        from stages.batcher import BatcherStage, DetectionSchedule
        from stages.infer import InferStage, create_backend, prepare_backend
        from stages.postprocess import DeviceNms, PostprocessStage
        from stages.preprocess import DevicePreprocess, HostPreprocess

        started = time.monotonic()
        phases: dict[str, float] = {}  # where the start's seconds go (the log's "phases_s")

        def phase(name: str) -> None:
            phases[name] = max(0.0, round(time.monotonic() - started - sum(phases.values()), 2))

        config, link, inference = self.config, self.link, self.config.inference
        info = model_setup(config).info
        phase("model_setup")
        if self.prepared is None:
            # Before the GPU's context, in the order a standby does it (prepare_standby). On
            # the H200 a standby, which had converted its model first where its engine had
            # not, missed the engine's warm compile cache (cache_counts fxgraph_miss 1: 17 s
            # compiling again); in this order it hit (results-h200.md, fourteenth session).
            # What in inductor's cache key the order changed was not found.
            self.prepared = prepare_backend(inference, Path(config.model.path),
                                            link.device is not None)
            phase("prepare")
        self.gpu = gpu = create_gpu_context(config)
        phase("gpu")
        self.ring = SlotRing.attach(link.host_ring, link.host_slots, link.slot_bytes, [])
        if gpu is not None:
            self.ring.pin()
            if link.device_share:
                self._device_ring = DeviceRing.allocate(link.device_share * link.workers,
                                                        link.slot_bytes)
        phase("rings")
        backend = create_backend(inference, Path(config.model.path), info, gpu,
                                 first_file_source(config), self.prepared)
        self.prepared = None  # (the backend holds it now)
        phase("backend")
        size = (info.input_height, info.input_width)
        self.batcher = BatcherStage("batch", size, inference.batch_size,
                                    inference.batch_timeout_ms, (), gpu, self.ring, self.stop,
                                    DetectionSchedule([], []))
        if gpu is None:
            self.infer = InferStage("infer", backend, HostPreprocess(size, info.input_dtype,
                                                                    inference.batch_size))
        else:
            from pipeline.app.build import BATCH_SETS, DEFAULT_FRAME_SIZE

            gpu.allocate(BATCH_SETS, inference.batch_size, link.slot_bytes,
                         config.nms.max_detections)
            warm = [(self.batcher.letterbox(*DEFAULT_FRAME_SIZE), fmt) for fmt in ("i420", "nv12")]
            self.infer = InferStage("infer", backend, DevicePreprocess(warm), gpu,
                                    DeviceNms(config.nms, inference.batch_size, info.layout))
        self.postprocess = PostprocessStage("postprocess", config.nms, gpu, None, info.layout)
        phase("buffers")
        for stage in (self.batcher, self.infer, self.postprocess):
            stage.open()
        phase("warmup")
        log.info("engine ready", seconds=round(time.monotonic() - started, 1), phases_s=phases,
                 pid=os.getpid(),
                 workers=link.workers, device_ring=self._device_ring is not None,
                 batch_size=inference.batch_size)

    # -- serve ------------------------------------------------------------------------------
    def listen(self) -> None:
        """Open the workers' socket (before ``build``: they connect and wait for READY). A
        socket file left at the address is removed first: the address is this engine's
        alone (its supervisor's folder), so one there was left by its predecessor, killed
        before it could unlink it (``kill -9``), and would make the bind fail."""
        try:
            os.unlink(self.link.address)
        except FileNotFoundError:
            pass
        self._listener = Listener(self.link.address, "AF_UNIX", authkey=self.link.authkey)

    def serve(self) -> None:
        """Answer workers until ``stop``; returns once every thread ended."""
        self.ready.set()
        threads = [threading.Thread(target=target, name=f"engine:{name}", daemon=True)
                   for name, target in (("accept", self._accept), ("intake", self._intake),
                                        ("reply", self._reply))]
        for thread in threads:
            thread.start()
        last = time.monotonic()
        while not self.stop.wait(1.0):
            if time.monotonic() - last >= SUMMARY_EVERY_S:
                last = time.monotonic()
                self.log_summary()
        for thread in threads[1:]:
            thread.join(5.0)

    def log_summary(self) -> None:
        """One "engine stages" line: each stage's counters since the engine started (read
        from the log by ``pipeline.app.run_log``; the pid tells engines and restarts apart)."""
        infer = self.metrics["infer"]
        log.info("engine stages", pid=os.getpid(), workers=len(self._workers),
                 batches=infer.calls, mean_batch=round(infer.frames / max(1, infer.calls), 1),
                 **{name: m.summary() for name, m in self.metrics.items()})

    def close(self) -> None:
        self.stop.set()
        if self._listener is not None:
            self._listener.close()
        for stage in ("batcher", "infer", "postprocess"):
            if hasattr(self, stage):
                try:
                    getattr(self, stage).close()
                except Exception as error:  # noqa: BLE001 - closing anyway
                    log.warning("closing a stage failed", stage=stage, error=str(error))
        if self._device_ring is not None:
            self._device_ring.close()
        if hasattr(self, "ring"):
            self.ring.unpin()
            self.ring.close_view()

    def _accept(self) -> None:
        """Take worker connections: each says HELLO with its number and gets READY with
        the device ring's IPC handle (None on the CPU path)."""
        handle = None if self._device_ring is None else self._device_ring.handle
        while not self.stop.is_set():
            try:
                conn = self._listener.accept()
                kind, worker, *pid = conn.recv()
            except (OSError, EOFError):
                if self.stop.is_set():
                    return
                continue
            if kind != HELLO:
                conn.close()
                continue
            with self._lock:
                source = self.batcher.add_source(f"worker{worker}")
                self._workers[conn] = ConnectedWorker(conn, worker, source,
                                                      pid[0] if pid else None)
            conn.send((READY, handle))
            log.info("worker connected", worker=worker, source_id=source)

    def _forget(self, conn: Connection, said_bye: bool = False) -> None:
        """A worker's connection ended: said bye (its graph finished), or closed without a
        word (it died: ``on_gone`` tells the supervisor at once, where its exit status can
        take most of a second to come)."""
        with self._lock:
            gone = self._workers.pop(conn, None)
        conn.close()
        if gone is None:
            return
        log.info("worker gone", worker=gone.worker, pid=gone.pid, said_bye=said_bye)
        if not said_bye and self.on_gone is not None and not self.stop.is_set():
            self.on_gone(gone.worker, gone.pid)

    def _intake(self) -> None:
        """Rows in, frames to the batcher, batches onto the GPU."""
        try:
            while not self.stop.is_set():
                with self._lock:
                    conns = list(self._workers)
                timeout = self.batcher.poll_interval_s
                timeout = IDLE_WAIT_S if timeout is None else timeout
                if conns:
                    ready = wait(conns, timeout)
                else:
                    self.stop.wait(timeout)
                    ready = []
                started = time.perf_counter()
                blocked = self.batcher.blocked_s
                batches, frames = [], 0
                for conn in ready:
                    try:
                        data = conn.recv_bytes()
                    except (EOFError, OSError):
                        self._forget(conn)
                        continue
                    if data == BYE:  # its graph finished
                        self._forget(conn, said_bye=True)
                        continue
                    rows = np.frombuffer(data, SUBMIT_DTYPE)
                    sender = self._workers.get(conn)
                    if sender is None:
                        continue
                    frames += len(rows)
                    for frame in self._frames(sender.source, rows):
                        batches += self.batcher.process(frame)
                if not ready:
                    batches += self.batcher.on_idle()
                self.metrics["batch"].record(frames, time.perf_counter() - started
                                             - (self.batcher.blocked_s - blocked),
                                             self.batcher.blocked_s - blocked)
                for batch in batches:
                    started = time.perf_counter()
                    outputs = list(self.infer.process(batch))
                    self.metrics["infer"].record(len(batch), time.perf_counter() - started, 0.0)
                    for item in outputs:
                        self._put_reply(item)
        except InterruptedError:
            if not self.stop.is_set():
                log.error("engine intake interrupted")
                self.failed = True
                self.stop.set()
        except Exception as error:  # noqa: BLE001 - the engine fails as a whole
            log.error("engine intake failed", error=f"{type(error).__name__}: {error}")
            self.failed = True
            self.stop.set()
        finally:
            self._put_reply(None)

    def _put_reply(self, item: ModelOutputs | None) -> None:
        while True:
            try:
                self._replies.put(item, timeout=0.1)
                return
            except queue.Full:
                if self.stop.is_set() and item is not None:
                    return

    def _frames(self, source: int, rows: np.ndarray) -> list[Frame]:
        """The batcher's records of one worker's SUBMIT rows: ``index`` is the row's token;
        a host slot's image is the ring's view (the CPU path reads it), a device slot's
        planes are views of the device ring."""
        name = self.batcher.source_names[source]
        ring, device_ring, on_cpu = self.ring, self._device_ring, self.gpu is None
        frames = []
        for token, host_slot, device_slot, width, height in rows.tolist():
            if device_slot >= 0:
                frames.append(Frame(name, token, None, 0.0, width, height, pixel_format="nv12",
                                    device_planes=device_ring.planes(device_slot, width, height)))
            else:
                frames.append(Frame(name, token, None, 0.0, width, height, slot=host_slot,
                                    image=ring.image(host_slot, width, height) if on_cpu
                                    else None))
        return frames

    def _reply(self) -> None:
        """Detections out: one RESULTS message per worker of each batch."""
        while True:
            item = self._replies.get()
            if item is None:
                return
            started = time.perf_counter()
            blocked = self.postprocess.blocked_s
            try:
                detections = next(iter(self.postprocess.process(item)))
            except Exception as error:  # noqa: BLE001 - the engine fails as a whole
                log.error("engine postprocess failed", error=f"{type(error).__name__}: {error}")
                self.failed = True
                self.stop.set()
                return
            frames = detections.frames
            source = frames.source
            with self._lock:
                conn_of = {worker.source: worker.conn for worker in self._workers.values()}
            for source_id in np.unique(source).tolist():
                conn = conn_of.get(source_id)
                if conn is None:
                    continue  # its worker went away
                rows = np.flatnonzero(source == source_id)
                part = detections if len(rows) == len(source) else detections.select(rows)
                try:
                    conn.send((part.frames.index, part.offsets, part.xyxy, part.confidence,
                               part.class_id))
                except (OSError, ValueError):
                    pass  # it went away: the intake forgets it
            waited = self.postprocess.blocked_s - blocked
            self.metrics["postprocess"].record(len(frames), time.perf_counter() - started
                                               - waited, waited)


def engine_main(config: PipelineConfig, link: EngineLink, device: int | None,
                conn: Connection, standby: bool = False) -> None:
    """The engine's process: build, tell the supervisor (``("ready", seconds)`` or
    ``("failed", reason, usage)``), serve until told ``("exit",)`` or the supervisor's end
    of ``conn`` closes.

    A standby (``standby``) first does what needs no GPU (``prepare_standby``), says
    ``("prepared", ...)`` and waits: told ``("go",)`` (its engine died), it goes on as
    the engine, from the GPU's context on; told ``("exit",)``, or its pipe's end closing, it
    ends, having touched no GPU.

    Args:
        device: the GPU (seen as device 0 here: ``CUDA_VISIBLE_DEVICES``), or None.
    """
    from pipeline.app.workers import name_this_process
    from pipeline.config import ConfigError
    from pipeline.logging import configure_logging, register_stack_dump
    from stages.infer import BackendUnavailable

    if device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(device)
        config.inference.gpu_id = 0
    name_this_process(engine_name(device, "standby" if standby else "engine"))
    register_stack_dump()  # kill -USR1: every thread's stack
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(config.runtime.log_format, config.runtime.log_level)
    prepared = None
    if standby:
        prepared = prepare_standby(config, link, conn)
        if prepared is STANDBY_ENDS:
            return
        name_this_process(engine_name(device))
    telling = threading.Lock()  # the serving threads and this one send on ``conn``

    def tell_gone(worker: int, pid: int | None) -> None:
        try:
            with telling:
                conn.send(("gone", worker, pid))
        except OSError:
            pass  # the supervisor is gone: so are we, soon

    engine = Engine(config, link, on_gone=tell_gone, prepared=prepared)
    started = time.monotonic()
    try:
        engine.listen()
        engine.build()
    except (ConfigError, BackendUnavailable) as error:
        conn.send(("failed", str(error), True))
        engine.close()
        return
    except Exception as error:  # noqa: BLE001 - reported to the supervisor
        conn.send(("failed", f"engine failed to start: {type(error).__name__}: {error}", False))
        engine.close()
        return
    with telling:
        conn.send(("ready", time.monotonic() - started))
    serving = threading.Thread(target=engine.serve, name="engine:serve", daemon=True)
    serving.start()
    try:
        while serving.is_alive():
            if conn.poll(0.2):
                if conn.recv()[0] == "exit":
                    break
    except (EOFError, OSError):
        log.warning("supervisor gone: engine stopping")
    engine.stop.set()
    serving.join(10.0)
    engine.log_summary()
    engine.close()
    if engine.failed:
        os._exit(1)  # the supervisor restarts it


def engine_name(device: int | None, role: str = "engine") -> str:
    """An engine's name (``engine``, ``standby``), or ``gpuN.engine`` for GPU N of
    ``runtime.gpus``: in the live view's health and, as ``sd.NAME``, in ``ps``."""
    return role if device is None else f"gpu{device}.{role}"


STANDBY_ENDS = object()  # prepare_standby's answer when the standby is to end, not take over


def prepare_standby(config: PipelineConfig, link: EngineLink, conn: Connection) -> Any:
    """A standby engine's wait: import what an engine's build imports, prepare the backend
    (``stages.infer.prepare_backend``: the model converted on the host, dynamo imported),
    say ``("prepared", seconds, peak host memory in MiB, whether the model was converted)``
    (on the CPU path, or with TensorRT, only the imports are done ahead), then wait for the
    supervisor's word. Returns what was prepared (None where nothing could be) once told
    ``("go",)``, or ``STANDBY_ENDS`` when told ``("exit",)`` or when the supervisor is gone.
    Nothing here touches the GPU: a standby holds no device memory."""
    started = time.monotonic()
    import pipeline.app.build  # noqa: F401 - imported ahead, as each import below
    import stages.batcher  # noqa: F401
    import stages.postprocess  # noqa: F401
    import stages.preprocess  # noqa: F401
    from stages.infer import prepare_backend

    prepared = None
    try:
        prepared = prepare_backend(config.inference, Path(config.model.path),
                                   link.device is not None)
    except Exception as error:  # noqa: BLE001 - the takeover builds it as any start does
        log.warning("standby engine: preparing the model failed; a takeover builds it",
                    error=f"{type(error).__name__}: {error}")
    try:
        import resource

        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # (Linux: KiB)
        conn.send(("prepared", time.monotonic() - started, peak_kb / 1024, prepared is not None))
        while True:
            message = conn.recv()
            if message[0] == "go":
                log.info("standby engine takes over", pid=os.getpid(),
                         model_converted=prepared is not None)
                return prepared
            if message[0] == "exit":
                return STANDBY_ENDS
    except (EOFError, OSError):
        return STANDBY_ENDS


# A worker's ring shares, per source. Device: a frame holds its slot from its copy in until
# its results are back, about 3 frames at 30 fps and 100 ms; with 3 slots, 150 paced cameras
# under MPS on the H200 dropped 6 frames in 20 s for want of one (no_engine_slot).
HOST_SLOTS_PER_SOURCE, DEVICE_SLOTS_PER_SOURCE = 4, 4
SLOTS_PER_WORKER = 16  # plus this many each (frames of a batch being formed)
ENGINE_JOIN_S = 15.0
STANDBY_JOIN_S = 1.0  # then it is killed: it holds nothing to free


def ring_shares(sources: int, workers: int, cpu_sources: int, keep_images: bool
                ) -> tuple[int, int]:
    """(host slots, device slots) per worker for ``sources`` spread over ``workers``, of
    which ``cpu_sources`` are decoded on the CPU (only those take host slots; the others
    take device slots). A worker's share bounds its frames in flight: a live camera drops
    when its worker's share is used up, so its latency stays bounded."""
    per_worker = -(-sources // workers)
    cpu_per_worker = -(-cpu_sources // workers)
    host = HOST_SLOTS_PER_SOURCE * cpu_per_worker + SLOTS_PER_WORKER
    if keep_images:  # the sinks hold the images a while longer
        host += 2 * cpu_per_worker
    gpu = DEVICE_SLOTS_PER_SOURCE * (per_worker - cpu_per_worker) + SLOTS_PER_WORKER \
        if per_worker > cpu_per_worker else 0
    return host, gpu


class EngineProcess:
    """The supervisor's side of one engine: the shared host ring (it outlives the engine),
    the link its workers get, and the process, restarted when it dies.

    With ``standby``, a second process waits beside the engine once it is ready, having done
    what a start does before it touches the GPU (``prepare_standby``: the imports, the model
    converted on the host); it holds no device memory. When the engine dies, ``take_over``
    tells it to go on as the engine, which skips those seconds of a restart (torch's import
    and the conversion, the start's "backend" phase: 7.5-14.9 s beside 100 cameras' workers
    on the H200); a new standby starts once it is ready.

    Args:
        config: the run's configuration (absolute paths).
        device: the GPU (``CUDA_VISIBLE_DEVICES`` of the engine and its workers), or None:
            ``inference.gpu_id`` or the CPU path, as configured.
        workers: its source workers, spares included.
        on_gpu: the GPU path is in use (NVDEC sources take device slots).
        context: the multiprocessing context (spawn).
        spares: of ``workers``, the spares (``runtime.spare_workers``): each has a share as
            large as the others', sized as if they ran without it.
        standby: keep a standby engine (``runtime.standby_engine``).
        units: the run's sources are shared over this many engines (``--ray``: one per GPU
            of the cluster); its rings are sized for that share.
    """

    def __init__(self, config: PipelineConfig, device: int | None, workers: int, on_gpu: bool,
                 context: Any, spares: int = 0, standby: bool = False, units: int = 1) -> None:
        import secrets

        from pipeline.app.build import DEFAULT_FRAME_SIZE, host_outputs_reason, probe_file_sources
        from pipeline.slots import i420_bytes

        self.config, self.device, self._context = config, device, context
        sizes = probe_file_sources(config).values()
        largest = max([DEFAULT_FRAME_SIZE, *sizes], key=lambda wh: wh[0] * wh[1])
        slot_bytes = i420_bytes(*largest)
        on_host = host_outputs_reason(config) is not None  # as build.decoder_kind decides
        cpu_sources = sum(1 for s in config.sources if not on_gpu or s.decode == "cpu" or on_host)
        keep_images = on_host or config.runtime.http is not None
        host, gpu = ring_shares(-(-len(config.sources) // units), workers - spares,
                                -(-cpu_sources // units), keep_images)
        self.ring = SlotRing(host * workers, slot_bytes, shared=True)
        self._folder = str(temp_folder("engine"))  # its creator's pid in its name (leftovers)
        visible = 0 if device is not None else config.inference.gpu_id
        self.link = EngineLink(
            address=os.path.join(self._folder, "engine.sock"), authkey=secrets.token_bytes(16),
            device=visible if on_gpu else None, host_ring=self.ring.shm_name,
            host_slots=self.ring.slots, slot_bytes=slot_bytes,
            host_shares=tuple(tuple(range(k * host, (k + 1) * host)) for k in range(workers)),
            device_share=gpu if on_gpu else 0)
        log.info("engine rings", workers=workers, host_slots=host * workers,
                 device_slots=self.link.device_share * workers,
                 host_mb=round(self.ring.slots * slot_bytes / 2**20, 1),
                 device_mb=round(self.link.device_share * workers * slot_bytes / 2**20, 1))
        self.process: Any = None
        self.conn: Connection | None = None
        self.ready_in_s: float | None = None
        self.failure: tuple[str, bool] | None = None  # (reason, a usage error) once it gave up
        self.restarts = 0
        self.gone: set[int] = set()  # pids of workers whose connection closed without a bye
        self.standby_enabled = standby
        self.standby: Any = None  # the standby's process, once started
        self._standby_conn: Connection | None = None
        self._standby_prepared = False  # it said ("prepared", ...)
        self._standby_deaths = 0

    def _spawn(self, standby: bool) -> tuple[Any, Connection]:
        ours, theirs = self._context.Pipe()
        process = self._context.Process(
            target=engine_main, name="streamdet-standby" if standby else "streamdet-engine",
            daemon=False, args=(self.config, self.link, self.device, theirs, standby))
        start_shielded(process)
        theirs.close()
        return process, ours

    def start(self) -> None:
        self.process, self.conn = self._spawn(False)
        self.ready_in_s = None
        log.info("engine started", pid=self.process.pid, device=self.device,
                 from_standby=False)

    def take_over(self) -> bool:
        """The engine died: its standby, where one is alive, goes on as the engine (True);
        False where there is none (then ``start`` a new engine)."""
        if self.standby is None or not self.standby.is_alive():
            return False
        try:
            self._standby_conn.send(("go",))
        except OSError:
            return False
        self.process, self.conn, self.ready_in_s = self.standby, self._standby_conn, None
        self.standby = self._standby_conn = None
        log.info("engine started", pid=self.process.pid, device=self.device,
                 from_standby=True)
        return True

    def _watch_standby(self) -> None:
        """Start a standby once the engine is ready (not before: a start has the machine to
        itself), and again when one dies (up to ``runtime.max_restarts`` times)."""
        if self.standby is not None:
            try:
                while self._standby_conn.poll():
                    message = self._standby_conn.recv()
                    if message[0] == "prepared":
                        self._standby_prepared = True
                        log.info("standby engine prepared", pid=self.standby.pid,
                                 seconds=round(message[1], 1), host_mib=round(message[2]),
                                 model_converted=message[3], device=self.device)
            except (EOFError, OSError):
                pass
            if self.standby.is_alive():
                return
            self.standby.join()
            self._standby_conn.close()
            log.warning("standby engine died", pid=self.standby.pid,
                        exitcode=self.standby.exitcode, device=self.device)
            self.standby = self._standby_conn = None
            self._standby_deaths += 1
        if self.standby_enabled and self.ready_in_s is not None \
                and self._standby_deaths <= self.config.runtime.max_restarts:
            self.standby, self._standby_conn = self._spawn(True)
            self._standby_prepared = False
            log.info("standby engine started", pid=self.standby.pid, device=self.device)

    def poll(self) -> str | None:
        """Read its news; returns why it died (then it is not running), else None."""
        alive = self.process.is_alive()
        try:
            while self.conn.poll():
                message = self.conn.recv()
                if message[0] == "ready":
                    self.ready_in_s = message[1]
                    log.info("engine ready", seconds=round(message[1], 1), device=self.device)
                elif message[0] == "failed":
                    self.failure = (message[1], message[2])
                elif message[0] == "gone" and message[2] is not None:
                    self.gone.add(message[2])
        except (EOFError, OSError):
            pass
        if alive:
            self._watch_standby()
            return None
        self.process.join()
        return f"engine process {self.process.pid} {exit_text(self.process.exitcode)}"

    @property
    def name(self) -> str:
        return engine_name(self.device)

    def state(self) -> dict[str, Any]:
        """What the live view's health tells of it: ``pid``, ``ready`` (it serves),
        ``restarts``, ``standby`` (None, ``starting`` or ``ready``: prepared to take over)
        and ``failed`` (why it gave up, or None)."""
        alive = self.process is not None and self.process.is_alive()
        standby = None if self.standby is None or not self.standby.is_alive() else \
            "ready" if self._standby_prepared else "starting"
        return {"pid": None if self.process is None else self.process.pid,
                "ready": alive and self.ready_in_s is not None, "restarts": self.restarts,
                "standby": standby,
                "failed": None if self.failure is None else self.failure[0]}

    def kill(self) -> int:
        """SIGKILL the engine (tests: a crash). Returns its pid."""
        os.kill(self.process.pid, signal.SIGKILL)
        return self.process.pid

    def close(self) -> None:
        """Stop the engine (after its workers) and its standby, free the ring and the
        socket's folder."""
        import shutil

        if self.standby is not None:
            try:
                self._standby_conn.send(("exit",))
            except OSError:
                pass
            self.standby.join(STANDBY_JOIN_S)  # (it reads the word once prepared)
            if self.standby.is_alive():
                self.standby.kill()
                self.standby.join(1.0)
            self._standby_conn.close()
        if self.process is not None:
            try:
                self.conn.send(("exit",))
            except (OSError, ValueError):
                pass
            self.process.join(ENGINE_JOIN_S)
            if self.process.is_alive():
                log.warning("engine did not stop: killing it")
                self.process.kill()
                self.process.join(1.0)
            self.conn.close()
        self.ring.close()
        shutil.rmtree(self._folder, ignore_errors=True)
