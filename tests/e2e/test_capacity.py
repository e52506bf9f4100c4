"""``run.py capacity`` as users run it: a small real search on the CPU path (the sample clip
as paced cameras through run.py, an engine and two workers) with an overloaded count and an
unpaced row, the live view's add and remove (--http), Ctrl-C while a run is measured, and bad
inputs."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline.app.cli import main

FPS = 5.0  # with N cameras at 5 fps offering 3x the engine's rate, N stays small


def user_config(samples, path: Path, source: dict | None = None, output: dict | None = None,
                **inference) -> Path:
    """A user's CPU config: one camera (replaced by capacity's cameras, each set like it:
    ``source``'s keys), YOLOv3-tiny, batch 4, ``output``."""
    path.write_text(yaml.safe_dump({
        "sources": [{"name": "door", "uri": "rtsp://camera.invalid/stream", **(source or {})}],
        "model": {"path": str(samples.model), "class_names": str(samples.names)},
        "inference": {"device": "cpu", "backend": "onnxruntime", "batch_size": 4, **inference},
        **({"output": output} if output else {}),
        "runtime": {"log_format": "json"}}))
    return path


def capacity(repo_root: Path, *args: str, **popen) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "run.py", "capacity", *args], cwd=repo_root,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def table_rows(text: str, head: str = "| cameras |") -> dict[int, list[str]]:
    """cameras -> the cells of its row in the table whose header starts with ``head``."""
    rows: dict[int, list[str]] = {}
    inside = False
    for line in text.splitlines():
        inside = line.startswith(head) or (inside and line.startswith("|"))
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if inside and cells[0].isdigit():
            rows[int(cells[0])] = cells
    return rows


@pytest.fixture(scope="module")
def small_search(samples, repo_root, tmp_path_factory):
    """``--cameras 1,N`` at 5 fps, N cameras offering three times what the engine alone
    does on this machine (so N cannot hold: an overload), then 2 unpaced cameras; an engine
    process and two workers: (N, exit status, stdout, stderr, --out)."""
    from pipeline.app.ceilings import engine_rate
    from pipeline.config import load_config

    tmp = tmp_path_factory.mktemp("capacity")
    config = user_config(samples, tmp / "cams.yaml")
    one = load_config(config, [f"sources=[{{name: c, uri: '{samples.bikes}'}}]"])
    # at least 4 (20 fps): an engine rate measured while the machine was busy can come out
    # low enough that 2 cameras were held once (9.8 of 10 fps)
    too_many = max(4, math.ceil(3 * engine_rate(one, 1.0).images_s / FPS))
    out = tmp / "out"
    process = capacity(repo_root, "--config", str(config), "--clip", str(samples.bikes),
                       "--fps", f"{FPS:g}", "--cameras", f"1,{too_many}", "--seconds", "6",
                       "--warmup-s", "1", "--unpaced", "2", "--set", "runtime.workers=2",
                       "--out", str(out))
    stdout, stderr = process.communicate(timeout=400)
    return too_many, process.returncode, stdout, stderr, out


@pytest.mark.slow  # three runs through run.py and both ceilings: about 60 s
def test_a_small_search_prints_a_row_per_count_held_decided_from_the_numbers(small_search):
    too_many, status, stdout, stderr, out = small_search
    assert status == 0, stderr
    rows = table_rows(stdout)
    assert sorted(rows) == [1, too_many], stdout
    results = json.loads((out / "results.json").read_text())
    runs = {run["cameras"]: run for run in results["runs"] if run["paced"]}
    for cameras, cells in rows.items():
        run, window = runs[cameras], runs[cameras]["window"]
        assert run["exit_code"] == 0 and run["error"] is None, run  # run.py stopped cleanly
        assert cells[1] == f"{cameras * FPS:,.1f}" == f"{window['offered']:,.1f}"
        assert cells[2] == f"{window['delivered']:,.1f}" and window["delivered"] > 0
        assert cells[3] == str(window["dropped"])
        assert cells[4].startswith("<=") and cells[5].startswith(("<=", ">"))
        held = (window["dropped"] == 0 and window["p99"][1] <= 0.1
                and window["delivered"] >= 0.95 * window["offered"])
        assert run["held"] is held and cells[6].startswith("yes" if held else "no: "), cells
        assert " s work, " in cells[7] and " s blocked)" in cells[7], cells
        # the machine's CPUs busy over the window (the run's processes among others)
        assert cells[8] == f"{window['cpu_busy']:.1f} of {window['cpus']} cores", cells
        assert 0 < window["cpu_busy"] <= window["cpus"], window
    # three times what the engine alone does cannot be delivered: an overload, its drops and
    # p99 the result; the engine's infer (read from its JSON log lines) is the bottleneck
    window = runs[too_many]["window"]
    assert window["delivered"] < 0.95 * too_many * FPS and runs[too_many]["overloaded"]
    p99 = stdout_latency(window["p99"])
    bounded = "yes" if window["p99"][1] <= 1.0 else "NO"
    assert rows[too_many][6] == (f"no: overload: p99 {p99}, dropped {window['dropped']:,}; "
                                 f"latency bounded (p99 <= 1 s): {bounded}"), stdout
    assert rows[too_many][7].startswith("engine infer "), stdout
    assert window["engines"]["engine"]["stages"]["infer"][0] > 0
    assert f"{too_many} cameras at {FPS:g} fps: overload: p99 {p99}" in stdout
    best = 1 if runs[1]["held"] else 0
    assert results["largest_held"] == best
    assert stdout.splitlines()[-1].startswith("Largest held: " + (f"1 camera at {FPS:g} fps" if best
                                                                  else "none"))
    assert stdout == (out / "results.md").read_text()
    engine, decode = results["ceilings"]["engine"], results["ceilings"]["decode"]
    assert engine["backend"] == "onnxruntime" and engine["batch"] == 4 and engine["images_s"] > 0
    assert decode["mode"] == "cpu" and decode["fps"] > 0
    assert f"engine alone: {engine['images_s']:,.0f} images/s (onnxruntime on cpu, batch 4" \
        in stdout
    assert f"decode alone: {decode['fps']:,.0f} frames/s ({decode['decoders']} decoders, cpu" \
        in stdout
    for cameras in rows:
        folder = out / f"cameras-{cameras:03d}"
        assert '"event": "run finished"' in (folder / "run.log").read_text()
        generated = yaml.safe_load((folder / "config.yaml").read_text())
        assert len(generated["sources"]) == cameras
        assert not Path(generated["output"]["dir"]).exists()  # the records are deleted


