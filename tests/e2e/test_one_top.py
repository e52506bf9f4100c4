"""One way to run at any scale: ``runtime.workers: 2`` with the live view, through ``run.py``
as users run it (local processes, and the same in one Ray unit with ``--ray local``).

The page (a real headless Chromium) shows every source of both pipeline hosts with a
changing preview; ``POST /api/sources`` adds a file that completes with every record;
``DELETE`` stops a camera; health and ``/metrics`` cover both hosts. The other sources lose
no frame and are never restarted: each was placed once, never moved, and its records are
one run's (frame numbers 0, 1, 2, ... with no gap and no resume)."""

from __future__ import annotations

import signal
import socket
import time
from contextlib import ExitStack, suppress
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.e2e.conftest import pipeline_config, records
from tests.support.browser import headless_page, require_chromium
from tests.support.harness import wait_for

pytestmark = pytest.mark.slow

STREET_FRAMES = 250  # bikes.mp4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_picture(page, client: httpx.Client, name: str, timeout_s: float = 30.0) -> None:
    """Wait until the page shows a picture of source ``name``; fail saying what the card
    and the server showed then."""
    from playwright.sync_api import TimeoutError as PageTimeout

    try:
        page.wait_for_function(
            f"""() => {{ const img = document.querySelector('.source[data-source="{name}"] img');
                        return img && img.complete && img.naturalWidth > 0; }}""",
            timeout=timeout_s * 1000)
    except PageTimeout:
        card = page.locator(f'.source[data-source="{name}"]').inner_text()
        snapshot = client.get(f"api/sources/{name}/snapshot.jpg")
        pytest.fail(f"no picture of {name} on the page in {timeout_s:.0f} s; its card read "
                    f"{card!r}; snapshot.jpg answered {snapshot.status_code} now; health: "
                    f"{client.get('api/health').text}")


def picture(page, name: str) -> np.ndarray:
    """The preview of ``name`` as the page shows it (decoded from a screenshot)."""
    import cv2

    png = page.locator(f'.source[data-source="{name}"] img').screenshot()
    return cv2.imdecode(np.frombuffer(png, np.uint8), cv2.IMREAD_COLOR)


