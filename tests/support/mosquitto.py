"""A real MQTT broker for the tests: Debian's ``mosquitto`` as a process on a loopback port.

``.ci/install-system-packages.sh`` installs it. A broker here has its own config, database
and port (never the system service's 1883), keeps its sessions and queued messages across
``stop()`` and ``start()`` (persistence on, saved when it stops), and can require a login
(``users``) or offer a TLS listener beside the plain one (``tls_dir``, see
``make_tls_files``).
"""

from __future__ import annotations

import functools
import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.support.ci import skip_unless_ci

SBIN_MOSQUITTO = "/usr/sbin/mosquitto"  # Debian's place, not on a plain user's PATH


@functools.cache
def mosquitto_binary() -> str | None:
    """The mosquitto executable, or None when it is not installed."""
    found = shutil.which("mosquitto")
    if found is None and os.access(SBIN_MOSQUITTO, os.X_OK):
        found = SBIN_MOSQUITTO
    return found


def mosquitto_missing(tls: bool = False) -> str | None:
    """Why the broker (with ``tls``: and its TLS certificates) cannot run here, or None."""
    if mosquitto_binary() is None:
        return "mosquitto not found; install it with .ci/install-system-packages.sh"
    if shutil.which("mosquitto_passwd") is None:
        return "mosquitto_passwd not found; install mosquitto with .ci/install-system-packages.sh"
    if tls and shutil.which("openssl") is None:
        return "openssl not found (makes the TLS test's certificates); install it with " \
               ".ci/install-system-packages.sh"
    return None


def require_mosquitto(tls: bool = False) -> None:
    """Skip the calling test when mosquitto cannot run here (fail in CI:
    ``skip_unless_ci``)."""
    if (reason := mosquitto_missing(tls)) is not None:
        skip_unless_ci(reason, "MQTT")


def make_tls_files(directory: Path) -> Path:
    """A test CA (``ca.crt``) and a server certificate for 127.0.0.1 signed by it
    (``server.crt``, ``server.key``) in ``directory``, made with the openssl command;
    returns ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True,
                       timeout=30)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
            "-subj", "/CN=streamdet test CA",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr",
            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-copy_extensions", "copy", "-out", "server.crt")
    return directory


def free_loopback_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MosquittoBroker:
    """``mosquitto -c <conf>`` on a loopback port; can be stopped and started again on the
    same port (a broker that goes away and comes back).

    Args:
        directory: where its config, password file, database and log go.
        port: the plain MQTT port, or None for a free one.
        users: user name -> password; then anonymous clients are refused. None: anonymous.
        tls_dir: a folder from ``make_tls_files``: also listen with TLS on ``tls_port``.
    """

    def __init__(self, directory: Path, port: int | None = None,
                 users: dict[str, str] | None = None, tls_dir: Path | None = None) -> None:
        self.directory = directory
        self.port = port or free_loopback_port()
        self.tls_port = free_loopback_port() if tls_dir is not None else None
        self.users = users
        self.tls_dir = tls_dir
        self.log_path = directory / "mosquitto.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._config_path = self._write_config()

    def _write_config(self) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        lines = [
            f"listener {self.port} 127.0.0.1",
            "persistence true",
            f"persistence_location {self.directory}/",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "log_type information",
            # Run as root (a container), mosquitto would switch to its own user, which
            # could not read these files: stay the user who runs the tests.
            f"user {getpass.getuser()}",
        ]
        if self.users is None:
            lines.append("allow_anonymous true")
        else:
            password_file = self.directory / "passwords"
            for i, (name, password) in enumerate(self.users.items()):
                create = ["-c"] if i == 0 else []
                subprocess.run(["mosquitto_passwd", *create, "-b", str(password_file), name,
                                password], check=True, capture_output=True, timeout=30)
            lines += ["allow_anonymous false", f"password_file {password_file}"]
        if self.tls_dir is not None:
            lines += [f"listener {self.tls_port} 127.0.0.1",
                      f"cafile {self.tls_dir / 'ca.crt'}",
                      f"certfile {self.tls_dir / 'server.crt'}",
                      f"keyfile {self.tls_dir / 'server.key'}"]
        path = self.directory / "mosquitto.conf"
        path.write_text("\n".join(lines) + "\n")
        return path

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the broker and return once its plain port accepts connections."""
        binary = mosquitto_binary()
        if binary is None:
            raise RuntimeError("mosquitto not found")
        log = self.log_path.open("ab")  # a pipe nobody reads could fill and block it
        self.process = subprocess.Popen([binary, "-c", str(self._config_path)], stdout=log,
                                        stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while not self._accepts_connections():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"mosquitto did not start: {self.log_tail()}")
            time.sleep(0.02)

    def _accepts_connections(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the broker as a service stop does (SIGTERM): its clients see the connection
        drop, and it saves its database (sessions, subscriptions, queued messages) for the
        next ``start()``."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(10)

    def kill(self) -> None:
        """Kill the broker at once (SIGKILL): nothing is saved."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def log_tail(self, chars: int = 2000) -> str:
        """The end of the broker's log (for failure messages)."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> MosquittoBroker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
