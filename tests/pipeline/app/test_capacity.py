"""pipeline.app.capacity and its report: the search with a fake measurement, the configuration
of a run, and the table's verdict from a window's numbers (the real runs:
tests/e2e/test_capacity.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.app.api_client import AddRemove
from pipeline.app.capacity import (
    budget_note,
    camera_sources,
    estimate,
    next_count,
    parse_counts,
    run_config,
    search,
)
from pipeline.app.capacity_report import (
    Options,
    RunRow,
    ceiling_lines,
    ceiling_ratio,
    header_text,
    held_text,
    largest_held,
    overload_verdict,
    report,
    stage_lines,
    table,
    unpaced_table,
    unpaced_verdict,
)
from pipeline.app.measurement import GpuMemory, Window
from pipeline.app.run_log import EngineWindow
from pipeline.config import ConfigError, parse_config


def fake_machine(holds_up_to: int) -> tuple[list[int], object]:
    """A measurement that holds up to ``holds_up_to`` cameras, and the counts it was asked."""
    asked: list[int] = []

    def measure(count: int) -> bool:
        asked.append(count)
        return count <= holds_up_to

    return asked, measure


@pytest.mark.parametrize(("holds_up_to", "start", "asked"), [
    (37, 10, [10, 20, 40, 30, 35, 37, 38]),  # double until not held, then bisect
    (37, 50, [50, 25, 37, 43, 40, 38]),  # halve until held, then bisect
    (1, 4, [4, 2, 1]),
    (0, 4, [4, 2, 1]),  # nothing holds: 0
    (64, 64, [64, 128, 96, 80, 72, 68, 66, 65]),
    (5000, 1000, [1000, 2000, 4000, 4096]),  # never past MAX_CAMERAS
])
def test_the_search_doubles_or_halves_then_bisects_to_one_camera(holds_up_to, start, asked):
    seen, measure = fake_machine(holds_up_to)
    tried = search(measure, start)
    assert seen == asked
    assert max((n for n, ok in tried.items() if ok), default=0) == min(holds_up_to, 4096)


def test_a_list_of_counts_is_tried_as_given_and_the_budget_stops_the_search():
    seen, measure = fake_machine(37)
    assert search(measure, 10, counts=[50, 10, 20]) == {50: False, 10: True, 20: True}
    assert seen == [50, 10, 20]
    seen, measure = fake_machine(37)
    assert search(measure, 10, fits=lambda count: len(seen) < 3) == {10: True, 20: True,
                                                                      40: False}


def test_a_count_that_did_not_hold_below_one_that_did_is_not_bisected_again():
    # a noisy machine: 20 did not hold, 30 did; the search goes on above 30 only
    assert next_count({20: False, 30: True}, 10) == 60
    assert next_count({20: False, 30: True, 60: False}, 10) == 45


@pytest.mark.parametrize(("ceilings", "fps", "start"), [
    ({"decode": {"fps": 4580.0}, "engine": {"images_s": 7300.0}}, 30.0, 76),
    ({"engine": {"images_s": 41.0}}, 2.0, 10),
    ({"decode": {"fps": 1.0}}, 30.0, 1),
    ({}, 30.0, 4),
])
def test_the_search_starts_at_half_of_the_slower_ceiling(ceilings, fps, start):
    assert estimate(ceilings, fps) == start


@pytest.mark.parametrize(("text", "counts"), [("50,100,150", [50, 100, 150]), ("2", [2]),
                                              ("1, 2,", [1, 2])])
def test_camera_counts(text, counts):
    assert parse_counts(text) == counts


@pytest.mark.parametrize("text", ["", "a,b", "0,1", "-3", "1.5"])
def test_bad_camera_counts_are_refused(text):
    with pytest.raises(ConfigError, match="--cameras: expected camera counts"):
        parse_counts(text)


def test_a_run_keeps_the_users_settings_and_replaces_sources_outputs_and_endpoints(samples,
                                                                                     tmp_path):
    user = {"sources": [{"name": "door", "uri": "rtsp://cam.invalid/1"}],
            "model": {"path": str(samples.model), "class_names": str(samples.names)},
            "inference": {"device": "cpu", "batch_size": 8, "batch_timeout_ms": 20},
            "output": {"dir": "/data/out", "jsonl": "{source}.jsonl",
                       "mqtt": {"host": "broker.invalid"}},
            "runtime": {"queue_size": 6, "metrics_port": 9090, "metrics_host": "0.0.0.0",
                        "metrics_token": "${TOKEN}", "http": {"host": "0.0.0.0", "port": 80,
                                                              "token": "${TOKEN}"}}}
    data = run_config(user, 3, samples.bikes, 30.0, tmp_path, 12345)
    assert [s["name"] for s in data["sources"]] == ["cam000", "cam001", "cam002"]
    assert data["sources"][0] == {"name": "cam000", "uri": str(samples.bikes), "live": True,
                                  "pace_fps": 30.0, "reconnect": False}
    assert data["inference"] == user["inference"]
    assert data["output"] == {"dir": str(tmp_path), "jsonl": "{source}.jsonl", "video": None}
    runtime = data["runtime"]
    assert (runtime["metrics_port"], runtime["metrics_host"]) == (12345, "127.0.0.1")
    assert "metrics_token" not in runtime and runtime["queue_size"] == 6
    assert runtime["http"]["host"] == "127.0.0.1" and runtime["http"]["port"] not in (80, 12345)
    assert (runtime["progress"], runtime["stop_when"]) == (False, "never")
    assert "pipelines" not in runtime and "workers" not in runtime
    assert user["sources"][0]["name"] == "door"  # the user's dict is left as it was
    runtime.pop("http")  # needs the live extra's token rules; the rest is a valid config
    assert len(parse_config(data).sources) == 3


def test_a_video_the_user_asks_for_is_written():
    data = run_config({"output": {"video": "{source}.mp4"}}, 1, Path("c.mp4"), 5.0,
                      Path("/tmp/r"), 1)
    assert data["output"]["video"] == "{source}.mp4"


def window(dropped: int, p99: tuple[float, float] | None, delivered: float) -> Window:
    return Window(offered=100.0, delivered=delivered, dropped=dropped, p50=(0.02, 0.05),
                  p99=p99, hosts=["pipeline0"], busiest=("pipeline0", "infer", 91.6),
                  stages={"infer": (27.5, 0.3), "batch": (0.1, 20.0)})


def test_the_table_has_a_row_per_count_in_order_with_the_verdict_and_the_bottleneck():
    rows = [RunRow(50, 2.0, window(0, (0.05, 0.1), 99.0)),
            RunRow(20, 5.0, window(3, (0.1, 0.2), 99.0)),
            RunRow(80, 1.25, None, error="run.py exited with 1 before every camera delivered")]
    lines = table(rows).splitlines()
    assert lines[0].startswith("| cameras | offered fps | delivered fps | dropped | p50")
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| 20", "| 50", "| 80"]
    assert lines[3] == ("| 50 | 100.0 | 99.0 | 0 | <= 50 ms | <= 100 ms | yes | infer 92% "
                        "(27.5 s work, 0.3 s blocked) |")
    assert "| no: 3 dropped, p99 <= 200 ms |" in lines[2]
    assert "| no: failed (run.py exited with 1 before every camera delivered) |" in lines[4]
    assert largest_held(rows) == 50


def test_the_busiest_stage_says_the_time_its_share_is_of():
    """The user's check, 4.2 s of work in a 6 s window: the share is of the time the host's
    counts cover (from its metrics report sent by the window's start to the one sent by its
    end), and the cell says it, so work / that time is the share shown."""
    w = Window(offered=5.0, delivered=5.0, dropped=0, p50=(0.02, 0.05), p99=(0.05, 0.1),
               hosts=["pipeline0"], spans={"pipeline0": 6.04}, window_s=6.0,
               busiest=("pipeline0", "infer", 100 * 4.2 / 6.04),
               stages={"infer": (4.2, 0.0), "batch": (0.01, 0.0)})
    assert table([RunRow(1, 5.0, w)]).splitlines()[2].endswith(
        "| yes | infer 70% of 6.0 s (4.2 s work, 0.0 s blocked) |")
    assert stage_lines(RunRow(1, 5.0, w)) == (
        "infer 4.2 s work, 0.0 s blocked; batch 0.0 s work, 0.0 s blocked (over the 6.0 s "
        "between the metrics reports at the window's ends)")


def test_a_run_with_an_error_did_not_hold_whatever_its_numbers():
    row = RunRow(5, 2.0, window(0, (0.05, 0.1), 100.0), error="killed")
    assert not row.held and held_text(row) == "no: failed (killed)"


@pytest.mark.parametrize(("dropped", "p99", "delivered", "held", "verdict"), [
    (36120, (0.2, 0.5), 48.0, "no: overload: p99 <= 500 ms, dropped 36,120; latency bounded "
     "(p99 <= 1 s): yes", "12 cameras at 8.33333 fps: overload: p99 <= 500 ms, dropped "
     "36,120; latency bounded (p99 <= 1 s): yes; delivered 48 of 100 frames/s offered (48%)."),
    (945, (1.0, 2.0), 19.2, "no: overload: p99 <= 2000 ms, dropped 945; latency bounded "
     "(p99 <= 1 s): NO", "12 cameras at 8.33333 fps: overload: p99 <= 2000 ms, dropped 945; "
     "latency bounded (p99 <= 1 s): NO; delivered 19 of 100 frames/s offered (19%)."),
    (0, (0.5, 1.0), 94.0, "no: overload: p99 <= 1000 ms, dropped 0; latency bounded (p99 <= "
     "1 s): yes", "12 cameras at 8.33333 fps: overload: p99 <= 1000 ms, dropped 0; latency "
     "bounded (p99 <= 1 s): yes; delivered 94 of 100 frames/s offered (94%)."),
    (3, (0.1, 0.2), 99.0, "no: 3 dropped, p99 <= 200 ms", None),  # delivered: no overload
])
def test_a_paced_row_delivering_less_than_offered_is_an_overload_not_an_error(
        dropped, p99, delivered, held, verdict):
    row = RunRow(12, 100 / 12, window(dropped, p99, delivered))
    assert held_text(row) == held
    assert row.overloaded is (verdict is not None)
    if verdict is not None:
        assert overload_verdict(row) == verdict
        assert verdict in report("H", [row], {}, [], 8.0)


GPU_DECODE = {"fps": 4580.0, "decoders": 16, "mode": "gpu", "processes": 0,
              "cpu_s_per_frame": 0.007, "cpu_fps": 1990.0, "cpu_decoders": 16,
              "cpu_processes": 14, "both_nvdec_fps": 4200.0, "both_cpu_fps": 1800.0,
              "both_fps": 6000.0}
ENGINE = {"images_s": 7300.0, "batch": 64, "backend": "torch", "device": "cuda:0",
          "warmup_s": 12.0}


def test_decode_alone_on_the_gpu_path_shows_nvdec_the_cpu_and_both_at_once():
    (decode, engine) = ceiling_lines({"decode": GPU_DECODE, "engine": ENGINE}, 30.0)
    assert decode == ("decode alone: 4,580 frames/s (16 decoders, gpu, NVDEC): at most 153 "
                      "cameras at 30 fps; the CPU's decoders alone: 1,990 frames/s (16 "
                      "decoders, 14 worker processes); NVDEC and the CPU at once: 6,000 "
                      "frames/s (NVDEC 4,200 + CPU 1,800; decode: auto places every camera on "
                      "NVDEC (runtime.cpu_decode_fps: 0), so the run's decode ceiling is NVDEC "
                      "alone)")
    (both, _) = ceiling_lines({"decode": {**GPU_DECODE, "both_placed": True}, "engine": ENGINE},
                              30.0)
    assert both.endswith("(NVDEC 4,200 + CPU 1,800; runtime.cpu_decode_fps is set: decode: "
                         "auto places cameras on both, so the run's decode ceiling is both at "
                         "once)")
    assert engine.startswith("engine alone: 7,300 images/s (torch on cuda:0, batch 64")


def unpaced_row(delivered: float | None, ended: int = 0, error: str | None = None) -> RunRow:
    engine = EngineWindow(4242, 20.0, 50.0, {"infer": (28.5, 0.2, 150000)})
    w = Window(delivered=delivered, dropped=1200, p50=(0.02, 0.05), p99=(0.1, 0.2),
               hosts=["worker0", "worker1"], ended=ended, gpu_util=97.0, nvdec_util=88.0,
               cpu_busy=8.41, cpus=16,
               gpu_memory=GpuMemory({4242: 2900.0, 4243: 512.0}, "run", [4242]))
    w.add_engines({4242: engine})
    return RunRow(100, None, None if error else w, error=error)


@pytest.mark.parametrize(("ceilings", "ratio", "words"), [
    ({"decode": GPU_DECODE, "engine": ENGINE}, 5100 / 4580, "1.11x the slower of decode "
     "alone and engine alone: decode alone (4,580 frames/s as placed: every camera on NVDEC)"),
    ({"decode": {**GPU_DECODE, "both_placed": True}, "engine": ENGINE}, 5100 / 6000, "0.85x the "
     "slower of decode alone and engine alone: decode alone (6,000 frames/s as placed: NVDEC "
     "and the CPU at once)"),
    ({"decode": "failed", "engine": ENGINE}, 5100 / 7300, "0.70x the slower of decode alone "
     "and engine alone: engine alone (7,300 images/s)"),
    ({}, None, "no ceiling measured"),
])
def test_the_unpaced_row_is_throughput_beside_the_slower_ceiling(ceilings, ratio, words):
    row = unpaced_row(5100.0)
    assert not row.paced and not row.held and not row.overloaded
    assert ceiling_ratio(row, ceilings) == (None if ratio is None else pytest.approx(ratio))
    assert unpaced_verdict(row, ceilings) == (
        f"Unpaced 100 cameras (live: true, pace_fps: null): 5,100 frames/s delivered over the "
        f"window, {words}; 1,200 dropped (a live camera drops what the engine does not take).")
    head, _, cells = unpaced_table([row], ceilings).splitlines()
    assert head == ("| unpaced cameras | delivered fps | x slower ceiling | dropped | p50 latency "
                    "| p99 latency | busiest stage | CPU | GPU | NVDEC | GPU memory |")
    assert cells == (f"| 100 | 5,100.0 | {'-' if ratio is None else f'{ratio:.2f}x'} | 1200 | "
                     f"<= 50 ms | <= 200 ms | engine infer 95% of 30.0 s (28.5 s work, 0.2 s "
                     f"blocked) | "
                     f"8.4 of 16 cores | 97% | 88% | 3,412 MiB in 2 processes, engine 2,900 |")


def test_an_unpaced_camera_that_reached_the_clips_end_or_a_failed_run_is_said():
    assert "1 camera reached the clip's end in the window" in unpaced_verdict(
        unpaced_row(5100.0, ended=1), {})
    assert unpaced_verdict(unpaced_row(None, error="run.py exited with 1"), {}) == (
        "Unpaced 100 cameras (live: true, pace_fps: null): failed (run.py exited with 1)")


def test_a_report_of_paced_and_unpaced_rows_has_both_tables_and_ends_with_the_answer():
    rows = [RunRow(50, 2.0, window(0, (0.05, 0.1), 99.0)), unpaced_row(5100.0)]
    text = report("Header", rows, {"decode": GPU_DECODE, "engine": ENGINE}, ["a note"], 2.0)
    lines = text.splitlines()
    assert lines[0] == "Header" and lines[2].startswith("decode alone: ")
    assert "| 50 | 100.0 | 99.0 | 0 |" in text and "| 100 | 5,100.0 | 1.11x |" in text
    assert "| 100 | 0.0 |" not in text  # the unpaced row is not in the paced table
    assert lines[-2:] == ["Note: a note", "Largest held: 50 cameras at 2 fps (100 frames/s)."]
    only = report("Header", [unpaced_row(5100.0)], {}, [], 2.0)
    assert "Largest held" not in only and "| cameras |" not in only
    assert only.splitlines()[-1].startswith("Unpaced 100 cameras")


def test_unpaced_cameras_are_live_without_a_pace():
    assert camera_sources(2, Path("c.mp4"), None)[1] == {
        "name": "cam001", "uri": "c.mp4", "live": True, "pace_fps": None, "reconnect": False}


def test_each_camera_is_set_like_the_users_first_source_but_for_what_a_camera_sets():
    line = {"type": "line", "name": "door", "start": [0, 0], "end": [10, 10]}
    user = {"sources": [{"name": "door", "uri": "rtsp://x", "live": False, "loop": True,
                         "pace_fps": 5, "reconnect": True, "tracker": "bytetrack",
                         "analytics": [line], "detect_every": 2}, {"name": "other"}]}
    first, second = camera_sources(2, Path("c.mp4"), 30.0, user)
    assert second == {"tracker": "bytetrack", "analytics": [line], "detect_every": 2,
                      "name": "cam001", "uri": "c.mp4", "live": True, "pace_fps": 30.0,
                      "reconnect": False}
    first["analytics"][0]["name"] = "changed"  # each camera has its own copy
    assert second["analytics"][0]["name"] == "door" == user["sources"][0]["analytics"][0]["name"]
    assert camera_sources(1, Path("c.mp4"), 30.0, {"sources": []}) == camera_sources(
        1, Path("c.mp4"), 30.0)


def test_events_written_counts_the_event_lines_and_the_snapshots(tmp_path):
    from pipeline.app.capacity import events_written

    (tmp_path / "cam000.events.jsonl").write_text('{"kind": "enter"}\n{"kind": "exit"}\n')
    (tmp_path / "cam001.events.jsonl").write_text('{"kind": "enter"}\n')
    (tmp_path / "cam000.jsonl").write_text("{}\n{}\n{}\n")  # detections: not events
    (tmp_path / "cam000.events").mkdir()
    for name in ("a.jpg", "b.jpg", "c.mp4"):
        (tmp_path / "cam000.events" / name).write_bytes(b"x")
    assert events_written(tmp_path, "{source}.events.jsonl") == (3, 2)


@pytest.mark.parametrize(("user_http", "overrides", "port"), [
    (None, [], None),  # --http: on, a free loopback port
    ({"host": "0.0.0.0", "port": 80, "token": "${T}", "preview_fps": 2}, [], None),
    (None, ["runtime.http.port=8080", "inference.batch_size=2"], 8080),  # --set wins
])
def test_http_turns_the_live_view_on_at_loopback_without_a_token_but_set_keys_win(
        user_http, overrides, port):
    user = {"runtime": {"http": user_http}, "inference": {"batch_size": 4}}
    data = run_config(user, 2, Path("c.mp4"), 5.0, Path("/tmp/r"), 1, http=True,
                      overrides=overrides)
    http = data["runtime"]["http"]
    assert http["host"] == "127.0.0.1" and "token" not in http
    assert http["port"] == port if port is not None else http["port"] not in (80, 8080, 1)
    assert data["inference"] == {"batch_size": 4}  # only runtime.http keys are applied again
    if user_http is not None:
        assert http["preview_fps"] == 2
    plain = run_config(user, 2, Path("c.mp4"), 5.0, Path("/tmp/r"), 1)
    assert plain["runtime"]["http"] == (None if user_http is None else
                                        {**user_http, "host": "127.0.0.1",
                                         "port": plain["runtime"]["http"]["port"]})


@pytest.mark.parametrize(("control", "text"), [
    (AddRemove(201, 12.0, None, 0.4, 12, 200, 0.3, 0.5),
     "POST 201 ok, DELETE 200 ok, added delivered frames: 12 (first seen 0.4 s after the "
     "POST)"),
    (AddRemove(201, 12.0, None, None, 18, 200, 0.3, 0.5),  # overloaded: its frames came late
     "POST 201 ok, DELETE 200 ok, added delivered frames: 18 (none seen in /api/sources "
     "before the DELETE)"),
    (AddRemove(409, 3.0), "POST 409 FAILED, DELETE - FAILED, added delivered NO frames: - "
     "(none seen in /api/sources before the DELETE)"),
])
def test_the_live_views_add_and_remove_in_words(control, text):
    assert control.text() == text


def test_the_header_says_what_an_auto_backend_and_device_chose_once_the_engine_ran(samples):
    config = parse_config({"sources": [{"name": "a", "uri": str(samples.bikes)}]})
    options = Options(config=Path("cams.yaml"), clip=samples.bikes)
    engine = {"images_s": 7200.0, "batch": 64, "backend": "torch", "device": "cuda",
              "warmup_s": 20.0}
    before = header_text(options, config, samples.bikes, samples.bikes, 250, 30.0)
    after = header_text(options, config, samples.bikes, samples.bikes, 250, 30.0, engine)
    assert "inference auto on auto, batch" in before  # not measured (yet): as configured
    assert "inference torch (auto) on cuda (auto), batch" in after
    # set in the configuration: said as set, whatever ran
    config.inference.backend = "onnxruntime"
    assert "inference onnxruntime on cuda (auto), batch" in header_text(
        options, config, samples.bikes, samples.bikes, 250, 30.0, engine)


def test_a_count_left_out_for_the_budget_says_the_time_it_was_measured_against():
    """A new user read "41 s left, a run takes about 36 s": the run was refused against
    46 s (its warm-up, window and stop, 36 s, and 10 s to start), which it did not say."""
    assert budget_note(60, 1, 41.0, 19.0, 36.0) == (
        "--budget-s 60: 1 camera not tried (41 s left; a run may take 46 s: the longest so far "
        "took 19 s, and start, warm-up, window and stop may take 46 s)")
    assert budget_note(600, 8, 80.0, 120.0, 36.0).startswith(
        "--budget-s 600: 8 cameras not tried (80 s left; a run may take 120 s: ")
    assert budget_note(60, 2, 46.0, 19.0, 36.0) is None  # fits exactly


@pytest.mark.parametrize(("out", "message"), [
    ("{tmp}/file.txt", "error: --out: '{tmp}/file.txt' is a file, not a folder"),
    ("{tmp}/file.txt/sub", "error: --out: cannot create '{tmp}/file.txt/sub': "
                           "'{tmp}/file.txt' is a file, not a folder"),
])
def test_an_out_that_is_no_folder_gets_one_line_and_exit_status_2(tmp_path, capsys, out,
                                                                  message):
    """A new user's --out, an existing file, got 'error: FileExistsError: ...' and exit 1."""
    from pipeline.app.capacity import main

    (tmp_path / "file.txt").write_text("mine")
    out = out.format(tmp=tmp_path)
    # nothing else is looked at: the config and the clip need not exist
    assert main(Options(config=tmp_path / "none.yaml", clip=tmp_path / "none.mp4",
                        out=Path(out))) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", message.format(tmp=tmp_path) + "\n")
    assert (tmp_path / "file.txt").read_text() == "mine"


