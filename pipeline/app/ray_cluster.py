"""GPU units as Ray actors (``python run.py --config ... --ray auto|ADDRESS|local``): past one
machine, Ray places one unit per GPU of the cluster and restarts it; the supervisor
(``pipeline.app.supervisor.Supervisor``, here in the driver: the one control plane) assigns
the sources to the units' source workers and moves those of a worker or unit that died.

A unit (``RayUnit``, an actor) is what one GPU runs on a machine without Ray: its engine
process (the one model copy of that GPU, with its standby) and its source worker processes,
started and watched by a ``pipeline.app.supervisor.LocalExecutor`` inside the actor, so the
engine and its workers share the node's memory (the rings) and the GPU (CUDA IPC). The
actor asks Ray for one GPU (``num_gpus=1``: Ray sets ``CUDA_VISIBLE_DEVICES``, which its
processes keep) on the GPU path, else for one CPU (the CPU path, as CI runs it). Units are
spread over the nodes (``scheduling_strategy="SPREAD"``) and restarted by Ray
(``max_restarts``: ``runtime.max_restarts``); a call in flight when one dies fails, which is
how the supervisor learns of it: every worker of the unit is then gone, and each is started
again in the unit once Ray has brought it back. An engine or a worker that dies inside a
live unit is restarted there, as without Ray.

Units: the length of a ``runtime.gpus`` list, else the cluster's GPUs on the GPU path, else
its nodes. Source workers per unit: ``runtime.workers``, else one per source of its share,
at most 5 and half the cores of its share of the cluster (``default_workers``). Spares per
unit: ``runtime.spare_workers``, else one where a unit has two or more workers: a worker
that dies in a live unit has its sources taken by its unit's spare; a unit that dies takes
its spare with it, and its sources are shared out among the other units' workers.

Every node must see the same paths (model, files, ``output.dir``: shared storage) and have
streamdet installed with the ray extra (``pip install -e '.[ray]'``); relative paths are made
absolute against the driver's working folder. Only this module imports Ray, and only ``--ray``
imports this module.
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import sys
import time
from typing import Any

import structlog

from pipeline.app.host import HostReport
from pipeline.app.supervisor import JOIN_TIMEOUT_S, LocalExecutor, default_workers
from pipeline.config import ConfigError, PipelineConfig, install_hint

log = structlog.get_logger("ray")

CALL_TIMEOUT_S = 30.0  # a poll that takes longer counts as a lost unit
RESTART_WAIT_S = 2.0  # restart(): how long to wait for Ray to bring a unit back
STATES_WAIT_S = 1.0  # engine_states(): a unit Ray is restarting is left out after this
CONNECT_TIMEOUT_S = 5.0  # connect(): how long a cluster's address may take to answer
WAIT_SLICE_S = 1.0  # a call's answer is waited for in slices, the cluster checked between
GCS_PROBE_S = 0.5  # cluster_gone(): how long the cluster's GCS may take to accept a connection
ADDRESS_FORMS = r"auto|local|(ray://)?[A-Za-z0-9.\-]+:\d{1,5}|(ray://)?\[[0-9A-Fa-f:.]+\]:\d{1,5}"


def ray_missing(address: str = "auto") -> str | None:
    """The one-line error for ``--ray ADDRESS`` when what it needs is not installed (Ray; for a
    ``ray://`` address also Ray's client, grpcio) or ADDRESS is not a form ``connect`` takes;
    None when all is well."""
    if not re.fullmatch(ADDRESS_FORMS, address):
        return (f"--ray: {address!r} is not auto, local, HOST:PORT (a cluster's head, e.g. "
                f"head:6379) or ray://HOST:PORT (Ray's client, e.g. ray://head:10001)")
    install = install_hint("ray")
    if importlib.util.find_spec("ray") is None:
        return f"--ray: needs the Python package 'ray', which is not installed: {install}"
    if address.startswith("ray://") and importlib.util.find_spec("grpc") is None:
        return f"--ray {address}: Ray's client needs the package 'grpcio' (ray[client]): {install}"
    return None


class ClusterGone(Exception):
    """The Ray cluster this run started is gone (``RayExecutor.cluster_gone``)."""


class RayUnit:
    """The actor: one GPU's engine and its source workers (``names``) on this node (module
    docstring). Its methods take a worker's number in the unit (``local``) and are those of
    ``LocalExecutor``; a worker this incarnation of the unit never started (Ray restarted
    the unit) is gone for ``poll`` and deaf to ``call``.

    Args:
        config: the run's configuration (absolute paths).
        names: its source workers' names, run-wide (``unit1.worker0``: logs, metrics).
        units: the units of the run (each sizes its rings for its share of the sources).
        metrics: the workers send metrics snapshots.
        spares: of ``names``, the last this many are spares (``runtime.spare_workers``).
    """

    def __init__(self, config: PipelineConfig, names: list[str], units: int,
                 metrics: bool, spares: int = 0) -> None:
        from pipeline.logging import configure_logging

        configure_logging(config.runtime.log_format, config.runtime.log_level)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")  # Ray's choice for num_gpus=1
        device = int(visible.split(",")[0]) if config.inference.device != "cpu" and \
            visible.split(",")[0].isdigit() else None
        self.executor = LocalExecutor(config, [device] * len(names), metrics,
                                      on_gpu=device is not None, units=units,
                                      spares=range(len(names) - spares, len(names)))
        self.executor.names = names

    def start(self, local: int) -> None:
        self.executor.start(local)

    def call(self, local: int, method: str, *args: Any) -> None:
        if local in self.executor.processes:
            self.executor.call(local, method, *args)

    def poll(self, local: int) -> tuple[list[HostReport], str | None]:
        if local not in self.executor.processes:
            return [], "its unit was restarted"
        return self.executor.poll(local)

    def engine_states(self) -> dict[str, dict[str, Any]]:
        return self.executor.engine_states()

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self.executor.close()


def connect(address: str) -> str | None:
    """``ray.init`` for ``--ray``: ``auto`` joins the cluster this machine is part of,
    ``local`` starts one on this machine, anything else is a cluster's address
    (``ray://head:10001`` or ``head:6379``, checked by ``ray_missing``). Nothing happens when
    Ray is initialised already (a test, an application).

    Returns:
        For ``local``, the address of the started cluster's GCS (``RayExecutor``'s
        ``local_gcs``), else None.

    Raises:
        ConnectionError: no cluster found (``auto``), or nothing answers at the address within
            ``CONNECT_TIMEOUT_S`` (Ray itself would wait for it without end).
    """
    import ray

    if not sys.stderr.isatty():  # the units' log lines come with Ray's colour codes else
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    if ray.is_initialized():
        return None
    if address == "local":
        # Its driver's shutdown waits this long to send Ray's task events to the GCS (a few
        # seconds by default), also when the GCS went first (RayExecutor's docstring).
        os.environ.setdefault("RAY_task_events_shutdown_flush_timeout_ms", "500")
        ray.init(include_dashboard=False)
        return ray.get_runtime_context().gcs_address
    if address != "auto":
        refused = refusal(address.removeprefix("ray://"), CONNECT_TIMEOUT_S)
        if refused is not None:
            raise ConnectionError(f"--ray {address}: no Ray cluster answers there ({refused})")
    try:
        ray.init(address=address, include_dashboard=False)
        return None
    except ConnectionError as error:
        if address != "auto":
            raise ConnectionError(f"--ray {address}: {error}") from None
        log.debug("ray.init", error=str(error))  # Ray's words name its own --address flag
        raise ConnectionError("--ray auto: no running Ray cluster found on this machine "
                              "(start one with `ray start --head`, give its address, or "
                              "--ray local)") from None


def refusal(address: str, timeout_s: float) -> str | None:
    """Why nothing accepts a TCP connection at ``address`` (``host:port``, ``[v6]:port``)
    within ``timeout_s``, or None when something does."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout_s).close()
    except OSError as error:
        return error.strerror or str(error) or type(error).__name__
    return None