@pytest.mark.parametrize("mode", ["processes", "ray"])
def test_two_pipelines_one_live_view_add_and_remove_without_touching_the_others(
        mode, samples, tmp_path: Path, rtsp_server, run_pipeline) -> None:
    chromium = require_chromium()
    if mode == "ray":
        from tests.e2e.test_cluster import require_ray

        require_ray()
    cameras = rtsp_server({"door": "live:5", "yard": "live:5"})  # 5 frames/s: CI has 2 cores
    http_port, metrics_port = free_port(), free_port()
    config = pipeline_config(
        samples, tmp_path,
        [{"name": "street", "uri": str(samples.bikes), "pace_fps": 10, "detect_every": 2},
         {"name": "door", "uri": cameras.url("door")},
         {"name": "yard", "uri": cameras.url("yard")}],
        runtime={"workers": 2, "stop_when": "never", "decode_workers": 0,
                 "http": {"port": http_port, "preview_fps": 4}, "metrics_port": metrics_port})
    config["output"]["video"] = None
    run = run_pipeline(config, tmp_path, extra_args=["--ray", "local"] if mode == "ray" else [])
    base = f"http://127.0.0.1:{http_port}/"
    with httpx.Client(base_url=base, timeout=30) as client, ExitStack() as browser:
        def health() -> dict:
            try:
                return client.get("api/health").json()
            except httpx.HTTPError:
                return {}

        # The page opens as soon as the server answers, as a user's would: street (a 25 s
        # file) must still be running when the page first asks for its picture.
        wait_for(lambda: health() != {}, "the live view answering", 180, run)
        page = browser.enter_context(headless_page(chromium))
        page.goto(base)
        wait_for(lambda: health().get("status") == "ok"
                 and health()["sources"] == dict.fromkeys(["street", "door", "yard"], "running"),
                 "every source running", 180, run)
        sources = {s["name"]: s for s in client.get("api/sources").json()["sources"]}
        assert list(sources) == ["street", "door", "yard"]
        hosts = {s["host"] for s in sources.values()}
        # Ray (a cluster of one node without a GPU): one unit, named in its workers' names
        unit = "unit0." if mode == "ray" else ""
        names = {f"{unit}worker0", f"{unit}worker1"}
        assert hosts == names, sources  # both hosts run some
        # and a spare, idle (runtime.spare_workers: 1 by default)
        assert {host: state["spare"] for host, state in health()["hosts"].items()} == {
            f"{unit}worker0": False, f"{unit}worker1": False, f"{unit}worker2": True}
        engine = health()["engines"][f"{unit}engine"]  # the one engine, with its standby
        assert (engine["ready"], engine["restarts"], engine["failed"]) == (True, 0, None)
        assert engine["standby"] in ("starting", "ready"), engine
        assert len(health()["engines"]) == 1

        # the spare is listed as one, not as a worker with none
        page.wait_for_function("() => document.getElementById('hosts').textContent"
                               f".includes('{unit}worker2 (ready, spare)')", timeout=30_000)
        # every card, in config order (the page was open while the hosts reported them)
        listed = "() => [...document.querySelectorAll('.source')].map(c => c.dataset.source)"
        from playwright.sync_api import TimeoutError as PageTimeout

        with suppress(PageTimeout):  # the assertion below says what was there
            page.wait_for_function(f"() => ({listed})().join() === 'street,door,yard'",
                                   timeout=10_000)
        cards = page.evaluate(listed)
        assert cards == ["street", "door", "yard"]
        for name in cards:
            wait_for_picture(page, client, name)
            assert page.locator(f'.source[data-source="{name}"] [data-field=host]'
                                ).text_content() == sources[name]["host"]
        # the preview moves: door's, an endless camera (street, a 25 s file, may have
        # ended by now on a slow machine: a CI run found its picture still). Its test
        # pattern is a moving ball on black (6% of its picture changed between two looks in
        # a local run). Polled for 10 s: a loaded CI machine can hold a 4 fps
        # preview back for seconds.
        first, moved = picture(page, "door"), 0.0
        deadline = time.monotonic() + 10.0
        while moved <= 0.01 and time.monotonic() < deadline:
            time.sleep(0.5)
            second = picture(page, "door")
            moved = (np.abs(first.astype(np.int16) - second.astype(np.int16)).max(axis=2)
                     > 24).mean()
        assert moved > 0.01, f"door's preview did not move in 10 s: {moved:.4f}"
        browser.close()  # the page's polling stops: the rest needs no pictures

        # Prometheus: every host's samples on the one endpoint.
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).text
        assert all(f'pipeline="{host}"' in metrics for host in names)

        # A file added while the others run completes with every record.
        added = client.post("api/sources", json={"name": "car", "uri": str(samples.carphone),
                                                 "detect_every": 2})
        assert added.status_code == 201, added.text
        wait_for(lambda: health().get("sources", {}).get("car") == "ended", "car ended", 180,
                 run)
        car = records(tmp_path / "car.jsonl")
        assert [r["frame"] for r in car] == list(range(len(car))) and len(car) > 50
        # A camera removed: its outputs are final, the others go on.
        removed = client.delete("api/sources/yard")
        assert removed.status_code == 200, removed.text
        assert removed.json()["outputs"] == [str(tmp_path / "yard.jsonl")]
        wait_for(lambda: health().get("sources", {}).get("street") == "ended", "street ended",
                 180, run)
        assert set(health()["sources"]) == {"street", "door", "car"}
    run.signal(signal.SIGINT)
    assert run.wait(60) == 0, run.stderr()[-3000:]

    # Nothing of the others was cut, moved or resumed: each placed once, one run's records.
    placed = [e["source"] for e in run.events("source placed")]
    assert sorted(placed) == ["door", "street", "yard"], placed
    assert not run.events("moving a source: cutting it short where it runs")
    street = records(tmp_path / "street.jsonl")
    assert [r["frame"] for r in street] == list(range(STREET_FRAMES))
    for camera in ("door", "yard"):  # numbered on from one connection: gaps are drops only
        frames = [r["frame"] for r in records(tmp_path / f"{camera}.jsonl")]
        summary = next(e for e in run.events("source summary") if e["source"] == camera)
        assert frames == sorted(set(frames)) and len(frames) > 20
        assert frames[-1] - frames[0] + 1 - len(frames) <= summary["dropped"], summary
    assert not list(tmp_path.glob("*.partial.*"))
