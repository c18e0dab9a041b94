"""The house keeps its shape (docs/architecture.md): layers that import downwards only, no
import circle, small modules and classes, and the demo's words kept in the demo.

Imports are read from the source (module level and inside functions), so a circle that only
an in-function import closes is found too.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "attnpanel"
# Bottom to top: a module may import its own layer and the layers below it, never above.
LAYERS = (
    "util",
    "kernels",
    "traces",
    "watching",
    "capturing",
    "surveys",
    "interventions",
    "series",
    "readouts",
    "render",
    "app",
    "nilm",
    "cli",
)
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path, known: set[str]) -> set[str]:
    """The attnpanel modules a file imports, wherever the import stands."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path.parent)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            if base not in known:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return found - {module_name(path)}


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(path, set(found)) for name, path in found.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, result = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in edges.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return result


def layer_of(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) == 1:
        return None  # attnpanel/__init__.py: the public face, above every layer
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else None


def test_no_import_circle():
    assert circles(graph()) == []


def test_the_circle_finder_sees_an_in_function_import(tmp_path, monkeypatch):
    package = tmp_path / "attnpanel"
    (package / "util").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "util" / "__init__.py").write_text("")
    (package / "util" / "a.py").write_text("from attnpanel.util import b\n")
    (package / "util" / "b.py").write_text("def f():\n    from attnpanel.util.a import g\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert circles(graph()) == [["attnpanel.util.a", "attnpanel.util.b"]]


def test_layers_import_downwards_only():
    upward = []
    for name, targets in graph().items():
        own = layer_of(name)
        for target in targets:
            below = layer_of(target)
            if own is not None and below is not None and below > own:
                upward.append(f"{name} -> {target}")
            if own is not None and target == "attnpanel":
                upward.append(f"{name} -> attnpanel (the package face)")
    assert upward == []


def test_every_module_lives_in_a_layer():
    loose = [n for n in modules() if layer_of(n) is None and n not in ("attnpanel",)]
    assert loose == ["attnpanel.__main__"]


def test_the_library_never_imports_the_demo():
    nilm = LAYERS.index("nilm")
    users = sorted(
        name
        for name, targets in graph().items()
        if any(t.startswith("attnpanel.nilm") for t in targets)
        and not name.startswith("attnpanel.nilm")
        and (layer_of(name) or 99) < nilm
    )
    assert users == []


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_modules_stay_small():
    over = {
        str(path.relative_to(ROOT)): _lines(path)
        for path in modules().values()
        if _lines(path) > MAX_MODULE_LINES
    }
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"


def test_classes_stay_small():
    over = {}
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    over[f"{path.relative_to(ROOT)}:{node.name}"] = lines
    assert not over, f"classes over {MAX_CLASS_LINES} lines: {over}"


# Files that read a format whose own schema has the word, and why.
FORMAT_WORDS = {
    "attnpanel/series/readers/nilmtk.py": "NILMTK's building metadata key 'appliances'",
}


def test_appliances_are_the_demos_word():
    naming = {
        str(path.relative_to(ROOT))
        for path in modules().values()
        if not path.is_relative_to(PACKAGE / "nilm")
        and str(path.relative_to(ROOT)) not in FORMAT_WORDS
        and re.search("appliance", path.read_text(), flags=re.I)
    }
    assert naming == set()


def test_the_size_checks_catch_a_large_module_and_class(tmp_path, monkeypatch):
    package = tmp_path / "attnpanel"
    package.mkdir()
    (package / "__init__.py").write_text("")
    body = "".join(f"    def m{i}(self):\n        return {i}\n" for i in range(160))
    (package / "big.py").write_text("class Big:\n" + body + "\n" * 300)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    with pytest.raises(AssertionError, match="attnpanel/big.py"):
        test_modules_stay_small()
    with pytest.raises(AssertionError, match="attnpanel/big.py:Big"):
        test_classes_stay_small()


# Names every module of a kind defines once, by convention: each CLI command's
# ``add_parser``/``run``, a module's logger, an entry's ``main``, a section's layout constants.
PROTOCOL_NAMES = {"add_parser", "run", "log", "main", "DEPENDS", "WIDTH"}


def public_names(path: Path) -> set[str]:
    """The public functions, classes and constants a module defines at its top level."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {name for name in names if not name.startswith("_")} - PROTOCOL_NAMES


def test_one_name_per_concept():
    """No two modules define the same public name (a DataFrame and a HoloViews table of the
    same rows are two names: ``summary.shape_table`` and ``views.shape_view``)."""
    homes: dict[str, list[str]] = {}
    for path in modules().values():
        for name in public_names(path):
            homes.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert {name: found for name, found in homes.items() if len(found) > 1} == {}
