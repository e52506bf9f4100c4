"""pipeline.app.engine: an engine restarted after a kill binds its predecessor's address; a
worker's connection that ends without a bye is told to the supervisor; the standby."""

from __future__ import annotations

import multiprocessing
import socket
import threading
import time
from multiprocessing import Pipe
from multiprocessing.connection import Client

from pipeline.app.engine import ConnectedWorker, Engine, EngineProcess
from pipeline.config import parse_config
from pipeline.engine_link import EngineLink


def test_a_socket_left_by_a_killed_engine_does_not_stop_its_successor(samples, tmp_path):
    address = str(tmp_path / "engine.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(address)  # what an engine killed with SIGKILL leaves: the file, no listener
    stale.close()
    link = EngineLink(address=address, authkey=b"k" * 16, device=None, host_ring="unused",
                      host_slots=1, slot_bytes=1, host_shares=((0,),), device_share=0)
    config = parse_config({"sources": [{"name": "cam", "uri": "rtsp://127.0.0.1/x"}],
                           "model": {"path": str(samples.model)}})
    engine = Engine(config, link)
    engine.listen()  # bound (it raised OSError, address already in use)
    heard = []

    def serve() -> None:  # the authentication needs both ends at once
        with engine._listener.accept() as served:
            heard.append(served.recv())

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        with Client(address, "AF_UNIX", authkey=link.authkey) as client:
            client.send("hello")
        server.join(10)
        assert heard == ["hello"]
    finally:
        engine._listener.close()


def test_a_worker_gone_without_a_bye_is_told_and_one_that_said_bye_is_not(samples, tmp_path):
    link = EngineLink(address=str(tmp_path / "engine.sock"), authkey=b"k" * 16, device=None,
                      host_ring="unused", host_slots=1, slot_bytes=1, host_shares=((0,),),
                      device_share=0)
    config = parse_config({"sources": [{"name": "cam", "uri": "rtsp://127.0.0.1/x"}],
                           "model": {"path": str(samples.model)}})
    told = []
    engine = Engine(config, link, on_gone=lambda worker, pid: told.append((worker, pid)))
    ends, conns = {}, {}
    for worker, pid in ((0, 100), (1, 101)):  # what ``_accept`` keeps of each HELLO
        conns[worker], ends[worker] = Pipe()
        engine._workers[conns[worker]] = ConnectedWorker(conns[worker], worker, worker, pid)
    engine._forget(conns[1], said_bye=True)  # its graph finished
    engine._forget(conns[0])  # its connection closed without a word: killed
    assert told == [(0, 100)] and not engine._workers


def test_a_standby_takes_over_a_dead_engine_and_is_replaced_when_it_dies(samples):
    """Real processes on the CPU path: the standby starts once the engine is ready, one that
    dies is started again, one told to go becomes the engine, and none outlives close()."""
    config = parse_config({"sources": [{"name": "cam", "uri": "rtsp://127.0.0.1/x"}],
                           "model": {"path": str(samples.model)}})
    engine = EngineProcess(config, None, 2, False, multiprocessing.get_context("spawn"),
                           standby=True)

    def until(done, what: str) -> None:
        deadline = time.monotonic() + 60
        while not done():
            assert engine.poll() is None, f"the engine died waiting for {what}"
            assert time.monotonic() < deadline, f"no {what} within 60 s"
            time.sleep(0.05)

    engine.start()
    seen = [engine.process]
    try:
        assert engine.standby is None  # not beside a start
        until(lambda: engine.standby is not None, "standby")
        assert engine.ready_in_s is not None
        until(lambda: engine.state()["standby"] == "ready", "the standby prepared")
        assert engine.state() == {"pid": seen[0].pid, "ready": True, "restarts": 0,
                                  "standby": "ready", "failed": None}
        first = engine.standby
        seen.append(first)
        first.kill()
        until(lambda: engine.standby not in (None, first), "second standby")
        second = engine.standby
        seen.append(second)
        engine.kill()
        seen[0].join(10)
        assert engine.poll() is not None  # died: the supervisor then asks the standby
        assert not engine.state()["ready"]
        assert engine.take_over() and engine.process is second and engine.standby is None
        until(lambda: engine.ready_in_s is not None and engine.standby is not None,
              "the standby ready as the engine, and a new standby")
        seen.append(engine.standby)
    finally:
        engine.close()
    assert not [p.pid for p in seen if p.is_alive()]


def test_an_engine_of_one_ray_unit_of_several_sizes_its_ring_for_its_share(samples):
    """``units``: the sources are shared over that many engines (``--ray``), so each ring
    holds its share's slots, not every source's (the CPU path: host slots only)."""
    config = parse_config({"sources": [{"name": f"cam{i}", "uri": "rtsp://127.0.0.1/x"}
                                       for i in range(8)],
                           "model": {"path": str(samples.model)}})
    context = multiprocessing.get_context("spawn")
    slots = {}
    for units in (1, 4):
        engine = EngineProcess(config, None, 2, False, context, units=units)
        slots[units] = engine.ring.slots
        engine.close()
    # 2 workers: 8 sources are 4 per worker, 2 sources (a quarter) 1 per worker; 6 slots a
    # source (4, and 2 more where the outputs keep the images), and 16 a worker
    assert slots == {1: 2 * (6 * 4 + 16), 4: 2 * (6 * 1 + 16)}


def test_a_stopping_run_starts_no_standby(samples):
    """Ctrl-C while the engine was still starting: its standby started all the same once the
    engine was ready (a new user's trial). The executor's stop now turns the standby off."""
    from pipeline.app.supervisor import LocalExecutor

    config = parse_config({"sources": [{"name": "cam", "uri": "rtsp://127.0.0.1/x"}],
                           "model": {"path": str(samples.model)},
                           "runtime": {"standby_engine": True}})
    executor = LocalExecutor(config, [None])
    engine = executor.engines[None]
    try:
        executor.conns[0], _ = Pipe()  # (the worker's end: what "stop" is sent on)
        engine.start()
        executor.call(0, "stop")
        deadline = time.monotonic() + 60
        while engine.ready_in_s is None:
            assert engine.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        for _ in range(10):  # ready: a standby would start at its next poll
            assert engine.poll() is None
            time.sleep(0.05)
        assert engine.standby is None
    finally:
        executor.close()