def stdout_latency(bucket: list[float] | None) -> str:
    from pipeline.app.capacity_report import latency_text

    return latency_text(None if bucket is None else tuple(bucket))


@pytest.mark.slow  # the same command as the search above
def test_the_unpaced_row_is_throughput_beside_the_slower_ceiling(small_search):
    _, status, stdout, stderr, out = small_search
    assert status == 0, stderr
    results = json.loads((out / "results.json").read_text())
    (run,) = [run for run in results["runs"] if not run["paced"]]
    window, ceilings = run["window"], results["ceilings"]
    assert run["cameras"] == 2 and run["error"] is None and run["exit_code"] == 0, run
    assert window["delivered"] > 0 and window["offered"] is None and not run["held"]
    assert window["ended"] == 0  # the looped clip outlasted the window
    slower = min(ceilings["decode"]["fps"], ceilings["engine"]["images_s"])
    assert run["ceiling_ratio"] == pytest.approx(window["delivered"] / slower)
    (cells,) = table_rows(stdout, "| unpaced cameras |").values()
    assert cells[:4] == ["2", f"{window['delivered']:,.1f}", f"{run['ceiling_ratio']:.2f}x",
                         str(window["dropped"])], stdout
    assert (f"Unpaced 2 cameras (live: true, pace_fps: null): {window['delivered']:,.0f} "
            f"frames/s delivered over the window, {run['ceiling_ratio']:.2f}x the slower of "
            f"decode alone and engine alone") in stdout
    generated = yaml.safe_load((out / "unpaced-002" / "config.yaml").read_text())
    assert [(s["live"], s["pace_fps"]) for s in generated["sources"]] == [(True, None)] * 2


WHOLE_FRAME = {"type": "zone", "name": "all", "polygon": [[0, 0], [640, 0], [640, 272], [0, 272]]}


@pytest.mark.slow  # one paced run with the live view: about 20 s
def test_http_adds_and_removes_a_camera_in_the_window(samples, repo_root, tmp_path):
    """Its user's camera is tracked, with a zone and event snapshots: so is each camera
    (and the one added), and the table says how many events and snapshots were written."""
    from pipeline.app.measurement import free_port

    out, port = tmp_path / "out", free_port()
    config = user_config(samples, tmp_path / "c.yaml",
                         source={"tracker": "bytetrack", "analytics": [WHOLE_FRAME]},
                         output={"events": "{source}.events.jsonl",
                                 "event_media": {"clip": None}}, backend="auto", device="auto")
    # at 4 fps: past frame 26's events. A 12 s window: the camera added at 20% of it has
    # until 90% to show a frame in /api/sources (8 s left it 5.6 s, and a loaded CI machine
    # once answered the POST in 1.5 s and listed its first frame too late)
    process = capacity(repo_root, "--config", str(config),
                       "--clip", str(samples.bikes), "--fps", "4", "--cameras", "1",
                       "--seconds", "12", "--warmup-s", "1", "--no-ceilings", "--http",
                       "--set", f"runtime.http.port={port}", "--out", str(out))
    stdout, stderr = process.communicate(timeout=180)
    assert process.returncode == 0, stderr
    # with no ceiling measured, the header says what the run's auto chose (it once read
    # "inference auto on auto")
    assert "inference onnxruntime (auto) on cpu (auto), batch 4" in stdout, stdout
    generated = yaml.safe_load((out / "cameras-001" / "config.yaml").read_text())
    assert generated["runtime"]["http"] == {"host": "127.0.0.1", "port": port}  # --set wins
    (camera,) = generated["sources"]
    assert (camera["name"], camera["tracker"], camera["analytics"]) == ("cam000", "bytetrack",
                                                                       [WHOLE_FRAME])
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    # each enter has its snapshot; the exits closed at the stop have no frame, so none
    assert 0 < run["snapshots"] <= run["events"], run
    assert table_rows(stdout)[1][-1] == f"{run['events']:,} ({run['snapshots']:,} snapshots)"
    control = run["control"]
    assert (control["post_status"], control["delete_status"]) == (201, 200), control
    assert control["added_ok"] and control["removed_ok"] and control["added_frames"] > 0
    assert run["window"]["delivered"] > 0 and run["error"] is None  # added is not counted
    assert table_rows(stdout)[1][-2].startswith("POST 201 ok, DELETE 200 ok, added "
                                                "delivered frames: "), stdout
    assert ("| held | busiest stage | CPU | live view (--http) | events written, whole run |"
            in stdout)
    log = (out / "cameras-001" / "run.log").read_text()
    ended = [line for line in log.splitlines() if '"event": "source ended"' in line
             and '"source": "added"' in line]
    assert len(ended) == 1, log  # its outputs finalised once, while the others ran on


