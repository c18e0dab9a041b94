"""The package as a user installs it: a wheel built from the checkout, installed without
``-e`` into a fresh virtual environment, imports every module and serves a page; the sdist
carries the tests and their data.

The virtual environment reads the third-party packages of this interpreter through a plain
path line (``dependencies.pth``): their own ``.pth`` files, among them the editable install
of this checkout, are not run there, so ``attnpanel`` can only come from the wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import urllib.request
import venv
from pathlib import Path

import pytest
from served_app import free_port

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _clean_env() -> dict:
    """This process's environment without what would put a checkout before the wheel."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _run(*args, cwd, timeout=600) -> str:
    done = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_clean_env(),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


# what a checkout holds beside its source (build outputs, caches, the tests' own output)
NOT_SOURCE = (
    ".git",
    "build",
    "dist",
    "artifacts",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    ".hypothesis",
    ".benchmarks",
    ".venv",
)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``(wheel, sdist)`` built from the checkout with the installed setuptools (offline)."""
    out = tmp_path_factory.mktemp("dist")
    # from a copy: setuptools builds in the source's build/, where a build left behind by an
    # interrupted run (or one beside it) made this one fail ("File exists: build/bdist...")
    source = tmp_path_factory.mktemp("source") / "attnpanel"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    _run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        out,
        source,
        cwd=out,
    )
    (wheel,) = out.glob("attnpanel-*.whl")
    code = f"import sys; from setuptools import build_meta as b; print(b.build_sdist({str(out)!r}))"
    _run(sys.executable, "-c", code, cwd=source)
    (sdist,) = out.glob("attnpanel-*.tar.gz")
    return wheel, sdist


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory):
    """A fresh virtual environment with the wheel installed (no ``-e``); its python."""
    wheel, _ = built
    home = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=True).create(home)
    python = home / "bin" / "python"
    purelib = Path(
        _run(
            python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=home
        ).strip()
    )
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (purelib / "dependencies.pth").write_text("\n".join(sorted(ours)) + "\n")
    # --ignore-installed: the editable install of this checkout is visible through the .pth
    # line; it must be neither taken for the wheel nor uninstalled
    _run(
        python,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-index",
        "--ignore-installed",
        wheel,
        cwd=home,
    )
    return python, home


def test_the_wheel_holds_every_package_and_the_demo_weights(built):
    import zipfile

    wheel, _ = built
    names = set(zipfile.ZipFile(wheel).namelist())
    source = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "attnpanel").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert source <= names, sorted(source - names)
    assert "attnpanel/nilm/data/nilmformer.pt" in names
    assert "attnpanel/nilm/data/nilmformer_metrics.json" in names


def test_every_module_imports_from_the_installed_wheel(installed):
    python, home = installed
    code = (
        "import importlib, pkgutil, attnpanel\n"
        "from attnpanel.nilm import nilmformer\n"
        "names = [m.name for m in pkgutil.walk_packages(attnpanel.__path__, 'attnpanel.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "print(len(names))\n"
        "print(attnpanel.__file__)\n"
        "print(nilmformer.default_path())\n"
        "print(attnpanel.explore.__module__, attnpanel.AttentionExplorer.__name__)\n"
    )
    count, where, weights, entry = _run(python, "-c", code, cwd=home).splitlines()
    assert int(count) == len(list((ROOT / "attnpanel").rglob("*.py"))) - 1  # less __init__
    assert where.startswith(str(home)) and weights.startswith(str(home))
    assert Path(weights).is_file()
    assert entry == "attnpanel.app.explore AttentionExplorer"


def test_the_installed_command_serves_the_demo_page(installed):
    python, home = installed
    port = free_port()
    log = home / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [home / "bin" / "attnpanel", "serve", "--port", str(port), "--address", "127.0.0.1"],
            cwd=home,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(_clean_env(), BOKEH_ALLOW_WS_ORIGIN=f"127.0.0.1:{port}"),
        )
        try:
            deadline = time.monotonic() + 240
            while True:
                assert proc.poll() is None, log.read_text()
                try:
                    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/attnpanel", timeout=120)
                    break
                except OSError:
                    assert time.monotonic() < deadline, log.read_text()
                    time.sleep(1)
            html = page.read().decode()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    assert page.status == 200
    assert "Bokeh" in html and "attnpanel" in html
    assert str(home) in _run(python, "-c", "import attnpanel; print(attnpanel.__file__)", cwd=home)


def test_the_sdist_carries_the_tests_and_their_data(built):
    _, sdist = built
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    tests = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("*.py")}
    assert tests <= names, sorted(tests - names)
    for needed in (
        "attnpanel/nilm/data/nilmformer.pt",
        "constraints.txt",
        "README.md",
        "apps/main.py",
    ):
        assert needed in names
