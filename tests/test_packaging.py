"""The install path: pyproject, environment.yml, constraints and the README agree."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONDA_NAMES = {"torch": "pytorch", "tables": "pytables"}  # PyPI name -> conda-forge name


def _requirement(spec: str) -> tuple[str, str]:
    name, bound = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*(.*)$", spec).groups()
    return name.lower(), bound.replace(" ", "")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _conda_dependencies() -> dict[str, str]:
    deps = {}
    for line in (ROOT / "environment.yml").read_text().splitlines():
        match = re.match(r"^  - ([A-Za-z0-9_.\-]+)(.*)$", line)
        if match:
            deps[match.group(1).lower()] = match.group(2).strip().replace(" ", "")
    return deps


def test_environment_yml_matches_pyproject():
    project = _pyproject()["project"]
    conda = _conda_dependencies()
    for spec in project["dependencies"]:
        name, bound = _requirement(spec)
        conda_name = CONDA_NAMES.get(name, name)
        assert conda_name in conda, f"{name} is in pyproject.toml but not in environment.yml"
        assert conda[conda_name] == bound, (
            f"{name}: pyproject says {bound!r}, environment.yml says {conda[conda_name]!r}"
        )
    python = project["requires-python"].replace(" ", "")
    assert conda["python"] == python


def test_torch_is_not_pinned_for_users_but_pinned_for_this_install():
    deps = dict(_requirement(s) for s in _pyproject()["project"]["dependencies"])
    assert deps["torch"].startswith(">="), "users must be free to pick their torch release"
    constraints = (ROOT / "constraints.txt").read_text().split()
    assert "torch==2.13.0" in constraints, "the install path must take the local CPU wheel"


def test_readme_quickstart_and_ci_run_the_same_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```(?:bash|sh)\n(.*?)\n```", readme, flags=re.S)
    test_command = next(c for c in commands if "pytest" in c)
    serve_command = next(c for c in commands if "panel serve apps/main.py" in c)
    assert "-c constraints.txt" in test_command and "-c constraints.txt" in serve_command
    assert test_command.strip() in (ROOT / ".ci" / "run").read_text()
