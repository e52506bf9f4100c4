"""build_graph's up-front checks that need no model run: the extras a config asks for."""

from __future__ import annotations

import importlib.util

import pytest

from pipeline.app.build import check_extras
from pipeline.config import ConfigError, parse_config


def config(samples, **source):
    return parse_config({"sources": [{"name": "cam", "uri": str(samples.bikes), **source}],
                         "model": {"path": str(samples.model)},
                         "output": {"webhooks": [{"url": "http://127.0.0.1:9/hook"}]},
                         "runtime": {"http": {"port": 0}}})


@pytest.mark.parametrize("missing, key, extra", [
    ("trackers", "sources[0].tracker", "analytics"),
    ("starlette", "runtime.http", "live"),
    ("httpx", "output.webhooks", "analytics"),
])
def test_a_missing_extra_is_a_one_line_error_naming_it(samples, monkeypatch, missing, key, extra):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == missing else real(name, *a))
    with pytest.raises(ConfigError) as error:
        check_extras(config(samples, tracker="bytetrack"))
    assert str(error.value) == (f"{key}: needs the Python package {missing!r}, which is not "
                                f"installed: pip install -e '.[{extra}]' in the project's folder "
                                f"(the {extra} extra)")


def test_installed_extras_pass(samples):
    check_extras(config(samples, tracker="bytetrack"))
