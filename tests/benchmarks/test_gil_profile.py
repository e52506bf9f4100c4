"""benchmarks.gil_profile: a real py-spy recording of this process, and its summary."""

from __future__ import annotations

import threading

import pytest

from benchmarks.gil_profile import GilProfile, py_spy, summary, thread_group


@pytest.mark.parametrize("name, group", [("source:cam012", "source:*"), ("sink:cam3", "sink:*"),
                                         ("stage:batch", "stage:batch"),
                                         ("decode-workers", "decode-workers")])
def test_threads_of_a_kind_are_grouped(name, group):
    assert thread_group(name) == group


def test_summary_reads_py_spy_raw_stacks(tmp_path):
    raw = tmp_path / "raw.txt"
    raw.write_text(
        "thread (0x7f01): stage:batch;_run_stage (pipeline/graph.py:200);make_batch "
        "(stages/batcher.py:150) 30\n"
        "thread (0x7f02): source:cam001;frames (stages/decode.py:180) 10\n"
        "thread (0x7f03): source:cam002;frames (stages/decode.py:181) 10\n")
    text = summary(raw, seconds=1.0)
    assert text.startswith("held in 20% of 250 samples")  # 50 samples of 250 per second
    assert "threads stage:batch 60%, source:* 40%" in text
    assert "make_batch (stages/batcher.py) 60%" in text
    assert "frames (stages/decode.py) 40%" in text  # line numbers merged


def test_a_busy_thread_is_named(tmp_path):
    if py_spy() is None:
        pytest.skip("py-spy is not installed (pip install -e .[dev])")
    stop = threading.Event()

    def spin() -> None:
        total = 0
        while not stop.is_set():
            total += sum(range(1000))

    worker = threading.Thread(target=spin, name="stage:busy", daemon=True)
    worker.start()
    try:
        text = GilProfile(tmp_path / "raw.txt", 2.0).start().wait()
    finally:
        stop.set()
        worker.join()
    if text.startswith("py-spy failed"):
        pytest.skip(f"this machine does not let py-spy read the process: {text}")
    assert "threads stage:busy" in text, text
    assert "spin (" in text, text