def test_ctrl_c_stops_the_measured_run_cleanly_and_prints_what_was_measured(samples,
                                                                            repo_root,
                                                                            tmp_path):
    temp = tmp_path / "temp"  # no --out: the logs go to a new folder here, and stay
    temp.mkdir()
    process = capacity(repo_root, "--config", str(user_config(samples, tmp_path / "c.yaml")),
                       "--clip", str(samples.bikes), "--fps", "2", "--cameras", "1",
                       "--seconds", "30", "--warmup-s", "0", "--no-ceilings",
                       env={**os.environ, "TMPDIR": str(temp)})
    deadline = time.monotonic() + 60
    while (not list(temp.glob("capacity-logs-*/cameras-001/metrics-start.txt"))
           and process.poll() is None and time.monotonic() < deadline):
        time.sleep(0.2)
    [window_open] = temp.glob("capacity-logs-*/cameras-001/metrics-start.txt")
    out = window_open.parent.parent
    process.send_signal(signal.SIGINT)  # as the terminal's Ctrl-C reaches it: run.py does not
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert "Note: interrupted" in stdout and "Largest held: none" in stdout
    assert f"results.md / results.json: {out} (--out DIR chooses the folder)" in stdout
    assert stdout == (out / "results.md").read_text()
    assert [p.name for p in temp.glob("capacity-*")] == [out.name]  # the clips' one deleted
    log = (out / "cameras-001" / "run.log").read_text()
    assert '"event": "run finished"' in log  # one SIGINT: it finished its frames and ended
    assert '"event": "aborting"' not in log
    config = str(out / "cameras-001" / "config.yaml")
    assert not any(config in command for command in commands())  # no child left running


def commands() -> list[str]:
    """The command line of every process of this user (Linux)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            found.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return found


@pytest.mark.parametrize(("args", "message"), [
    (["--clip", "{tmp}/missing.mp4"], "error: --clip: file not found: '{tmp}/missing.mp4'"),
    (["--clip", "{tmp}"], "error: --clip: '{tmp}' is a folder, not a video file"),
    (["--clip", "{tmp}/c.yaml"], "error: --clip: cannot read '{tmp}/c.yaml'"),
    (["--clip", "{bikes}", "--config", "{tmp}/none.yaml"],
     "error: config: cannot read '{tmp}/none.yaml'"),
    (["--clip", "{bikes}", "--set", "inference.batch_size=0"], "error: inference.batch_size"),
    (["--clip", "{bikes}", "--set", "model.path={tmp}/none.onnx"], "error: model.path"),
    (["--clip", "{bikes}", "--set", "inference.nonsense=1"], "error: inference.nonsense: unknown key"),
    (["--clip", "{bikes}", "--cameras", "ten"], "error: --cameras: expected camera counts"),
    (["--clip", "{bikes}", "--seconds", "2"], "error: --seconds: at least 5"),
    (["--clip", "{bikes}", "--fps", "0"], "error: --fps: above 0"),
    ([], "error: capacity: --clip is required"),
])
def test_bad_inputs_get_one_line_and_exit_status_2(samples, tmp_path, capsys, args, message):
    config = user_config(samples, tmp_path / "c.yaml")
    fill = {"tmp": str(tmp_path), "bikes": str(samples.bikes)}
    argv = ["capacity", "--config", str(config), *[a.format(**fill) for a in args]]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(message.format(**fill)), captured.err
    assert len(captured.err.splitlines()) == 1, captured.err


def test_capacity_options_are_refused_by_the_other_commands(samples, tmp_path, capsys):
    assert main(["--config", str(user_config(samples, tmp_path / "c.yaml")), "--clip",
                 str(samples.bikes), "--cameras", "2"]) == 2
    assert capsys.readouterr().err == ("error: --clip, --cameras: options of the capacity "
                                       "command (run.py capacity --config cams.yaml --clip "
                                       "my.mp4)\n")
