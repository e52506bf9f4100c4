"""The ``webhook summary`` line through ``python run.py`` with source workers: one line, from
the worker that ran the source, naming it; none from the workers that ran no source."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.webhook_receiver import WebhookReceiver

WIDTH, HEIGHT = 640, 272  # bikes.mp4


@pytest.mark.slow  # the detector over a clip on the CPU, through run.py with source workers
def test_with_two_workers_only_the_worker_that_sent_events_logs_its_webhook_summary(
        make_clip, repo_root: Path, run_pipeline, tmp_path: Path) -> None:
    """``runtime.workers: 2`` (and its spare): every source worker builds the webhook
    publisher, but only the one that ran the source sent anything. Its ``webhook summary``
    is the run's one line, naming the source and counting every line of the events file;
    the two idle workers' lines of zeros (read as real counts) are not logged."""
    import yaml

    receiver = WebhookReceiver().start()
    try:
        config = yaml.safe_load((repo_root / "configs/analytics.yaml").read_text())
        config["sources"][0]["uri"] = str(make_clip("bikes", 50, (WIDTH, HEIGHT)))
        config["inference"].update(backend="onnxruntime", device="cpu")
        # no video and no event media: this test's time goes to the workers' summaries
        config["output"].update(dir=str(tmp_path / "out"), video=None, event_media=None,
                                webhooks=[{"url": receiver.url}])
        config["runtime"] = {"log_format": "json", "progress": False, "workers": 2}
        run = run_pipeline(config, tmp_path)
        assert run.wait(120) == 0, run.stderr()[-3000:]
    finally:
        receiver.stop()
    assert len(run.events("worker gone")) == 3, run.stderr()[-3000:]  # two and the spare
    lines = (tmp_path / "out" / "bikes.events.jsonl").read_bytes().splitlines()
    assert lines and [r.body for r in receiver.requests] == lines
    (summary,) = run.events("webhook summary")
    assert (summary["url"], summary["delivered"], summary["failed"], summary["rejected"],
            summary["dropped"], summary["unsent"], summary["sources"]) == \
        (receiver.url, len(lines), 0, 0, 0, 0, ["bikes"])
