"""A CUDA MPS control daemon of the run's own (``runtime.cuda_mps``).

Without MPS, the GPU time-slices between the CUDA contexts of a run's processes: the
engine's model and the source workers' copies (each picture from FFmpeg's NVDEC surface
into the engine's device ring) take turns, and every turn costs a context switch. Under MPS
the processes are clients of one MPS server, whose single context runs their work
concurrently. On the H200 at 150 paced 1080p cameras (``benchmarks/results-h200.md``,
thirteenth session) the run delivered 4,122-4,208 frames/s without it, the engine waiting for
a free batch set 12.7-13.1 s of 20, and 4,484 with it, the engine waiting 0.1 s; 120 cameras
held without it. In the fourteenth session, with MPS the default (``start_for_run``) and 4
device slots per camera, 150 held (4,503.5 frames/s, 0 dropped, p99 <= 100 ms).

``CudaMps.start`` runs ``nvidia-cuda-mps-control -d`` with its pipe and log folders in a
fresh folder of its own (``CUDA_MPS_PIPE_DIRECTORY``, ``CUDA_MPS_LOG_DIRECTORY``), so it is
not the machine's daemon and touches no other program, and sets both variables in this
process's environment, which the engine and worker processes spawned after it inherit
(their CUDA driver connects to that daemon when it initialises; a process that cannot
connect runs without MPS, as CUDA does). ``quit`` asks which servers ran (proof that the
run's processes were clients), stops the daemon, puts the environment back and removes the
folder.

What changes for a run under MPS (NVIDIA's MPS documentation): a fatal GPU error in one
client (an illegal address, say) ends every client of that GPU's server, the whole run's
GPU work, not only that process's; the server takes no new client until they are gone.
``kill -9`` of a process is not such an error.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import structlog

from pipeline.config import ConfigError

log = structlog.get_logger("mps")

CONTROL = "nvidia-cuda-mps-control"
PIPE_VARIABLE, LOG_VARIABLE = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
COMMAND_TIMEOUT_S = 10.0


class CudaMps:
    """A running control daemon (``start``), until ``quit``.

    Attributes:
        folder: its own folder (``pipe`` and ``log`` inside).
        binary: the ``nvidia-cuda-mps-control`` it runs.
    """

    def __init__(self, folder: Path, binary: str, saved: dict[str, str | None]) -> None:
        self.folder, self.binary = folder, binary
        self._saved = saved  # the variables' values before start (None: unset)

    @classmethod
    def start(cls) -> CudaMps:
        """Start a daemon in a new folder and point this process's children at it.

        Raises:
            ConfigError: ``nvidia-cuda-mps-control`` is not on PATH, or it failed to start
                (its message).
        """
        binary = shutil.which(CONTROL)
        if binary is None:
            raise ConfigError(f"runtime.cuda_mps: {CONTROL} is not on PATH (it comes with the "
                              "NVIDIA driver's utilities); set runtime.cuda_mps: false")
        folder = Path(tempfile.mkdtemp(prefix="streamdet-mps-"))
        variables = {PIPE_VARIABLE: str(folder / "pipe"), LOG_VARIABLE: str(folder / "log")}
        for path in variables.values():
            os.mkdir(path)
        try:
            done = subprocess.run([binary, "-d"], env={**os.environ, **variables},
                                  capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as error:
            shutil.rmtree(folder, ignore_errors=True)
            raise ConfigError(f"runtime.cuda_mps: {CONTROL} -d failed: {error}") from error
        if done.returncode != 0:
            shutil.rmtree(folder, ignore_errors=True)
            said = (done.stderr or done.stdout).strip().splitlines()
            raise ConfigError(f"runtime.cuda_mps: {CONTROL} -d failed (exit status "
                              f"{done.returncode}){': ' + said[-1] if said else ''}")
        saved = {name: os.environ.get(name) for name in variables}
        os.environ.update(variables)
        log.info("cuda mps daemon started", folder=str(folder))
        return cls(folder, binary, saved)

    def ask(self, command: str) -> str:
        """The daemon's answer to one control command (``get_server_list``, say); '' when
        it gave none in time."""
        env = {**os.environ, PIPE_VARIABLE: str(self.folder / "pipe"),
               LOG_VARIABLE: str(self.folder / "log")}
        try:
            done = subprocess.run([self.binary], input=command + "\n", env=env,
                                  capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout.strip()

    def server_pids(self) -> list[int]:
        """The MPS servers the daemon runs now (one per client user while any client is
        connected), by process id."""
        return [int(word) for word in self.ask("get_server_list").split() if word.isdigit()]

    def quit(self, servers: list[int] | None = None) -> None:
        """Stop the daemon (its servers end with their last client), put the environment
        back, remove the folder. ``servers``: the server pids seen while the run's processes
        were alive (logged: they say the processes were its clients)."""
        self.ask("quit")
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(self.folder, ignore_errors=True)
        log.info("cuda mps daemon quit", servers=servers)


MACHINE_PIPE = Path("/tmp/nvidia-mps")  # the pipe folder of a daemon started without ours


def start_for_run(setting: bool | str, on_gpu: bool) -> CudaMps | None:
    """The run's daemon as ``runtime.cuda_mps`` says, started before any of its processes;
    None where there is none.

    ``true``: started, or ``ConfigError`` (no control program, or it failed); ignored with a
    warning on the CPU path. ``"auto"`` (the default): started on the GPU path unless the
    control program is missing or a daemon of the machine's is already there (its control
    pipe in ``CUDA_MPS_PIPE_DIRECTORY``, else ``/tmp/nvidia-mps``: its clients must not be
    taken from it; a variable naming a folder without one is left from a daemon that quit,
    and is said and not followed), each said in one info line; a daemon that fails to start is a warning
    and the run goes on without. ``false``: none."""
    if setting is False or (not on_gpu and setting == "auto"):
        return None
    if not on_gpu:
        log.warning("runtime.cuda_mps: the CPU path: no MPS daemon started")
        return None
    if setting == "auto":
        if shutil.which(CONTROL) is None:
            log.info("no CUDA MPS daemon: nvidia-cuda-mps-control is not on PATH; the "
                     "processes time-slice the GPU (runtime.cuda_mps: auto)")
            return None
        pipe = Path(os.environ.get(PIPE_VARIABLE) or MACHINE_PIPE)
        if (pipe / "control").exists():
            log.info("no CUDA MPS daemon of the run's own: the machine's is running; the "
                     "processes are its clients (runtime.cuda_mps: auto)", pipe=str(pipe))
            return None
        if os.environ.get(PIPE_VARIABLE):  # left from a daemon that has quit: not followed
            log.info("CUDA_MPS_PIPE_DIRECTORY names no running daemon (no control pipe in "
                     "it): the run starts its own", pipe=str(pipe))
    try:
        return CudaMps.start()
    except ConfigError as error:
        if setting is True:
            raise
        log.warning("no CUDA MPS daemon: it failed to start; the processes time-slice the "
                    "GPU (runtime.cuda_mps: auto)", error=str(error))
        return None