def unit_count(config: PipelineConfig, resources: dict[str, float], nodes: int) -> int:
    """How many units (module docstring).

    Raises:
        ConfigError: ``runtime.gpus`` asks for GPUs the cluster does not have, or the CPU
            path's units (one CPU each) are more than the cluster's CPUs: Ray would never
            place the rest.
    """
    runtime = config.runtime
    gpus = int(resources.get("GPU", 0)) if config.inference.device != "cpu" else 0
    if isinstance(runtime.gpus, list):
        if config.inference.device != "cpu" and len(runtime.gpus) > gpus:
            listed = f"{len(runtime.gpus)} GPU{'s' * (len(runtime.gpus) != 1)}"
            raise ConfigError(f"runtime.gpus: lists {listed}; the Ray cluster "
                              f"has {gpus or 'none'} (one unit per GPU)")
        units = len(runtime.gpus)
    elif gpus:
        units = gpus
    elif runtime.gpus == "all":
        raise ConfigError("runtime.gpus: 'all' found no GPU in the Ray cluster (leave it out "
                          "to run on the CPU path)")
    else:
        units = max(1, nodes)
    cpus = int(resources.get("CPU", 0))
    if not gpus and units > cpus:
        raise ConfigError(f"--ray: {units} units on the CPU path take a CPU each; the Ray "
                          f"cluster has {cpus}")
    return units


