"""Hosts as Ray actors (``python run.py --config ... --ray auto|ADDRESS|local``): past one
machine, Ray places the per-GPU pipelines and restarts them; the supervisor
(``pipeline.app.supervisor.Supervisor``) assigns the sources and moves those of an actor or node
that died.

Each actor is a ``pipeline.app.host.PipelineHost`` asking Ray for one GPU (``num_gpus=1``: Ray
sets ``CUDA_VISIBLE_DEVICES``, the pipeline uses device 0) when inference may use the GPU
and the cluster has GPUs, or for a share of one when ``runtime.workers`` asks for more
actors than there are GPUs (``actor_gpus``: several pipelines feed a GPU better than one),
else for one CPU (``num_gpus=0``: the CPU path, as CI runs it).
Actors are spread over the nodes (``scheduling_strategy="SPREAD"``) and restarted by Ray
(``max_restarts``: ``runtime.max_restarts``); a call in flight when one dies fails, which is
how the supervisor learns of it. Each actor builds its graph when it starts (and again when
Ray restarts it) and keeps it; the supervisor adds and removes sources. Their number:
``runtime.workers``, else the length of a ``runtime.gpus`` list, else the cluster's GPUs,
else its nodes.

Every node must see the same paths (model, files, ``output.dir``: shared storage) and have
streamdet installed (``pip install 'streamdet[ray]'``); relative paths are made absolute
against the driver's working folder. Only this module imports Ray, and only ``--ray``
imports this module.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import structlog

from pipeline.app.host import (
    HostReport,
    PipelineHost,
    SourceRequest,
)
from pipeline.config import ConfigError, PipelineConfig

log = structlog.get_logger("ray")

CALL_TIMEOUT_S = 30.0  # a poll that takes longer counts as a lost actor
RESTART_WAIT_S = 2.0  # restart(): how long to wait for Ray to bring an actor back


def ray_missing() -> str | None:
    """The one-line error for ``--ray`` without the package, or None when it is installed."""
    if importlib.util.find_spec("ray") is None:
        return ("--ray: needs the Python package 'ray', which is not installed: "
                "pip install 'streamdet[ray]'")
    return None


class RayPipelineHost:
    """The actor: a ``PipelineHost`` (its graph built at once, also when Ray restarts it)
    with its configuration's logging set up."""

    def __init__(self, config: PipelineConfig, name: str, metrics: bool,
                 expected_sources: int | None = None) -> None:
        from pipeline.logging import configure_logging

        configure_logging(config.runtime.log_format, config.runtime.log_level)
        if config.inference.device != "cpu":
            config.inference.gpu_id = 0  # Ray sets CUDA_VISIBLE_DEVICES to the actor's GPU
        self.host = PipelineHost(config, name, expected_sources, metrics=metrics)
        self.host.start()

    def add(self, request: SourceRequest) -> None:
        self.host.add(request)

    def remove(self, name: str) -> None:
        self.host.remove(name)

    def want(self, names: list[str]) -> None:
        self.host.want(names)

    def stop(self) -> None:
        self.host.stop()

    def abort_all(self) -> None:
        self.host.abort_all()

    def poll(self) -> HostReport:
        return self.host.due_report()

    def pid(self) -> int:
        import os

        return os.getpid()


def connect(address: str) -> None:
    """``ray.init`` for ``--ray``: ``auto`` joins the cluster this machine is part of,
    ``local`` starts one on this machine, anything else is a cluster's address
    (``ray://head:10001`` or ``head:6379``). Nothing happens when Ray is initialised already
    (a test, an application)."""
    import ray

    if ray.is_initialized():
        return
    if address == "local":
        ray.init(include_dashboard=False)
    else:
        ray.init(address=address, include_dashboard=False)