def test_an_out_folder_this_user_cannot_write_in_is_refused(tmp_path, monkeypatch):
    from pipeline.app.capacity import check_out

    locked = tmp_path / "locked"
    locked.mkdir()
    monkeypatch.setattr("os.access", lambda path, mode: Path(path) != locked)
    with pytest.raises(ConfigError) as refused:
        check_out(locked)
    assert str(refused.value) == f"--out: cannot write in {str(locked)!r}: permission denied"
    with pytest.raises(ConfigError) as refused:
        check_out(locked / "a" / "b")
    assert str(refused.value) == (f"--out: cannot create {str(locked / 'a' / 'b')!r}: no "
                                  f"permission to write in {str(locked)!r}")
    check_out(tmp_path / "new" / "folder")  # made by the run
    check_out(None)
    assert not (tmp_path / "new").exists()


def test_an_out_folder_used_before_is_said_to_have_its_results_replaced(tmp_path):
    from pipeline.app.capacity import replaced_note

    assert replaced_note(tmp_path) is None and replaced_note(None) is None
    (tmp_path / "results.md").write_text("an earlier table")
    assert replaced_note(tmp_path) == (
        f"--out {str(tmp_path)!r}: replacing the earlier results there (results.md, and the "
        "folder of each camera count measured again)")
    (tmp_path / "results.json").write_text("{}")
    assert "(results.md, results.json, and the folder" in replaced_note(tmp_path)


def test_the_unpaced_runs_config_warns_of_its_unpaced_cameras_once(samples, tmp_path):
    """Capacity's unpaced row is 100 live files without pace_fps on purpose: run.py's
    warning of them is one line in its run.log, not 100."""
    from structlog.testing import capture_logs

    from pipeline.app.run import warn_unpaced_files

    user = {"model": {"path": str(samples.model)}}
    unpaced = parse_config(run_config(user, 100, samples.bikes, None, tmp_path, 1))
    paced = parse_config(run_config(user, 100, samples.bikes, 25.0, tmp_path, 1))
    with capture_logs() as logs:
        warn_unpaced_files(paced)
        warn_unpaced_files(unpaced)
    assert [(e["sources"], e["names"]) for e in logs] == [
        (100, "cam000, cam001, cam002 and 97 more")]
