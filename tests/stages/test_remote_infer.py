"""RemoteInferStage's send path without an engine process: fakes stand in for the engine's
connection and device ring (the NVDEC copies need a GPU; here nothing is copied), so the
order of sends, waits and reconnects is what is tested."""

from __future__ import annotations

import threading
import time
from collections import deque
from types import SimpleNamespace

import numpy as np

from pipeline.engine_link import SUBMIT_DTYPE, EngineResults
from stages.remote_infer import RemoteInferStage, _Entry, _Link
from tests.support.batches import make_frame


class FakeConnection:
    """Keeps the SUBMIT messages' tokens."""

    def __init__(self) -> None:
        self.sent: list[list[int]] = []

    def send_bytes(self, data: bytes) -> None:
        self.sent.append(np.frombuffer(data, SUBMIT_DTYPE)["token"].tolist())

    def close(self) -> None:
        pass


class FakeDeviceRing:
    def close(self) -> None:
        pass


def link(slots: int) -> _Link:
    return _Link(FakeConnection(), FakeDeviceRing(), 0, deque(range(slots)))  # type: ignore[arg-type]


def results(tokens: list[int]) -> EngineResults:
    return EngineResults(np.array(tokens, np.int64), np.zeros(len(tokens) + 1, np.int64),
                         np.empty((0, 4), np.float32), np.empty(0, np.float32),
                         np.empty(0, np.int32))


def stage_with_file_frames(frames: int, lost: _Link) -> RemoteInferStage:
    """A stage whose ``frames`` NVDEC frames of a file (each with its decoder's pictures)
    were sent to an engine that then went away (``lost``), none answered."""
    stage = RemoteInferStage("remote_infer", SimpleNamespace(), 0,
                             SimpleNamespace(release=lambda slots: None), (32, 32),
                             keep_images=False, stop=threading.Event(),
                             on_drop=lambda frame, reason: None)
    stage._copy_in = lambda link, entries: None  # the NVDEC copies: no GPU here
    stage.add_source("file", live=False)
    for token in range(frames):
        frame = make_frame("file", token, width=32, height=32)
        frame.device_planes = (object(), object())  # the decoder's surface, kept
        stage._entries[token] = _Entry(frame, live=False)
        stage._order.append(token)
    stage._link = lost
    return stage


def test_after_a_reconnect_the_receiver_never_waits_for_a_device_slot():
    """The engine came back with fewer free device slots than unanswered file frames: the
    receiver thread (the one that frees slots, as results come) must not wait for one (on
    the H200 it did, and a restarted worker's files hung for good); the stage thread sends
    the frames, waiting for slots that the results free."""
    lost, new = link(0), link(2)
    stage = stage_with_file_frames(5, lost)
    stage._connect = lambda: new
    reconnected = []
    receiver = threading.Thread(target=lambda: reconnected.append(stage._reconnect(lost)),
                                daemon=True)
    receiver.start()
    receiver.join(5)
    assert not receiver.is_alive(), "the receiver waits for a device slot it alone can free"
    assert reconnected == [True] and stage._link is new
    assert stage.poll_interval_s == 0.0  # the stage thread sends them at once

    outputs: list = []
    sender = threading.Thread(target=lambda: outputs.extend(stage.on_idle()),  # the stage's
                              daemon=True)
    sender.start()
    for expected in ([0, 1], [2, 3], [4]):  # each wait ends as results free two slots
        while sum(len(m) for m in new.conn.sent) < expected[-1] + 1 and sender.is_alive():
            sender.join(0.01)
        assert new.conn.sent[-1] == expected
        stage._take_results(new, results(expected))
    sender.join(5)
    assert not sender.is_alive()
    outputs += stage._take_done()
    assert [i for batch in outputs for i in batch.frames.index.tolist()] == [0, 1, 2, 3, 4]


class ClosedConnection(FakeConnection):
    def recv(self) -> None:
        raise OSError("handle is closed")


def test_closing_says_bye_and_the_receiver_does_not_reconnect():
    # Else the engine took every worker's clean end for a death, and each receiver, seeing
    # its connection closed, connected again ("engine lost: reconnecting" at every end)
    connection = ClosedConnection()
    link = _Link(connection, FakeDeviceRing(), 0, deque())
    stage = stage_with_file_frames(0, link)
    connects = []
    stage._connect = lambda: connects.append(1)
    stage.close()
    assert connection.sent == [[]]  # BYE: one empty message, before the connection closes
    stage._link = link  # the receiver read its link before the close
    receiver = threading.Thread(target=stage._receive, daemon=True)
    receiver.start()
    receiver.join(5)
    assert not receiver.is_alive() and connects == [] and stage.engine_losses == 0


def test_close_lets_the_receiver_end_before_its_connection_closes(monkeypatch) -> None:
    """An abort closed the worker's stage while its receiver thread was inside recv(): the
    thread died with a TypeError traceback. close() now shuts the socket down first, so the
    receiver reads an end and returns (also when the engine answers BYE with nothing, as
    here), then closes it."""
    import multiprocessing

    import stages.remote_infer as remote_infer

    failures: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda hook: failures.append(hook.exc_value))
    ours, engine = multiprocessing.Pipe()  # a socket pair, as a worker's link to its engine
    stage = RemoteInferStage("remote_infer", SimpleNamespace(), 0,
                             SimpleNamespace(release=lambda slots: None), (32, 32),
                             keep_images=False, stop=threading.Event(),
                             on_drop=lambda frame, reason: None)
    stage._link = _Link(ours, FakeDeviceRing(), 0, deque())  # type: ignore[arg-type]
    stage._receiver = threading.Thread(target=stage._receive, name="remote_infer:results",
                                       daemon=True)
    stage._receiver.start()
    time.sleep(0.1)  # inside recv()
    started = time.monotonic()
    stage.close()
    assert time.monotonic() - started < remote_infer.RECEIVER_JOIN_S  # it did not wait it out
    assert not stage._receiver.is_alive() and failures == [] and ours.closed
    assert engine.recv_bytes() == remote_infer.BYE
