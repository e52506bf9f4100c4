"""The live view's page in a real headless Chromium: two paced sources running through the
pipeline, the page served by the pipeline's HTTP server on a free loopback port; the page
lists both sources with their state, counters and host, and a source's picture changes
between two screenshots taken more than a second apart; the page's form adds a source through
the API (a bad URI shows the API's one-line message in the form), which gets a card with its
picture and delivers frames, and its card's remove button removes it. The cards keep the
configured order when the hosts report their sources in another."""

from __future__ import annotations

import time
from collections.abc import Iterator

import cv2
import httpx
import numpy as np
import pytest

from pipeline.app.http import HttpServer
from pipeline.config import parse_config
from tests.e2e.conftest import pipeline_config
from tests.support import headless_page, require_chromium
from tests.support.live_view import served, shown

pytestmark = pytest.mark.slow  # a real browser


@pytest.fixture()
def chromium() -> str:
    """Debian's Chromium (skips without it, fails in CI); asked for before the pipeline starts."""
    return require_chromium()


@pytest.fixture()
def page_url(samples, tmp_path) -> Iterator[str]:
    """The live view of the street clip and the car clip, each paced as a 4 fps camera."""
    config = parse_config(pipeline_config(
        samples, tmp_path,
        [{"name": "street", "uri": str(samples.bikes), "pace_fps": 4, "live": True},
         {"name": "car", "uri": str(samples.carphone), "pace_fps": 4, "live": True}],
        output={"video": "{source}.mp4", "jsonl": None}, runtime={"decode_workers": 0, "http": {"port": 0}}))
    with served(config) as run:
        yield f"{run.client.base_url}/"


def picture_of(page, name: str) -> np.ndarray:
    """A screenshot of source ``name``'s picture on the page, as a (h, w, 3) uint8 BGR array."""
    png = page.locator(f'.source[data-source="{name}"] img').screenshot()
    return cv2.imdecode(np.frombuffer(png, np.uint8), cv2.IMREAD_COLOR)


def test_page_lists_the_sources_and_their_pictures_move(chromium: str, page_url: str,
                                                        samples) -> None:
    with headless_page(chromium) as page:
        page.goto(page_url)
        names = page.locator(".source").evaluate_all("cards => cards.map(c => c.dataset.source)")
        assert names == ["street", "car"]
        for name, size in (("street", (640, 272)), ("car", (176, 144))):
            card = f'.source[data-source="{name}"]'
            page.wait_for_function(
                f"""() => {{ const img = document.querySelector('{card} img');
                            return img && img.complete && img.naturalWidth === {size[0]}; }}""",
                timeout=20_000)
            page.wait_for_function(
                f"""() => document.querySelector('{card} .state').textContent === 'running'
                          && Number(document.querySelector('{card} [data-field=frames]')
                                    .textContent) > 0""", timeout=10_000)
        # Refreshed by the page's script (degraded, with its reasons, when this machine
        # cannot keep up with the two cameras and the browser).
        health = page.locator("#health").text_content()
        assert health.startswith(("health: ok", "health: degraded: queue")), health

        first = picture_of(page, "street")
        time.sleep(1.5)
        second = picture_of(page, "street")
        assert first.shape == second.shape and first.shape[0] > 50
        changed = np.abs(first.astype(np.int16) - second.astype(np.int16)).max(axis=2) > 24
        assert changed.mean() > 0.01, f"the picture did not move: {changed.mean():.4f} changed"
        assert page.locator('.source[data-source="car"] [data-field=host]').text_content() \
            == "pipeline0"

        # The page's form adds a source through the API; a bad one shows the API's message.
        form = page.locator("#add-source")
        form.locator("input[name=name]").fill("clip")
        form.locator("input[name=uri]").fill("nope://camera/1")
        form.locator("button[type=submit]").click()
        error = form.locator("[data-field=form-error]")
        page.wait_for_function(
            """() => document.querySelector('#add-source [data-field=form-error]').textContent""",
            timeout=5_000)
        with httpx.Client(base_url=page_url, timeout=30) as client:
            answer = client.post("api/sources", json={"name": "clip", "uri": "nope://camera/1"})
            assert answer.status_code == 400 and "\n" not in answer.json()["error"]
            assert error.text_content() == answer.json()["error"], error.text_content()
            assert error.text_content().startswith("sources[2].uri (source 'clip'): unsupported ")

            form.locator("input[name=uri]").fill(str(samples.carphone))
            form.locator("input[name=live]").check()
            form.locator("input[name=pace_fps]").fill("4")
            form.locator("button[type=submit]").click()
            # A source added while the page is open gets its card, and delivers.
            page.wait_for_function(
                """() => { const card = document.querySelector('.source[data-source="clip"]');
                           const img = card && card.querySelector('img');
                           return img && img.complete && img.naturalWidth === 176
                                  && card.querySelector('[data-field=host]').textContent
                                     === 'pipeline0'
                                  && Number(card.querySelector('[data-field=frames]')
                                            .textContent) > 0; }""", timeout=20_000)
            assert error.text_content() == ""
            assert form.locator("[data-field=form-status]").text_content() == "added clip"
            added = client.get("api/sources/clip").json()
            assert added["live"] is True and added["frames"] > 0, added
            # Its remove button removes it: the card goes, and so does the source.
            page.locator('.source[data-source="clip"] button.remove').click()
            page.wait_for_function(
                "() => !document.querySelector('.source[data-source=\"clip\"]')", timeout=20_000)
            assert client.get("api/sources/clip").status_code == 404
        names = page.locator(".source").evaluate_all("cards => cards.map(c => c.dataset.source)")
        assert names == ["street", "car"]


def test_cards_keep_the_configured_order_whichever_host_reports_first(chromium: str, samples,
                                                                       tmp_path) -> None:
    """Two hosts, reports made by hand: the page opens while only host h1's source (the
    second configured, a file that has ended unwatched) is reported; once h0 reports the
    first, the cards read in config order, not in the order the sources came. The ended
    file's card says that no picture will come."""
    from pipeline.app.board import SourceBoard, ViewReport

    config = parse_config(pipeline_config(samples, tmp_path, [
        {"name": "first", "uri": "rtsp://cam/first"}, {"name": "second", "uri": "rtsp://cam/second"}],
        runtime={"http": {"port": 0}}))
    board = SourceBoard(None, None, preview_fps=4, order=["first", "second"])
    board.update(ViewReport("h1", True, {"second": shown("second", "ended")}))
    server = HttpServer(config.runtime.http, board, config)
    port = server.start()
    try:
        with headless_page(chromium) as page:
            page.goto(f"http://127.0.0.1:{port}/")
            cards = "() => [...document.querySelectorAll('.source')].map(c => c.dataset.source)"
            assert page.evaluate(cards) == ["second"]
            board.update(ViewReport("h0", True, {"first": shown("first")}))
            page.wait_for_function(f"() => ({cards})().length === 2", timeout=10_000)
            assert page.evaluate(cards) == ["first", "second"]
            page.wait_for_function("""() => document.querySelector(
                '.source[data-source="second"] .placeholder').textContent
                === 'no picture: it ended unwatched'""", timeout=10_000)
    finally:
        server.close()
