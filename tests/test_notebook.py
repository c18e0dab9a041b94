"""The walkthrough notebook: executed headlessly, and run in a real JupyterLab in Chromium."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from served_app import HELPERS_JS

pytestmark = pytest.mark.slow  # JupyterLab and a notebook kernel: ~80 s

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "examples" / "walkthrough.ipynb"
TESTS = ROOT / "tests"


def _errors(notebook) -> list[str]:
    """Every error output, and every stderr stream that carries a traceback."""
    found = []
    for index, cell in enumerate(notebook.cells):
        for output in cell.get("outputs", []):
            if output.output_type == "error":
                found.append(f"cell {index}: {output.ename}: {output.evalue}")
            elif output.output_type == "stream" and output.name == "stderr":
                if "Traceback" in output.text or "Error" in output.text:
                    found.append(f"cell {index} stderr: {output.text[:300]}")
    return found


def test_walkthrough_executes_without_errors(tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=300,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    started = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - started
    assert _errors(notebook) == [], _errors(notebook)
    report = tmp_path / "walkthrough_report.html"
    assert report.exists() and report.stat().st_size > 100_000
    explorer_outputs = [
        output
        for cell in notebook.cells
        if "explorer = attnpanel.AttentionExplorer" in cell.source
        for output in cell.outputs
    ]
    bundles = [o.get("data", {}) for o in explorer_outputs]
    assert any("application/vnd.holoviews_exec.v0+json" in b for b in bundles), "no Panel output"
    print(f"notebook executed in {elapsed:.1f} s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_jupyterlab_finds_the_pyviz_extension():
    """Panel's two-way comms in JupyterLab need pyviz_comms' lab extension on the Jupyter path.

    Without it the explorer still draws but neither widget changes nor pushes from the kernel
    arrive (seen in a venv made with --system-site-packages: the base prefix's
    share/jupyter is not on the venv's Jupyter path).
    """
    from jupyter_core.paths import jupyter_path

    found = [p for p in jupyter_path("labextensions") if (Path(p) / "@pyviz").is_dir()]
    assert found, f"@pyviz/jupyterlab_pyviz is in none of {jupyter_path('labextensions')}"


@pytest.fixture
def jupyterlab(tmp_path):
    """A JupyterLab server on localhost with the walkthrough in its root; no token."""
    shutil.copy(NOTEBOOK, tmp_path / NOTEBOOK.name)
    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        f"--port={port}",
        "--ip=127.0.0.1",
        f"--ServerApp.root_dir={tmp_path}",
        "--IdentityProvider.token=",
        "--ServerApp.password=",
        "--LabApp.expose_app_in_browser=True",
        "--ServerApp.disable_check_xsrf=True",
        "--LabApp.news_url=",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--allow-root",
    ]
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / ".jupyter")}
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{url}/api/status", timeout=2)
            break
        except OSError:
            if server.poll() is not None:
                raise RuntimeError(server.stderr.read().decode()[-2000:]) from None
            time.sleep(0.5)
    else:
        server.kill()
        pytest.fail("JupyterLab did not start in 90 s")
    yield url
    server.terminate()
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()


_PYVIZ_STATE = """() => JSON.stringify({
    loaded: typeof window.PyViz, comms: Object.keys((window.PyViz || {}).comms || {}),
    managers: Object.keys(window.PyViz || {}),
})"""


def test_explorer_renders_and_reacts_in_jupyterlab(jupyterlab, browser, artifacts):
    context = browser.new_context(viewport={"width": 1600, "height": 1400})
    page = context.new_page()
    console = []
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
    dialogs = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    outside = []

    def record(request):
        # blob: and data: URLs never leave the browser; anything else must be the server's
        if not request.url.startswith((jupyterlab, "blob:", "data:")):
            outside.append(request.url)

    page.on("request", record)
    page.on(
        "response",
        lambda r: console.append(f"http {r.status}: {r.url}") if r.status >= 400 else None,
    )
    try:
        page.goto(f"{jupyterlab}/lab/tree/walkthrough.ipynb", timeout=120_000)
        page.wait_for_function(
            "window.jupyterapp && window.jupyterapp.shell.currentWidget", timeout=120_000
        )
        page.wait_for_function(
            """() => { const w = window.jupyterapp.shell.currentWidget;
                       return w && w.sessionContext && w.sessionContext.session
                              && w.sessionContext.session.kernel
                              && w.sessionContext.session.kernel.status === 'idle'; }""",
            timeout=120_000,
        )
        page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
        page.wait_for_selector(".jp-OutputArea-output .bk-Figure", timeout=240_000)
        # the last cell (the export) prints the file's size: then every cell has run
        page.wait_for_selector(".jp-OutputArea-output:has-text('MiB')", timeout=240_000)
        page.wait_for_timeout(2000)
        errors = page.locator(
            ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
        )
        assert errors.count() == 0 or "Traceback" not in errors.all_inner_texts()[0]
        page.locator(".jp-OutputArea-output .bk-Figure").nth(1).scroll_into_view_if_needed()
        page.screenshot(path=str(artifacts / "jupyterlab_explorer.png"))
        # the note that would say what is missing went away once the explorer was drawn
        assert page.locator(".attnpanel-waiting").count() == 0
        page.evaluate(HELPERS_JS)
        matrix = "attn.plots().find((v) => /^sample \\d+, head /.test(v.model.title.text))"
        # the notebook's own `explorer.param.update(head=3, mask="causal", ...)` reaches the page
        page.wait_for_function(
            f"""() => {{ const t = {matrix}.model.title.text;
                        return t.startsWith('sample 0, head 3') && t.includes('mask causal'); }}""",
            timeout=60_000,
        )
        before = page.evaluate(f"attn.hash({matrix})")
        # what picking "head 5" in the Head widget does: the widget's value changes in the page.
        # The first change a page sends right after the display is sometimes never delivered
        # to the kernel (PyViz's comm in JupyterLab 4: the kernel still had head 3, the page
        # head 5; on the commit before this session too, 2 runs in 3 on 2026-11-25); a
        # person picks again, and so does the test once: the second pick must arrive.
        pick = """(head) => { const w = attn.widget('Head');
                              const label = (o) => Array.isArray(o) ? o[1] : o;
                              const option = w.options.find((o) => label(o) === head);
                              w.value = Array.isArray(option) ? option[0] : option; }"""
        came_back = f"() => {matrix}.model.title.text.startsWith('sample 0, head 5')"
        page.evaluate(pick, "head 5")
        try:
            page.wait_for_function(came_back, timeout=15_000, polling=200)
        except Exception:  # noqa: BLE001 - picked again below, and that one must arrive
            page.evaluate(pick, "head 6")
            page.wait_for_timeout(1000)
            page.evaluate(pick, "head 5")
            try:
                page.wait_for_function(
                    came_back,
                    timeout=60_000,
                    polling=200,  # a timer, not animation frames: a page in the background
                )
            except Exception as err:  # what the page and the kernel said, for the next reader
                state = page.evaluate(_PYVIZ_STATE)
                raise AssertionError(
                    f"the Head widget's change never came back: {state}\n"
                    + "\n".join(console[-30:])
                ) from err
        page.evaluate(f"(b) => attn.until_changed({matrix}, b, 30000)", before)
        # and Python drives the rendered page: code run in the kernel after the display.
        # A patch the kernel pushes can be lost in the same way as the page's first change
        # (seen once in three full runs): the cell runs again once, over another head first
        # so that the update is a change, and that one must arrive.
        before = page.evaluate(f"attn.hash({matrix})")
        run = """(code) => { window.jupyterapp.shell.currentWidget.sessionContext.session
                             .kernel.requestExecute({code}); }"""
        arrived = f"""() => {{ const t = {matrix}.model.title.text;
                        return t.startsWith('sample 0, head 2') && t.includes('mask causal'); }}"""
        page.evaluate(run, 'explorer.param.update(head=2, mask="causal")')
        try:
            page.wait_for_function(arrived, timeout=20_000, polling=200)
        except Exception:  # noqa: BLE001 - run again below, and that one must arrive
            page.evaluate(run, "explorer.param.update(head=1); explorer.param.update(head=2)")
            page.wait_for_function(arrived, timeout=60_000, polling=200)
        page.evaluate(f"(b) => attn.until_changed({matrix}, b, 30000)", before)
        page.screenshot(path=str(artifacts / "jupyterlab_explorer_changed.png"))
        # untrusted text is text here too: a capture whose every string is a script
        # (tests/hostile.py) displayed in a new cell shows its strings and runs none
        page.evaluate(
            """(code) => { const nb = window.jupyterapp.shell.currentWidget.content;
                           nb.activeCellIndex = nb.widgets.length - 1;
                           window.jupyterapp.commands.execute('notebook:insert-cell-below');
                           nb.activeCell.model.sharedModel.setSource(code);
                           window.jupyterapp.commands.execute('notebook:run-cell'); }""",
            f"import sys; sys.path.insert(0, {str(TESTS)!r})\n"
            "from hostile import hostile_capture\n"
            "from attnpanel import explore\n"
            "explore(hostile_capture())",
        )
        try:
            page.wait_for_function(
                "() => attn.views().some((v) => String(v.model.text).includes("
                "'&amp;lt;img src=x onerror=alert'))",
                timeout=120_000,
            )
        finally:
            page.screenshot(path=str(artifacts / "jupyterlab_hostile.png"))
        page.wait_for_timeout(2000)  # an onerror fires once its broken image has failed
        assert dialogs == [], f"a trace's text ran as script in JupyterLab: {dialogs}"
        assert outside == [], f"requests left the machine: {outside[:5]}"
    finally:
        with contextlib.suppress(Exception):
            console.append("PyViz: " + page.evaluate(_PYVIZ_STATE))
        (artifacts / "jupyterlab_console.log").write_text("\n".join(console))
        context.close()
