"""The layers hold: the runtime core (``pipeline``, not ``pipeline.app``) imports neither
``stages`` nor the app layer, and ``stages`` and ``kernels`` never import the app layer.

Read from the source (``ast``), every import counted, also those inside functions and under
``TYPE_CHECKING``: a lazy import is still a dependency."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path, package: str | None = None) -> set[str]:
    """Every module ``path`` imports (absolute names; relative imports resolved against
    ``package``, by default the one ``path`` is in)."""
    tree = ast.parse(path.read_text(), str(path))
    if package is None:
        package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def modules_of(folder: str, exclude: str | None = None) -> list[Path]:
    paths = sorted((ROOT / folder).rglob("*.py"))
    return [p for p in paths if exclude is None or not p.is_relative_to(ROOT / exclude)]


def reaches(imported: set[str], package: str) -> list[str]:
    return sorted(m for m in imported if m == package or m.startswith(package + "."))


CORE = modules_of("pipeline", exclude="pipeline/app")


@pytest.mark.parametrize("path", CORE, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_runtime_core_imports_no_stage_and_no_app_module(path: Path) -> None:
    imported = imported_modules(path)
    assert reaches(imported, "stages") == []
    assert reaches(imported, "pipeline.app") == []


@pytest.mark.parametrize("path", modules_of("stages") + modules_of("kernels"),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_stages_and_kernels_never_import_the_app_layer(path: Path) -> None:
    assert reaches(imported_modules(path), "pipeline.app") == []


def test_the_core_is_what_the_design_names() -> None:
    """The runtime core's modules (a new one is a decision: add it here, or to the app)."""
    names = {p.stem for p in CORE} - {"__init__"}
    assert names == {"config", "engine_link", "gpu", "graph", "logging", "metrics", "queues", "records",
                     "resume", "slots", "stage"}


def test_a_core_module_that_imported_a_stage_would_be_caught(tmp_path: Path) -> None:
    """The check itself: lazy and ``TYPE_CHECKING`` imports count."""
    module = tmp_path / "probe.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from stages.sinks import SinkStage\n"
                      "def f():\n    import pipeline.app.http\n")
    imported = imported_modules(module, package="")
    assert reaches(imported, "stages") == ["stages.sinks", "stages.sinks.SinkStage"]
    assert reaches(imported, "pipeline.app") == ["pipeline.app.http"]



def import_cycles(paths: list[Path]) -> list[list[str]]:
    """The groups of modules among ``paths`` that import each other in a loop (strongly
    connected components of more than one module; lazy and ``TYPE_CHECKING`` imports count)."""
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for p in paths}
    edges = {name: {m for m in imported_modules(path) if m in modules and m != name}
             for name, path in modules.items()}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(name: str) -> None:  # Tarjan's algorithm
        order[name] = low[name] = len(order)
        stack.append(name)
        for other in sorted(edges[name]):
            if other not in order:
                visit(other)
                low[name] = min(low[name], low[other])
            elif other in stack:
                low[name] = min(low[name], order[other])
        if low[name] == order[name]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == name:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for name in sorted(edges):
        if name not in order:
            visit(name)
    return cycles


def test_no_two_modules_import_each_other() -> None:
    """The app layer, the core and the stages have no import loop (cli <-> supervisor and
    sinks -> preview -> annotate were ones)."""
    assert import_cycles(modules_of("pipeline") + modules_of("stages")) == []


def test_a_loop_would_be_caught(tmp_path: Path, monkeypatch) -> None:
    package = tmp_path / "loop"
    package.mkdir()
    (package / "a.py").write_text("from loop.b import x\n")
    (package / "b.py").write_text("def f():\n    import loop.a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert import_cycles(sorted(package.glob("*.py"))) == [["loop.a", "loop.b"]]