def actor_count(config: PipelineConfig, resources: dict[str, float], nodes: int) -> int:
    """How many actors (module docstring)."""
    runtime = config.runtime
    if runtime.workers:
        return runtime.workers
    if isinstance(runtime.gpus, list):
        return len(runtime.gpus)
    gpus = int(resources.get("GPU", 0))
    if config.inference.device != "cpu" and gpus:
        return gpus
    if runtime.gpus == "all":
        raise ConfigError("runtime.gpus: 'all' found no GPU in the Ray cluster (set "
                          "runtime.workers to run actors without one)")
    return max(1, nodes)


def actor_gpus(gpus: float, actors: int) -> float:
    """What each actor asks Ray for: a whole GPU, or a share of one when there are more actors
    than GPUs (Ray packs that many onto each GPU); 0 without a GPU (the CPU path)."""
    if gpus < 1:
        return 0
    return 1 if actors <= gpus else 1 / math.ceil(actors / int(gpus))


class RayExecutor:
    """Hosts as Ray actors (module docstring); Ray must be initialised (``connect``).

    Args:
        config: the configuration every actor gets (absolute paths: see module docstring).
        count: actors, or None for ``actor_count``.
        metrics: the actors return metrics snapshots with every poll.
    """

    def __init__(self, config: PipelineConfig, count: int | None = None,
                 metrics: bool = False) -> None:
        import ray

        self.ray = ray
        resources = ray.cluster_resources()
        nodes = len([node for node in ray.nodes() if node.get("Alive")])
        count = count or actor_count(config, resources, nodes)
        gpus = resources.get("GPU", 0) if config.inference.device != "cpu" else 0
        self.options = {"num_gpus": actor_gpus(gpus, count), "num_cpus": 0 if gpus >= 1 else 1,
                        "max_restarts": config.runtime.max_restarts, "max_task_retries": 0,
                        "scheduling_strategy": "SPREAD"}
        self.config, self.metrics = config, metrics
        self.names = [f"actor{i}" for i in range(count)]
        self.groups: list[Any] = [None] * count
        self.spares: set[int] = set()  # none: Ray restarts its actors (runtime.spare_workers)
        self.actors: dict[int, Any] = {}
        self._actor_class = ray.remote(RayPipelineHost)
        log.info("ray cluster", actors=count, gpus_per_actor=self.options["num_gpus"],
                 resources={k: v for k, v in resources.items() if k in ("CPU", "GPU")},
                 nodes=nodes)

    def start(self, host: int) -> None:
        self.actors[host] = self._actor_class.options(**self.options).remote(
            self.config, self.names[host], self.metrics,
            -(-len(self.config.sources) // len(self.names)))

    def call(self, host: int, method: str, *args: Any) -> None:
        getattr(self.actors[host], method).remote(*args)  # failures surface in poll

    def poll(self, host: int) -> tuple[list[HostReport], str | None]:
        ray = self.ray
        try:
            return [ray.get(self.actors[host].poll.remote(), timeout=CALL_TIMEOUT_S)], None
        except ray.exceptions.GetTimeoutError:
            return [], f"no answer within {CALL_TIMEOUT_S} s"
        except ray.exceptions.RayActorError as error:
            return [], f"actor lost: {type(error).__name__}"

    def restart(self, host: int) -> bool | None:
        """Ray restarts a dead actor by itself (``max_restarts``): True once it answers,
        False while it is being restarted, None when Ray gave it up."""
        ray = self.ray
        try:
            ray.get(self.actors[host].pid.remote(), timeout=RESTART_WAIT_S)
            return True
        except ray.exceptions.ActorDiedError:
            return None
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def engine_states(self) -> dict[str, dict[str, Any]]:
        return {}  # each actor holds its own model

    def kill(self, host: int) -> None:
        """Kill an actor's process, as a crash would (tests); Ray restarts it."""
        self.ray.kill(self.actors[host], no_restart=False)

    def close(self) -> None:
        for actor in self.actors.values():
            self.ray.kill(actor, no_restart=True)
        self.actors.clear()
