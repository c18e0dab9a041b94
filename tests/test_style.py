"""The code reads the way STYLE.md asks: ruff's lint rules and formatter agree with it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True
    )


def test_ruff_lint_is_clean():
    result = _ruff("check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_pre_commit_runs_the_same_ruff_checks():
    import yaml

    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    entries = [hook["entry"] for repo in config["repos"] for hook in repo["hooks"]]
    assert entries == ["python -m ruff check --fix", "python -m ruff format"]


def test_ruff_format_is_clean():
    result = _ruff("format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


# Private names of other libraries that a file may read, and why no public one serves.
FOREIGN_PRIVATE = {
    "_attn_implementation": "transformers keeps the attention kernel there (read to restore)",
    "_forward_hooks": "torch has no public count of a module's hooks (tests count them)",
    "_forward_pre_hooks": "as _forward_hooks",
    "_version": "torch has no public version counter of a tensor (changed in place since?)",
    "_repr_mimebundle_": "IPython's display protocol, public despite its underscore",
    "_v_attrs": "PyTables' node attributes: its _v_ prefix names public node members",
    "_loaded": "Panel's flag of a session whose page has loaded: no public setter (a test's "
    "fake session marks its page loaded, tests/test_documents.py)",
    "_connected": "as _loaded: Panel's flag of a session whose socket is open",
    "_thread_id_": "as _loaded: the thread Panel took a session's document to be made on",
}
CHECKED = ("attnpanel", "apps", "tests", "benchmarks")


def _defined_private_names(tree: ast.AST) -> set[str]:
    """Private names a file defines: functions, classes, and attributes it assigns."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {name for name in names if name.startswith("_")}


def private_reads(path: Path) -> list[str]:
    """``x._name`` reads in a file of a private name that the file itself does not define."""
    tree = ast.parse(path.read_text(), filename=str(path))
    own = _defined_private_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") or node.attr in own or node.attr in FOREIGN_PRIVATE:
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue  # an object's own member (a subclass reads what its base set)
        found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_reads_another_modules_private_members():
    found = [
        f"{path.parent.relative_to(ROOT)}/{hit}"
        for root in CHECKED
        for path in sorted((ROOT / root).rglob("*.py"))
        for hit in private_reads(path)
    ]
    assert found == []


def test_the_private_member_check_finds_a_read_and_allows_a_definition(tmp_path):
    source = tmp_path / "reader.py"
    source.write_text(
        "class Engine:\n"
        "    def _record(self):\n"
        "        self._handles = {}\n"
        "def f(explorer, engine):\n"
        "    engine._record()\n"  # defined in this file: its own module's member
        "    return explorer._views\n"
    )
    assert private_reads(source) == ["reader.py:6: explorer._views"]