class RayExecutor:
    """Source workers in GPU units, one Ray actor each (module docstring); Ray must be
    initialised (``connect``). Host ``h`` is worker ``h % size`` of unit ``h // size``
    (``size``: its workers, then its spares), named ``unitU.workerW``; its group is its unit.

    A cluster this run started (``--ray local``: ``local_gcs``) ends with the run's process
    group: a stop signal sent to the whole group (``kill -TERM -PGID``, ``timeout``, systemd)
    reaches Ray's own processes too, and its units die with them. So an answer is waited for
    in slices of ``WAIT_SLICE_S``, and between them a GCS that no longer accepts connections
    ends the wait at once (``cluster_gone``): the run ends in seconds, its outputs kept to
    resume, instead of waiting out ``CALL_TIMEOUT_S`` per unit (and Ray's own 60 s, after
    which its driver exits with status 1).

    Args:
        config: the run's configuration (absolute paths: see module docstring).
        units: units, or None for ``unit_count``.
        metrics: the workers send metrics snapshots.
        local_gcs: the GCS address of a cluster this run started (``connect``), or None.
    """

    def __init__(self, config: PipelineConfig, units: int | None = None,
                 metrics: bool = False, local_gcs: str | None = None) -> None:
        import ray

        self.ray = ray
        self.local_gcs, self._gone = local_gcs, None
        resources = ray.cluster_resources()
        nodes = len([node for node in ray.nodes() if node.get("Alive")])
        units = units or unit_count(config, resources, nodes)
        gpus = resources.get("GPU", 0) if config.inference.device != "cpu" else 0
        self.workers = config.runtime.workers or default_workers(
            -(-len(config.sources) // units), 1, int(resources.get("CPU", 1) // units) or 1)
        self.options = {"num_gpus": 1 if gpus >= 1 else 0, "num_cpus": 0 if gpus >= 1 else 1,
                        "max_restarts": config.runtime.max_restarts, "max_task_retries": 0,
                        "scheduling_strategy": "SPREAD"}
        spares = config.runtime.spare_workers
        self.unit_spares = spares if spares is not None else int(self.workers >= 2)
        self.size = self.workers + self.unit_spares  # hosts per unit
        self.config, self.metrics, self.units = config, metrics, units
        hosts = range(units * self.size)
        self.names = [f"unit{h // self.size}.worker{h % self.size}" for h in hosts]
        self.groups: list[Any] = [h // self.size for h in hosts]
        self.spares = {h for h in hosts if h % self.size >= self.workers}
        self.actors: dict[int, Any] = {}  # per unit, once one of its workers started
        self._unit_class = ray.remote(RayUnit)
        log.info("ray cluster", units=units, workers_per_unit=self.workers,
                 spares_per_unit=self.unit_spares,
                 gpus_per_unit=self.options["num_gpus"],
                 resources={k: v for k, v in resources.items() if k in ("CPU", "GPU")},
                 nodes=nodes)

    def _unit(self, host: int) -> tuple[Any, int]:
        """(``host``'s unit's actor, its number there), the actor made on first use."""
        unit = host // self.size
        if unit not in self.actors:
            self.actors[unit] = self._unit_class.options(**self.options).remote(
                self.config, self.names[unit * self.size:(unit + 1) * self.size],
                self.units, self.metrics, self.unit_spares)
        return self.actors[unit], host % self.size

    def start(self, host: int) -> None:
        actor, local = self._unit(host)
        actor.start.remote(local)  # in order with the calls that follow

    def call(self, host: int, method: str, *args: Any) -> None:
        actor, local = self._unit(host)
        actor.call.remote(local, method, *args)  # failures surface in poll

    def cluster_gone(self) -> str | None:
        """Why the cluster this run started is gone (its GCS accepts no connection), or None
        (also for a cluster it joined: that one is not probed). Once gone, always gone."""
        if self._gone is None and self.local_gcs is not None:
            refused = refusal(self.local_gcs, GCS_PROBE_S)
            if refused is not None:
                self._gone = f"the local Ray cluster is gone (its GCS: {refused})"
                log.warning("ray cluster gone", gcs=self.local_gcs, error=refused)
        return self._gone

    def _get(self, ref: Any, timeout_s: float) -> Any:
        """``ray.get(ref)``, waited for in slices with ``cluster_gone`` asked between them.

        Raises:
            ClusterGone: the cluster this run started is gone.
            ray.exceptions.GetTimeoutError: no answer within ``timeout_s``.
            ray.exceptions.RayActorError: the unit died.
        """
        ray = self.ray
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            ready, _ = ray.wait([ref], timeout=max(0.0, min(WAIT_SLICE_S, left)))
            if ready:
                return ray.get(ref)
            gone = self.cluster_gone()
            if gone is not None:
                raise ClusterGone(gone)
            if left <= WAIT_SLICE_S:
                raise ray.exceptions.GetTimeoutError(f"no answer within {timeout_s:g} s")

    def poll(self, host: int) -> tuple[list[HostReport], str | None]:
        ray = self.ray
        actor, local = self._unit(host)
        try:
            return self._get(actor.poll.remote(local), CALL_TIMEOUT_S)
        except ClusterGone as gone:
            return [], str(gone)
        except ray.exceptions.GetTimeoutError:
            return [], f"its unit gave no answer within {CALL_TIMEOUT_S} s"
        except ray.exceptions.RayActorError as error:
            return [], f"its unit was lost: {type(error).__name__}"

    def restart(self, host: int) -> bool | None:
        """Start ``host`` again in its unit: True once started, False while Ray is still
        restarting the unit, None when Ray gave it up."""
        ray = self.ray
        if self.cluster_gone() is not None:
            return None
        actor, local = self._unit(host)
        try:  # asked first: a start left queued in a unit not back yet would run later
            ray.get(actor.pid.remote(), timeout=RESTART_WAIT_S)
            self._get(actor.start.remote(local), CALL_TIMEOUT_S)
            return True
        except (ray.exceptions.ActorDiedError, ClusterGone):
            return None
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def engine_states(self) -> dict[str, dict[str, Any]]:
        """Every unit's engines (``unitU.engine``); a unit that does not answer within
        ``STATES_WAIT_S`` (Ray restarting it) is left out: the supervisor's loop waits no
        longer for the live view."""
        ray, states = self.ray, {}
        asked = {unit: actor.engine_states.remote() for unit, actor in self.actors.items()}
        if not asked:
            return states
        answered, _ = ray.wait(list(asked.values()), num_returns=len(asked),
                               timeout=STATES_WAIT_S)
        for unit, ref in asked.items():
            if ref not in answered:
                continue
            try:
                engines = ray.get(ref)
            except ray.exceptions.RayActorError:
                continue
            states.update({f"unit{unit}.{name}": state for name, state in engines.items()})
        return states

    def kill(self, host: int) -> None:
        """Kill ``host``'s unit's actor, as a crash of it would (tests); Ray restarts it."""
        self.ray.kill(self._unit(host)[0], no_restart=False)

    def close(self) -> None:
        """Each unit stops its workers and engine (``LocalExecutor.close``), then goes (not
        waited for when the cluster is gone: its units went with it)."""
        ray = self.ray
        closing = {unit: actor.close.remote() for unit, actor in self.actors.items()}
        for unit, done in closing.items():
            try:
                self._get(done, JOIN_TIMEOUT_S + 10)
            except ClusterGone:
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                log.warning("unit did not close", unit=unit)
            ray.kill(self.actors[unit], no_restart=True)
        self.actors.clear()
