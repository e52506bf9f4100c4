"""pipeline.app.measurement: a window's numbers and verdict from hand-made metrics pages, and
the child process it measures started and stopped."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from pipeline.app import measurement
from pipeline.app.measurement import (
    SCRAPE_PERIOD_S,
    CpuTicks,
    HostSample,
    MeasurementError,
    MetricsPoller,
    UtilisationSampler,
    Window,
    bucket_text,
    cores_busy,
    cpu_ticks,
    dropped_between,
    gpu_memory,
    launch,
    parse_compute_apps,
    parse_metrics,
    percentile_bucket,
    process_tree,
    query_compute_apps,
    stop,
    window_numbers,
)
from pipeline.app.run_log import EngineWindow
from tests.support.harness import wait_for


def metrics_page(frames: int, fast: int, dropped: int = 0, work: float = 1.0,
                 cam1: str = "running") -> str:
    """A cluster /metrics page: cam0 on host p0 (``fast`` of its ``frames`` within 50 ms,
    the rest within 200 ms), ``added`` on p0 too (ignored), cam1 on p1 (all within 10 ms)."""
    lines = []
    for host, source, count, le in (("p0", "cam0", frames, None), ("p0", "added", 7, None),
                                    ("p1", "cam1", frames, 0.01)):
        lines.append(f'pipeline_source_frames_total{{pipeline="{host}",source="{source}"}} '
                     f'{count}')
        lines.append(f'pipeline_source_dropped_frames_total{{pipeline="{host}",'
                     f'source="{source}"}} {dropped if source == "cam0" else 0}')
        for bound in ("0.01", "0.05", "0.1", "0.2", "+Inf"):
            if le is not None:
                value = count
            else:
                value = fast if float(bound) <= 0.05 else count
                value = 0 if bound == "0.01" else value
            lines.append(f'pipeline_frame_latency_seconds_bucket{{le="{bound}",pipeline='
                         f'"{host}",source="{source}"}} {value}')
    for state in ("running", "ended"):
        lines.append(f'pipeline_source_state{{pipeline="p1",source="cam1",state="{state}"}} '
                     f'{int(state == cam1)}')
    for host in ("p0", "p1"):
        for stage, seconds in (("infer", work), ("sink:cam0", work / 4), ("sink:cam1", work / 4)):
            lines.append(f'pipeline_stage_work_seconds_total{{pipeline="{host}",'
                         f'stage="{stage}"}} {seconds}')
            lines.append(f'pipeline_stage_blocked_seconds_total{{pipeline="{host}",'
                         f'stage="{stage}"}} {seconds / 10}')
    return "\n".join(["# TYPE pipeline_source_frames_total counter", *lines]) + "\n"


@pytest.mark.parametrize(("buckets", "share", "expected"), [
    ({0.05: 0, 0.1: 99, math.inf: 100}, 0.99, (0.05, 0.1)),
    ({0.05: 0, 0.1: 98, math.inf: 100}, 0.99, (0.1, math.inf)),
    ({0.05: 50, 0.1: 100, math.inf: 100}, 0.5, (0.0, 0.05)),
    ({0.05: 0, math.inf: 0}, 0.99, None),
])
def test_a_percentile_is_the_bucket_it_falls_in(buckets, share, expected):
    assert percentile_bucket(buckets, share) == expected


def test_bucket_text_states_the_bounds():
    assert bucket_text((0.05, 0.1)) == "<= 100 ms (50-100)"
    assert bucket_text((30.0, math.inf)) == "> 30000 ms"
    assert bucket_text(None) == "-"


def test_window_numbers_count_the_configured_cameras_per_host_and_in_all():
    poller = MetricsPoller("http://unused")
    start = time.monotonic()
    for at, text in ((start, metrics_page(100, 100)),
                     (start + 2.0, metrics_page(300, 296, dropped=3, work=3.0))):
        for host, sample in parse_metrics(text).items():
            poller.history.setdefault(host, []).append((at, sample))
    result = Window()
    window_numbers(poller, start, start + 2.0, {"cam0", "cam1"}, result)
    assert result.delivered == pytest.approx(200.0)  # (200 + 200) frames in 2 s; added ignored
    assert result.dropped == 3
    # p0: 196 of its 200 frames <= 50 ms (98%), the rest <= 100 ms; p1: all <= 10 ms
    assert result.host_p99 == {"p0": (0.05, 0.1), "p1": (0.0, 0.01)}
    assert result.p99 == (0.01, 0.05)  # 396 of the 400 frames <= 50 ms: 99%
    assert result.stages["infer"] == pytest.approx((4.0, 0.4))  # 2 s of work on each host
    assert result.stages["sinks"] == pytest.approx((2.0, 0.2))
    assert result.busiest == ("p0", "infer", pytest.approx(100.0))
    assert result.host_cameras == {"p0": 1, "p1": 1}
    assert result.ended == 0


def test_cameras_that_ended_by_the_windows_end_are_counted():
    poller = MetricsPoller("http://unused")
    for at, text in ((0.0, metrics_page(100, 100)), (2.0, metrics_page(300, 300, cam1="ended"))):
        for host, sample in parse_metrics(text).items():
            poller.history.setdefault(host, []).append((at, sample))
    result = Window()
    window_numbers(poller, 0.0, 2.0, {"cam0", "cam1"}, result)
    assert result.ended == 1


@pytest.mark.parametrize(("infer_work", "busiest"), [
    (1.9, ("engine", "infer", pytest.approx(95.0))),  # the engine's infer: 1.9 s of 2 s
    (0.5, ("p0", "decode", pytest.approx(60.0))),  # a host's stage is busier
])
def test_the_busiest_stage_is_named_among_the_hosts_and_the_engine(infer_work, busiest):
    window = Window(stages={"decode": (1.2, 0.0)}, busiest=("p0", "decode", 60.0))
    window.add_engines({7: EngineWindow(7, 10.0, 12.0, {"infer": (infer_work, 0.1, 64),
                                                         "batch": (0.2, 1.5, 64)})})
    assert window.busiest == busiest
    assert window.stage_numbers("engine", "infer") == (infer_work, 0.1)
    assert window.stage_numbers("p0", "decode") == (1.2, 0.0)


def test_several_engines_are_named_by_their_pid():
    window = Window()
    window.add_engines({7: EngineWindow(7, 0.0, 10.0, {"infer": (9.0, 0.0, 1)}),
                        8: EngineWindow(8, 0.0, 10.0, {"infer": (3.0, 0.0, 1)})})
    assert sorted(window.engines) == ["engine 7", "engine 8"]
    assert window.busiest == ("engine 7", "infer", pytest.approx(90.0))


def test_gpu_memory_is_the_runs_processes_or_all_when_none_is_the_runs():
    apps = parse_compute_apps("4242, 2900\n4243, 512\n99, 8000\n4244, [N/A]\n\n")
    assert apps == {4242: 2900.0, 4243: 512.0, 99: 8000.0}
    ours = gpu_memory(apps, {1, 4242, 4243})
    ours.engine_pids = [4242]
    assert (ours.scope, ours.total_mib, len(ours.by_pid), ours.engine_mib) == (
        "run", 3412.0, 2, 2900.0)
    other = gpu_memory(apps, {1})  # another pid namespace: nvidia-smi shows other pids
    assert (other.scope, other.total_mib, other.engine_mib) == ("all", 11412.0, None)
    assert gpu_memory(None, {1}) is None  # no nvidia-smi
    assert gpu_memory({}, {1}).total_mib == 0


def test_the_process_tree_holds_the_children():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        tree = process_tree(os.getpid())
        assert {os.getpid(), child.pid} <= tree and os.getppid() not in tree
    finally:
        child.kill()
        child.wait()




@pytest.mark.parametrize(("dropped", "p99", "delivered", "held", "why"), [
    (0, (0.05, 0.1), 95.0, True, []),  # every bound met exactly: 100 ms is a bucket bound
    (1, (0.05, 0.1), 100.0, False, ["1 dropped"]),
    (0, (0.1, 0.2), 100.0, False, ["p99 <= 200 ms"]),
    (0, (30.0, math.inf), 100.0, False, ["p99 > 30000 ms"]),
    (0, None, 100.0, False, ["no latency counted"]),  # no frame reached a sink
    (0, (0.0, 0.05), 94.9, False, ["delivered 95% of offered"]),
    (2, (0.2, 0.5), 50.0, False, ["2 dropped", "p99 <= 500 ms", "delivered 50% of offered"]),
])
def test_held_is_zero_dropped_p99_within_100_ms_and_95_percent_delivered(dropped, p99,
                                                                          delivered, held, why):
    window = Window(offered=100.0, delivered=delivered, dropped=dropped, p99=p99)
    assert window.held is held
    assert window.why_not_held() == why


def test_drops_not_held_name_their_logged_reasons_largest_first():
    window = Window(offered=100.0, delivered=100.0, dropped=6, p99=(0.05, 0.1),
                    drop_reasons={"queue_full": 1, "no_engine_slot": 5})
    assert window.why_not_held() == ["6 dropped (logged: no_engine_slot 5, queue_full 1)"]


def test_a_window_not_measured_did_not_hold():
    assert not Window().held and Window().why_not_held() == ["not measured"]


def drops(**counts: float) -> HostSample:
    return HostSample(dropped=dict(counts))


def test_drops_between_two_times_are_summed_over_the_hosts_a_camera_ran_on():
    poller = MetricsPoller("http://unused")
    poller.history = {
        # cam0 drops 2 on w0 before the window and 3 in it; cam9 is not asked about
        "w0": [(1.0, drops(cam0=2, cam9=5)), (4.0, drops(cam0=5, cam9=50)),
               (9.0, drops(cam0=9))],  # after the window: not counted
        # killed before the window: its last snapshot stays
        "w1": [(1.0, drops(cam1=4))],
        # restarted under its name in the window: counters afresh (a fall counts as 0),
        # cam1 moved onto it and dropped 1 there
        "w2": [(1.0, drops(cam2=7)), (3.0, drops(cam2=0, cam1=1))],
    }
    assert dropped_between(poller, 2.0, 5.0, {"cam0", "cam1", "cam2"}) == 3 + 0 + 1
    assert dropped_between(poller, 2.0, 5.0, {"cam9"}) == 45
    assert dropped_between(poller, 0.0, 0.5, {"cam0"}) == 0  # no snapshot by then


def test_query_compute_apps_per_process_from_nvidia_smi(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '101, 4000'\necho '102, 300'\necho '101, 10'\n"
                    "echo '[N/A], [N/A]'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert query_compute_apps() == {101: 4010.0, 102: 300.0}  # two GPUs' entries summed
    fake.unlink()
    assert query_compute_apps() is None


def test_the_utilisation_sampler_reads_the_gpu_and_its_decoders_from_nvidia_smi(
        tmp_path, monkeypatch):
    """A fake ``nvidia-smi`` (no GPU here): its answers averaged over a window; a device
    without a decoder figure (``[N/A]``) still gives the GPU's; an answer that is not one
    leaves a gap, not a zero."""
    fake = tmp_path / "nvidia-smi"
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # NVML absent: the CLI is read

    def sampled(*answers: str) -> UtilisationSampler:
        """A sampler, stopped after four samples, while the fake gives ``answers`` in turn."""
        turn = tmp_path / "turn"
        turn.write_text("0")
        lines = "".join(f"  {i}) echo '{answer}';;\n" for i, answer in enumerate(answers))
        fake.write_text(f"#!/bin/sh\nn=$(cat {turn}); echo $(( (n + 1) % {len(answers)} )) > {turn}\n"
                        f"case $n in\n{lines}esac\n")
        fake.chmod(0o755)
        with UtilisationSampler(True, interval_s=0.01) as sampler:
            wait_for(lambda: len(sampler.samples) >= 4, "four samples")
        return sampler

    start = time.perf_counter()
    sampler = sampled("90, 80", "100, 60", "no GPU found")
    assert {sample[1:] for sample in sampler.samples} == {(90.0, 80.0), (100.0, 60.0)}
    gpu, nvdec = sampler.mean(start, time.perf_counter())
    assert 90 <= gpu <= 100 and 60 <= nvdec <= 80 and gpu - 90 == pytest.approx((80 - nvdec) / 2)
    assert sampler.mean(0.0, start) is None  # none taken then
    assert {s[1:] for s in sampled("97, [N/A]").samples} == {(97.0, None)}
    assert sampled("97, [N/A]").mean(0.0, time.perf_counter()) == (97.0, None)
    with UtilisationSampler(False, interval_s=0.01) as off:
        time.sleep(0.05)
    assert off.samples == [] and off.mean(0.0, time.perf_counter()) is None


def test_a_window_needs_two_snapshots_of_every_host():
    poller = MetricsPoller("http://unused")
    poller.history["p0"] = [(1.0, parse_metrics(metrics_page(1, 1))["p0"])]
    with pytest.raises(MeasurementError, match="host p0: fewer than two metrics snapshots"):
        window_numbers(poller, 0.0, 2.0, {"cam0"}, Window())


def test_an_idle_host_counts_from_its_snapshot_before_the_window():
    # p1's counters never change (a worker without cameras): one snapshot, before the window
    poller = MetricsPoller("http://unused")
    poller.history["p0"] = [(t, parse_metrics(metrics_page(100 * t, 100 * t, work=t))["p0"])
                            for t in (1.0, 2.0, 3.0)]
    poller.history["p1"] = [(0.5, parse_metrics(metrics_page(5, 5))["p1"])]
    result = Window()
    window_numbers(poller, 1.0, 3.0, {"cam0", "cam1"}, result)
    assert result.delivered == pytest.approx(100.0)  # cam0: 200 frames in 2 s; cam1: none
    assert result.stages["infer"][0] == pytest.approx(2.0)  # p0's 2 s; p1's none
    assert result.host_cameras == {"p0": 1, "p1": 1}


class PacedHost:
    """A host sending its metrics at the times ``sends``, read at a fake clock (``now``): one
    camera paced at ``fps`` (its frames as of a sending: ``fps`` x that time) and an infer
    stage busy all the time (its work: that time). ``urlopen`` stands in for
    ``urllib.request.urlopen``: the clock advances ``took`` s per scrape, the page as of its
    middle."""

    def __init__(self, sends: list[float], fps: float = 5.0, took: float = 0.005) -> None:
        self.sends, self.fps, self.took, self.now = sends, fps, took, 0.0

    def page(self, at: float) -> str:
        sent = max((t for t in self.sends if t <= at), default=None)
        if sent is None:
            return ""
        return (f'pipeline_source_frames_total{{pipeline="p0",source="cam0"}} {self.fps * sent}\n'
                f'pipeline_frame_latency_seconds_bucket{{le="0.05",pipeline="p0",source="cam0"}} '
                f'{self.fps * sent}\n'
                f'pipeline_frame_latency_seconds_bucket{{le="+Inf",pipeline="p0",source="cam0"}} '
                f'{self.fps * sent}\n'
                f'pipeline_stage_work_seconds_total{{pipeline="p0",stage="infer"}} {sent}\n')

    def urlopen(self, url: str, timeout: float) -> object:
        text = self.page(self.now + self.took / 2)
        self.now += self.took

        class Answer:
            def __enter__(self) -> Answer:
                return self

            def __exit__(self, *exc: object) -> None:
                pass

            def read(self) -> bytes:
                return text.encode()

        return Answer()


@pytest.fixture
def fake_clock(monkeypatch):
    """``make(sends)``: a ``PacedHost`` whose clock and /metrics the measurement reads."""
    def make(sends: list[float]) -> PacedHost:
        host = PacedHost(sends)
        monkeypatch.setattr(measurement, "time", SimpleNamespace(monotonic=lambda: host.now))
        monkeypatch.setattr(measurement.urllib.request, "urlopen", host.urlopen)
        return host
    return make


def test_a_snapshot_is_timed_when_the_host_sent_it_not_when_it_was_first_seen(fake_clock):
    """Sent at 1.05 and 1.31: the first scrape that shows each answers up to a scrape period
    later (1.205; 1.335, off the poller's beat). Each is timed between the scrape before it
    began and that answer, so its time is off by at most half of that."""
    host = fake_clock([0.0, 1.05, 1.31])
    poller = MetricsPoller("http://unused")
    for began in (0.8, 1.0, 1.2, 1.33):
        host.now = began
        poller.scrape()
    times = [at for at, _ in poller.history["p0"]]
    assert times[1:] == [pytest.approx((1.0 + 1.205) / 2), pytest.approx((1.2 + 1.335) / 2)]
    for sent, at, (before, seen) in zip((1.05, 1.31), times[1:], ((1.0, 1.205), (1.2, 1.335))):
        assert abs(at - sent) <= (seen - before) / 2


def paced_window(make_host, seed: int, seconds: float = 6.0) -> tuple[Window, float]:
    """One window of ``seconds`` over a ``PacedHost`` sending every 1 to 1.05 s (``seed``:
    the phases), the poller scraping every ``SCRAPE_PERIOD_S`` and the window's ends scraped
    off its beat, as ``capacity`` does (t0, a scrape; ... a scrape, t1). Returns the window
    and the time its counts cover (``MetricsPoller.ends``)."""
    rng = random.Random(seed)
    sends, at = [], rng.uniform(0.0, 1.0)
    while at < 20:
        sends.append(at)
        at += 1.0 + rng.uniform(0.0, 0.05)
    host = make_host(sends)
    poller = MetricsPoller("http://unused")
    start, beat = rng.uniform(3.0, 4.0), rng.uniform(0.0, SCRAPE_PERIOD_S)
    t0 = t1 = None
    while t1 is None:
        if t0 is None and beat >= start:
            host.now = start
            t0 = host.now
            poller.scrape()
        elif t0 is not None and beat >= start + seconds:
            host.now = start + seconds
            poller.scrape()
            t1 = host.now
        host.now = began = max(host.now, beat)  # the poller's beat
        poller.scrape()
        beat = began + SCRAPE_PERIOD_S
    result = Window()
    window_numbers(poller, t0, t1, {"cam0"}, result)
    first, _, last, _ = poller.ends(t0, t1)["p0"]
    return result, last - first


def test_a_paced_camera_is_never_read_faster_than_it_is_paced_beyond_the_timing_error(
        fake_clock):
    """A camera paced at 5 fps and a stage busy all the time, over 300 phases of the host's
    reports and the poller's scrapes in a 6 s window. The counts run from the snapshot sent
    by the window's start to the one sent by its end: they cover all the window but at most
    one report period (the first and last snapshot inside it, timed when first seen, covered
    as little as 4.0 of the 6 s here, and the shorter the time, the more an error in it or
    a batch more at one end weighs). The rates divide by the time between those two
    sendings, each known to within half the time between the scrape before it and the one
    that showed it: together within a scrape period (and two scrapes' own time). So 5 fps
    is never read as more than that error allows over the window less a report period, nor
    the stage as busier than 100% by more; and every figure is a change over the time it
    covers."""
    timing = SCRAPE_PERIOD_S + 2 * PacedHost([]).took
    error = timing / (6.0 - 1.05)
    found = [paced_window(fake_clock, seed) for seed in range(300)]
    assert min(span for _, span in found) >= 6.0 - 1.05
    assert max(window.delivered for window, _ in found) <= 5.0 * (1 + error)
    assert min(window.delivered for window, _ in found) >= 5.0 * (1 - error)
    assert max(window.busiest[2] for window, _ in found) <= 100 * (1 + error)
    for window, span in found:  # every figure: a change over the time it covers
        assert window.spans == {"p0": span}
        assert window.stages["infer"][0] == pytest.approx(window.delivered / 5.0 * span)
        assert window.busiest[2] == pytest.approx(100 * window.stages["infer"][0] / span)


def test_a_host_that_sent_one_new_snapshot_in_the_window_counts_over_the_time_between_them():
    """p0 sent at 0.5 and at 1.5, nothing more by the window's end (3.0): its 100 frames
    cover the second between those sendings, not the 2 s of the window."""
    poller = MetricsPoller("http://unused")
    poller.history["p0"] = [(at, parse_metrics(metrics_page(frames, frames, work=work))["p0"])
                            for at, frames, work in ((0.5, 100, 1.0), (1.5, 200, 1.8))]
    result = Window()
    window_numbers(poller, 1.0, 3.0, {"cam0"}, result)
    assert result.delivered == pytest.approx(100.0)
    assert result.busiest == ("p0", "infer", pytest.approx(80.0))
    assert result.spans == {"p0": pytest.approx(1.0)}


def test_the_child_runs_in_its_own_group_and_stops_on_one_sigint(tmp_path):
    """A Ctrl-C at the terminal reaches only the measuring process; ``stop`` sends the
    child one SIGINT, so it stops gracefully (a second would abort run.py)."""
    script = ("import signal, sys, time\n"  # its own handler, as run.py sets one
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "print('ready', flush=True)\n"
              "try:\n    time.sleep(60)\n"
              "except KeyboardInterrupt:\n    print('stopped once', flush=True)\n"
              "    sys.exit(0)\n")
    process, reader = launch([sys.executable, "-c", script], tmp_path / "child.log")
    log, deadline = tmp_path / "child.log", time.monotonic() + 20
    while not (log.exists() and "ready" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.getpgid(process.pid) != os.getpgid(0)
    assert stop(process, wait_s=20) == (0, None)
    reader.join(5)
    assert "stopped once" in log.read_text()


STAT = """cpu  {user} 0 {system} {idle} {iowait} 0 0 0 0 0
cpu0 1 0 1 1 0 0 0 0 0 0
cpu1 1 0 1 1 0 0 0 0 0 0
cpu2 1 0 1 1 0 0 0 0 0 0
cpu3 1 0 1 1 0 0 0 0 0 0
intr 12345
"""


def test_the_machine_s_cores_busy_come_from_proc_stat_s_ticks():
    """Two readings of /proc/stat (4 CPUs): 300 of 1,000 ticks worked (user and system; idle
    and iowait are not work) is 1.2 cores busy."""
    before = cpu_ticks(STAT.format(user=1000, system=500, idle=8000, iowait=500))
    after = cpu_ticks(STAT.format(user=1200, system=600, idle=8650, iowait=550))
    assert before == CpuTicks(busy=1500.0, total=10000.0, cpus=4)
    assert cores_busy(before, after) == pytest.approx(4 * 300 / 1000)
    assert cores_busy(before, before) is None  # no time between
    assert cores_busy(None, after) is None
    assert cpu_ticks("intr 1\n") is None and cpu_ticks("") is None  # not a /proc/stat


def test_this_machine_s_proc_stat_reads_and_its_cores_busy_are_within_its_cpus():
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat: not Linux")
    before = cpu_ticks()
    deadline = time.perf_counter() + 0.3
    while time.perf_counter() < deadline:  # this process keeps one core busy
        pass
    busy = cores_busy(before, cpu_ticks())
    assert before is not None and before.cpus >= 1
    assert busy is not None and 0.5 <= busy <= before.cpus, busy
