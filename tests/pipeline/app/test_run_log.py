"""pipeline.app.run_log: the engine's "engine stages" lines as the engine writes them (its own
``log_summary``, in both log formats), read back from a run.log and turned into a window's
numbers; and the processes' "live frames dropped" lines summed by why."""

from __future__ import annotations

import pytest
import structlog

from pipeline.app.engine import Engine
from pipeline.app.run_log import (
    DROPS,
    EngineWindow,
    drop_reasons,
    engine_lines,
    engine_windows,
    model_loaded,
    parse_line,
)
from pipeline.logging import configure_logging

PID = 4242


def logged(capsys, fmt: str, steps: list[tuple[float, str, dict[str, tuple[int, float, float]]]]
           ) -> list[str]:
    """run.log lines as ``measurement.launch`` writes them (each prefixed with its second since
    the launch): for each (second, what, counters) an engine's "engine ready" line or its
    "engine stages" line after recording ``counters`` (stage -> frames, work s, blocked s)."""
    configure_logging(fmt, "info")
    engine = Engine(None, None)  # only its counters and its summary line are used
    lines = []
    for second, what, counters in steps:
        if what == "ready":  # as Engine.build logs it
            structlog.get_logger("engine").info("engine ready", seconds=1.5, pid=PID,
                                                workers=2, device_ring=False, batch_size=4)
        else:
            for stage, (frames, work, blocked) in counters.items():
                engine.metrics[stage].record(frames, work, blocked)
            engine.log_summary()
        for line in capsys.readouterr().err.splitlines():
            lines.append(f"{second:8.2f} {line}")
    return lines


@pytest.fixture(params=["console", "json"])
def run_log(request, capsys, monkeypatch):
    """An engine's lines in a run.log: ready at 4 s, stages at 14, 24 and 34 s."""
    monkeypatch.setattr("os.getpid", lambda: PID)
    return logged(capsys, request.param, [
        (4.0, "ready", {}),
        (14.0, "stages", {"batch": (40, 0.5, 1.0), "infer": (40, 6.0, 0.2)}),
        (24.0, "stages", {"batch": (40, 0.5, 1.0), "infer": (40, 8.0, 0.2),
                          "postprocess": (40, 0.4, 0.0)}),
        (34.0, "stages", {"infer": (40, 9.0, 0.1)}),
    ])


def test_the_engines_own_lines_are_read_back_in_either_format(run_log):
    lines = engine_lines(run_log)
    assert [(line.second, line.event) for line in lines] == [
        (4.0, "engine ready"), (14.0, "engine stages"), (24.0, "engine stages"),
        (34.0, "engine stages")]
    last = lines[-1].fields
    assert last["pid"] == PID and last["workers"] == 0
    assert last["infer"]["work_s"] == pytest.approx(23.0)  # counters since the start
    assert last["batch"]["blocked_s"] == pytest.approx(2.0)
    assert last["postprocess"]["frames"] == 40


@pytest.mark.parametrize(("start", "end", "span", "infer_work", "batch_blocked"), [
    (15.0, 30.0, (14.0, 24.0), 8.0, 1.0),  # the lines around the window
    (14.0, 40.0, (14.0, 34.0), 17.0, 1.0),  # a line at the window's start counts
    (5.0, 12.0, (4.0, 14.0), 6.0, 1.0),  # no stages before: from "engine ready" (zeros)
    (25.0, 27.0, (24.0, 34.0), 9.0, 0.0),  # no line inside: the first after the end
])
def test_a_window_takes_the_counters_between_the_engines_lines_around_it(run_log, start, end,
                                                                         span, infer_work,
                                                                         batch_blocked):
    (found,) = engine_windows(engine_lines(run_log), start, end).values()
    assert (found.pid, (found.start_s, found.end_s)) == (PID, span)
    assert found.stages["infer"][0] == pytest.approx(infer_work)
    assert found.stages["batch"][1] == pytest.approx(batch_blocked)
    assert found.share("infer") == pytest.approx(100 * infer_work / (span[1] - span[0]))


def test_a_window_after_the_last_line_has_no_engine_numbers(run_log):
    assert engine_windows(engine_lines(run_log), 35.0, 40.0) == {}


def test_a_restarted_engine_is_counted_from_its_own_start():
    lines = engine_lines([
        '   10.00 {"pid": 1, "infer": {"work_s": 5.0, "blocked_s": 0, "frames": 9}, '
        '"event": "engine stages"}',
        '   12.00 {"pid": 2, "batch_size": 4, "event": "engine ready"}',
        '   22.00 {"pid": 2, "infer": {"work_s": 2.0, "blocked_s": 0, "frames": 3}, '
        '"event": "engine stages"}'])
    found = engine_windows(lines, 11.0, 22.0)
    assert found == {2: EngineWindow(2, 12.0, 22.0, {"infer": (2.0, 0.0, 3)})}


@pytest.mark.parametrize("text", [
    "not a log line",
    "   3.00 2026-12-01T21:07:21 [info     ] engine connected   device_ring=False epoch=0",
    '   3.00 {"event": "source opened", "source": "cam000"}',
    '   3.00 {"event": "engine stages", "pid": ',  # cut short
    "   3.00 ",
])
def test_other_lines_are_not_engine_lines(text):
    assert parse_line(text) is None


@pytest.mark.parametrize("fmt", ["console", "json"])
def test_drops_by_why_are_summed_over_the_lines_that_overlap_the_window(capsys, fmt):
    configure_logging(fmt, "info")
    lines = []
    for second, counts in [(20.0, {"queue_full": 40, "behind_real_time": 9}),  # before it
                           (32.0, {"no_engine_slot": 1}),  # (27, 32]: across its start
                           (37.0, {"no_engine_slot": 5, "sink_behind": 2}),
                           (58.0, {"engine_away": 300})]:  # (53, 58]: after its end
        # as Graph.report_drops logs it, from two processes
        for _ in range(2):
            structlog.get_logger("graph").warning(DROPS, seconds=5.0,
                                                  frames=sum(counts.values()), **counts,
                                                  sources=3, most="cam007 (2)", host="worker1")
        lines += [f"{second:8.2f} {line}" for line in capsys.readouterr().err.splitlines()]
    assert drop_reasons(lines, 30.0, 50.0) == {"no_engine_slot": 12, "sink_behind": 4}
    assert drop_reasons(lines, 60.0, 80.0) == {}
    assert engine_lines(lines) == []  # not engine lines


@pytest.mark.parametrize("fmt", ["console", "json"])
def test_the_model_an_auto_chose_is_read_from_its_first_model_loaded_line(capsys, tmp_path,
                                                                           fmt):
    configure_logging(fmt, "info")
    structlog.get_logger("infer").info("model loaded", backend="torch", device="cuda",
                                       input="640x640", classes=80, batch=32)
    log = tmp_path / "run.log"
    log.write_text("".join(f"{3.5:8.2f} {line}\n"
                           for line in capsys.readouterr().err.splitlines()))
    found = model_loaded(log)
    assert (found["backend"], found["device"], found["batch"]) == ("torch", "cuda", 32)
    assert model_loaded(tmp_path / "missing.log") == {}
