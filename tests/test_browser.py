"""A real browser test of the workbook as a learner sees it (README, "Tests"): JupyterLab in headless Chromium.

For each notebook case: start JupyterLab on a free localhost port with a random token, open the notebook in
headless Chromium (Debian's /usr/bin/chromium, driven by Playwright's sync API), wait for the kernel to be idle,
run all cells (failing on any error shown), wait for the ipywidgets and plots to render, change the case's
controls (arrow keys on a slider's focused handle, or a value typed into a number box), and assert each time that
the widget's result text changed. A screenshot goes to test-artifacts/browser/<notebook>.png, also on failure.
The cases are CASES below: one line per notebook (the chapters with a calculator or explorer driven in the browser).

A learner's first steps (test_learner_opens_an_exercise_from_the_file_browser): `make lab`'s first page is the
landing page, START.md (rendered, no kernel); from the file browser, into exercises/, open the first exercise
notebook (a save right away leaves its bytes), run its cells down to the first check (which says "not attempted
yet"), type the answer in, and run it and the check again ("passed").

The server is started with `make lab`'s own command line (tools/lab.py: the project root, localhost, START.md
first, --allow-root as root) plus what a test needs (a free port, a known token, throw-away directories), and
must refuse a request without the token.

Flaky-proofing: every wait is on state (the app's kernel status, DOM elements, a promise's result), each bounded
by a timeout; nothing sleeps. JupyterLab runs with throw-away config/data/runtime directories, so a user's
settings, workspaces and kernels registered elsewhere don't interfere; the venv's lab extensions (ipywidgets')
are still found through sys.prefix. Its user settings turn autosave off (running cells must never write outputs
into a notebook under git; the test checks the file is unchanged), render every cell (no windowing, so
off-screen outputs exist in the DOM), and start the default kernel without asking; the checkpoint JupyterLab
writes when it opens a notebook goes to the temporary directory too.

Cleanup, passed or failed: the page's kernels are shut down after each case; at the end the browser is closed,
the server is asked to shut down (it stops its kernels), then the server and anything it started are killed if
they are still alive.

Skipped, with the reason, only where chromium or the playwright package is missing; `.ci/run` installs both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("lab", ROOT / "tools" / "lab.py")  # `make lab`'s command line
lab_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lab_tool)
ARTIFACTS = ROOT / "test-artifacts" / "browser"
CHROMIUM = os.environ.get("LLMLAB_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
# The flags this closed network needs (no background connections to Google's hosts), as root in a container.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]

# Bounded waits, in seconds. On a quiet 2-core CPU the three cases take about 50 s in all.
SERVER_START_S = 60
APP_LOAD_S = 60
KERNEL_IDLE_S = 60
WIDGET_RENDER_S = 30
RESULT_CHANGE_S = 30


@dataclasses.dataclass(frozen=True)
class Case:
    """A notebook to open and what to do with it.

    path: the notebook, relative to the repository root.
    controls: the widgets to change, in turn, each given by a regular expression its description label must
        match (ipywidgets' `description`; searched, case-insensitive, so r"^GPUs$" for an exact label; see
        _pattern); None stands for the first slider at all. The first matching slider (IntSlider, FloatSlider,
        FloatLogSlider, …) or number box (IntText, FloatText, Bounded…Text) in the notebook's outputs is taken.
        A slider is moved with arrow keys on its focused handle; a number box gets its value doubled, typed in,
        and Enter.
    result: a regular expression the widget's result text must match, before and after each change. The result
        is the first Output / HTML widget, in the same cell as the control, whose text matches it; it must
        change after each control is changed.
    presses: arrow-key presses on a slider's handle (ArrowRight, or ArrowLeft when it is at its maximum).
    min_images: at least this many image outputs (plots) must be rendered after Run All.
    run_timeout_s: bound on Run All Cells (a chapter has 60 s on a quiet 2-core CPU; this leaves room for a busy one).
    """

    path: str
    controls: tuple[str | None, ...]
    result: str
    presses: int = 3
    min_images: int = 1
    run_timeout_s: float = 120

    @property
    def screenshot(self) -> Path:
        return ARTIFACTS / (Path(self.path).stem + ".png")


def _pattern(text: str) -> re.Pattern:
    """A case's regular expression. Playwright runs it in the page, as a JavaScript RegExp: keep to the syntax
    both languages share (no inline flags such as (?i)); matching is case-insensitive."""
    return re.compile(text, re.IGNORECASE)


def case(c: Case, *, missing_reason: str) -> pytest.param:
    mark = pytest.mark.skipif(not (ROOT / c.path).exists(), reason=f"{missing_reason}: {c.path} does not exist")
    return pytest.param(c, id=Path(c.path).stem, marks=mark)


CASES = [
    # A small real notebook with the same shape as a chapter: a calculator widget (two sliders and a number box,
    # a printed result with "days") and a plot. It keeps the browser machinery tested whatever state the
    # chapters are in, and tries both kinds of control.
    case(
        Case("tests/browser/widgets_fixture.ipynb", controls=(r"^GPUs$", r"^Tokens"), result=r"\bdays\b"),
        missing_reason="fixture",
    ),
    # Chapter 1's training-time calculator is the same widget path as chapter 5's (a slider changes the days
    # shown): tests/test_widgets.py drives it without a browser, which saves this suite the 21 s of its page here.
    # Chapter 5's cluster calculator: the MFU slider changes the step time and the days.
    case(Case("chapters/05_hardware.ipynb", controls=(r"^MFU",), result=r"\bdays\b"),
         missing_reason="chapter not written yet"),
    # Chapter 6's warmup schedule explorer (selection sliders), as the chapter calls it, in a notebook of its own: the
    # chapter's Run All retrains its 36-run sweep (33 s of this suite's page) and `make site` runs the chapter
    # already. The peak LR and the run's length change the schedule (one press moves the warmup from 20 to 200
    # updates, past these 60: refused, so it is not driven here).
    case(Case("tests/browser/schedule_fixture.ipynb", controls=(r"^peak LR$", r"^total steps$"),
              result=r"update 0 at LR"), missing_reason="fixture"),
]


# ------------------------------------------------------------------------------------------------ JupyterLab


# User settings for the throw-away JupyterLab: no autosave, every cell rendered, no prompts, no news.
LAB_SETTINGS = {
    "@jupyterlab/docmanager-extension:plugin": {"autosave": False},
    "@jupyterlab/notebook-extension:tracker": {"windowingMode": "none", "autoStartDefaultKernel": True},
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
}


def _lab_settings(config_dir: Path) -> None:
    for plugin, values in LAB_SETTINGS.items():
        path = config_dir / "lab" / "user-settings" / (plugin.replace(":", "/") + ".jupyterlab-settings")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


def _get(url: str, timeout: float = 5):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status, response.read()


def _request(url: str, method: str, timeout: float = 10) -> int:
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status


class Lab:
    """A JupyterLab server in a subprocess: its base URL, token and log."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.token = secrets.token_hex(24)
        self.log_path = tmp / "jupyterlab.log"
        self.url = ""
        self.proc: subprocess.Popen | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def api(self, path: str) -> str:
        return f"{self.url}{path}?token={self.token}"

    def start(self) -> None:
        config, data, runtime = (self.tmp / d for d in ("config", "data", "runtime"))
        for d in (config, data, runtime):
            d.mkdir()
        _lab_settings(config)
        env = dict(os.environ, JUPYTER_CONFIG_DIR=str(config), JUPYTER_DATA_DIR=str(data))
        env.update(JUPYTER_RUNTIME_DIR=str(runtime), JUPYTER_PREFER_ENV_PATH="1", PYTHONUNBUFFERED="1")
        env.pop("JUPYTER_PATH", None)
        env.pop("JUPYTER_TOKEN", None)
        # port 0: the server binds a free port; its runtime file says which
        command = lab_tool.command(port=0, uid=os.geteuid()) + [
            "--no-browser",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            "--ServerApp.password=",
            "--ServerApp.open_browser=False",
            "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: run commands, read kernel status
            "--LabApp.news_url=",
            "--LabApp.extension_manager=readonly",  # no PyPI look-ups from the extension manager
            "--ServerApp.terminals_enabled=False",
            # JupyterLab checkpoints a notebook when it opens it: keep those copies out of the repository
            f"--FileCheckpoints.checkpoint_dir={self.tmp / 'checkpoints'}",
            "--LabApp.check_for_updates_class=jupyterlab.handlers.announcements.NeverCheckForUpdate",
        ]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + SERVER_START_S
        info = runtime / f"jpserver-{self.proc.pid}.json"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.proc.returncode}:\n{self.log()}")
            if info.exists() and not self.url:
                with contextlib.suppress(json.JSONDecodeError):
                    self.url = json.loads(info.read_text())["url"].rstrip("/") + "/"
            if self.url:
                with contextlib.suppress(OSError):
                    if _get(self.api("api/status"))[0] == 200:
                        self._check_settings()
                        self._check_token()
                        return
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=0.2)  # the poll interval: returns at once if the server exits
        raise RuntimeError(f"JupyterLab did not answer within {SERVER_START_S} s:\n{self.log()}")

    def _check_settings(self) -> None:
        """The server must serve the user settings written above (autosave off above all: outputs in git)."""
        for plugin, values in LAB_SETTINGS.items():
            served = json.loads(_get(self.api(f"lab/api/settings/{plugin}"))[1]).get("settings", {})
            if any(served.get(k) != v for k, v in values.items()):
                raise RuntimeError(f"JupyterLab does not use the test's settings for {plugin}: {served}")

    def _check_token(self) -> None:
        """`make lab`'s server must answer nothing without the token (403)."""
        try:
            status = _get(f"{self.url}api/contents/exercises")[0]
        except urllib.error.HTTPError as e:
            status = e.code
        if status != 403:
            raise RuntimeError(f"JupyterLab answered {status} to a request without the token, not 403")

    def shutdown_kernels(self) -> None:
        """Shut down every session's kernel (the server stays up for the next case)."""
        with contextlib.suppress(OSError, ValueError):
            for session in json.loads(_get(self.api("api/sessions"))[1]):
                with contextlib.suppress(OSError):
                    _request(self.api(f"api/sessions/{session['id']}"), "DELETE")

    def stop(self) -> None:
        """Ask the server to shut down (it stops its kernels); then kill whatever of it is left."""
        if self.proc is None:
            return
        import psutil  # ipykernel's dependency, so always here

        try:
            family = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        if self.proc.poll() is None and self.url:
            with contextlib.suppress(OSError):
                _request(self.api("api/shutdown"), "POST")
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        # kernels run in sessions of their own: anything of the family still alive is killed by its pid
        _, alive = psutil.wait_procs(family, timeout=10)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(alive, timeout=10)
        self.proc = None


# ---------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def sync_api():
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="the playwright package is not installed (pip install -e '.[dev]')"
    )
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(f"chromium is not installed ({CHROMIUM} missing; apt-get install chromium, as .ci/run does)")
    return sync_api


@pytest.fixture(scope="module")
def lab(tmp_path_factory, sync_api):
    server = Lab(tmp_path_factory.mktemp("jupyterlab"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser(sync_api):
    with sync_api.sync_playwright() as p:
        # headless=True adds --headless; Playwright gives each launch a fresh, empty profile directory of its own
        # (a --user-data-dir argument is refused by launch()) and deletes it when the browser closes
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser, lab):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(30_000)
    page = context.new_page()
    page.problems = []  # the browser's console errors and uncaught exceptions, for failure messages
    page.on("pageerror", lambda error: page.problems.append(f"page error: {error}"))
    page.on("console", lambda m: m.type == "error" and page.problems.append(f"console error: {m.text}"))
    try:
        yield page
    finally:
        with contextlib.suppress(Exception):
            context.close()
        lab.shutdown_kernels()


# ------------------------------------------------------------------------------------------------- the test

# JavaScript run in the page against JupyterLab's application object (window.jupyterapp).
JS_KERNEL_IDLE = """(path) => {
    const app = window.jupyterapp;
    const panel = app && app.shell.currentWidget;
    if (!panel || !panel.context || panel.context.path !== path || !panel.sessionContext) return false;
    const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
    return !!kernel && kernel.connectionStatus === 'connected' && kernel.status === 'idle';
}"""
JS_KERNEL_SYNC = """async ([path, ms]) => {
    // an empty, silent execute request: the kernel handles shell messages in order, so its reply and idle
    // status come after everything the widgets sent before it (comm messages) was handled and its output sent
    const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
    const done = kernel.requestExecute({code: '', silent: true, store_history: false}).done;
    const late = new Promise((_, reject) => setTimeout(() => reject(new Error('kernel did not answer')), ms));
    await Promise.race([done, late]);
    return true;
}"""
JS_RUN = """(ids) => {
    // JupyterLab commands in turn (the Run menu's); each one's promise settles when its cells have run
    window.__llmlabRun = undefined;
    (async () => {
        for (const id of ids) if (await window.jupyterapp.commands.execute(id) === false) return 'a cell failed';
        return 'done';
    })().then((result) => { window.__llmlabRun = result; }, (error) => { window.__llmlabRun = 'error: ' + error; });
}"""
JS_ERROR_OUTPUTS = """() => {
    const panel = window.jupyterapp.shell.currentWidget;
    const errors = [];
    const cells = panel.content.model.cells;
    for (let i = 0; i < cells.length; i++) {
        const cell = cells.get(i);
        if (cell.type !== 'code') continue;
        for (let j = 0; j < cell.outputs.length; j++) {
            const out = cell.outputs.get(j).toJSON();
            if (out.output_type === 'error') errors.push(`cell ${i + 1}: ${out.ename}: ${out.evalue}`);
        }
    }
    return errors;
}"""


def _context(page, lab: Lab) -> str:
    """What a failure message needs to be read without a rerun: browser errors, the last outputs, the server log."""
    problems = "\n".join(page.problems[-20:]) or "(none)"
    shown = "(could not be read)"
    with contextlib.suppress(Exception):
        texts = [t.strip()[:300] for t in page.locator(NOTEBOOK + " .jp-OutputArea-output").all_inner_texts()]
        shown = "\n---\n".join([t for t in texts if t][-10:]) or "(none)"
    return f"\nbrowser problems:\n{problems}\nlast outputs:\n{shown}\nserver log (end):\n{lab.log()[-3000:]}"


NOTEBOOK = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook"  # the notebook on show


def open_notebook(page, lab: Lab, path: str, expect):
    """Open `path` in JupyterLab and wait until its kernel is connected and idle; return the notebook locator."""
    # a workspace of its own, reset: only this notebook opens (the server remembers the tabs of earlier cases)
    workspace = "t" + secrets.token_hex(6)
    page.goto(f"{lab.url}lab/workspaces/{workspace}/tree/{path}?reset&token={lab.token}", wait_until="domcontentloaded")
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell", timeout=APP_LOAD_S * 1000)
    page.evaluate("() => window.jupyterapp.restored")  # a promise: resolves once the layout is restored
    page.wait_for_function(JS_KERNEL_IDLE, arg=path, timeout=KERNEL_IDLE_S * 1000)
    notebook = page.locator(NOTEBOOK)
    expect(notebook).to_be_visible()
    expect(page.locator(".jp-NotebookPanel")).to_have_count(1)
    indicator = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook-ExecutionIndicator")
    expect(indicator).to_have_attribute("data-status", "idle", timeout=KERNEL_IDLE_S * 1000)
    expect(page.locator(".jp-StatusBar-Widget", has_text=re.compile(r"\|\s*Idle"))).to_be_visible()
    return notebook


def run_cells(page, lab: Lab, path: str, commands: list[str], timeout_s: float, expect) -> str:
    """Run JupyterLab's run `commands` (e.g. notebook:run-all-cells) in turn on the notebook on show, and wait
    until every cell they started has finished: 'done', 'a cell failed' or 'error: …'."""
    page.evaluate(JS_RUN, commands)
    try:
        page.wait_for_function("() => window.__llmlabRun !== undefined", timeout=timeout_s * 1000, polling=250)
    except Exception as e:
        raise AssertionError(f"{', '.join(commands)} did not finish within {timeout_s} s" + _context(page, lab)) from e
    expect(page.locator(NOTEBOOK + " .jp-InputPrompt", has_text="[*]")).to_have_count(0)
    page.wait_for_function(JS_KERNEL_IDLE, arg=path, timeout=KERNEL_IDLE_S * 1000)
    return page.evaluate("() => window.__llmlabRun")


def run_all_cells(page, lab: Lab, path: str, timeout_s: float, expect) -> str:
    """Run All Cells and wait until every cell has finished: 'done', 'a cell failed' or 'error: …'."""
    return run_cells(page, lab, path, ["notebook:run-all-cells"], timeout_s, expect)


def cell_errors(page) -> list[str]:
    """Every error shown in the notebook: error outputs, tracebacks on stderr, widgets that failed to display."""
    errors = page.evaluate(JS_ERROR_OUTPUTS)
    stderr = page.locator(NOTEBOOK + ' .jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
    tracebacks = [t.strip()[:2000] for t in stderr.all_inner_texts() if "Traceback" in t]
    broken = page.locator(NOTEBOOK + " .jp-OutputArea-output", has_text="Error displaying widget")
    return errors + tracebacks + broken.all_inner_texts()


CONTROLS = ".jp-OutputArea-output :is(.widget-slider, .widget-text)"  # sliders, Int/FloatText boxes


def find_control(page, notebook, label: str | None, expect):
    """The first rendered slider or number box whose description label matches `label` (None: the first
    slider), and the code cell that shows it."""
    # a locator inside has= is relative to the element it filters, so this one is built unanchored
    kind = CONTROLS if label is not None else ".jp-OutputArea-output .widget-slider"
    wanted = page.locator(kind)
    if label is not None:
        wanted = wanted.filter(has=page.locator(".widget-label", has_text=_pattern(label)))
    cell = notebook.locator(".jp-CodeCell").filter(has=wanted).first
    control = cell.locator(kind)
    if label is not None:
        control = control.filter(has=page.locator(".widget-label", has_text=_pattern(label)))
    control = control.first
    try:
        expect(control).to_be_visible(timeout=WIDGET_RENDER_S * 1000)
    except AssertionError as e:
        labels = notebook.locator(CONTROLS + " .widget-label").all_inner_texts()
        raise AssertionError(
            f"no slider or number box with a label matching {label!r} rendered (labels shown: {labels})"
        ) from e
    return cell, control


def change_control(control, presses: int, expect) -> tuple[str, str]:
    """Change a slider (arrow keys on its focused handle) or a number box (double its value, Enter); wait
    until the widget shows the new value; return (old, new) as shown."""
    if "widget-slider" in (control.get_attribute("class") or ""):
        handle = control.locator(".noUi-handle").first
        shown = control.locator(".widget-readout")
        old = shown.inner_text().strip()
        at_max = float(handle.get_attribute("aria-valuenow")) >= float(handle.get_attribute("aria-valuemax"))
        handle.scroll_into_view_if_needed()
        handle.focus()
        expect(handle).to_be_focused()
        for _ in range(presses):
            handle.press("ArrowLeft" if at_max else "ArrowRight")
        expect(shown).not_to_have_text(old, timeout=RESULT_CHANGE_S * 1000)
        return old, shown.inner_text().strip()
    box = control.locator("input").first
    old = box.input_value().strip()
    number = float(old or 0)
    new = number * 2 if number else 1.0
    typed = str(int(new)) if new == int(new) else repr(new)
    box.scroll_into_view_if_needed()
    box.fill(typed)
    box.press("Enter")  # Int/FloatText send their value on Enter (continuous_update is off for them)
    expect(box).not_to_have_value(old, timeout=RESULT_CHANGE_S * 1000)
    return old, box.input_value().strip()


@pytest.mark.slow
@pytest.mark.parametrize("nb", CASES)
def test_notebook_in_jupyterlab(page, lab, sync_api, nb: Case):
    expect = sync_api.expect
    before_file = hashlib.sha256((ROOT / nb.path).read_bytes()).hexdigest()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    nb.screenshot.unlink(missing_ok=True)
    step = "open the notebook and wait for an idle kernel"
    try:
        # 1. open the notebook; wait for the app, the notebook panel and an idle, connected kernel
        notebook = open_notebook(page, lab, nb.path, expect)

        # 2. Run All Cells, through the command the Run menu calls; its promise settles when every cell is done
        step = "run all cells"
        run_all = run_all_cells(page, lab, nb.path, nb.run_timeout_s, expect)

        # 3. no cell may show an error
        step = "check the outputs for errors"
        errors = cell_errors(page)
        assert not errors and run_all == "done", (
            f"{nb.path}: Run All Cells: {run_all}; errors shown:\n" + "\n".join(errors) + _context(page, lab)
        )

        # 4. the widgets render (ipywidgets' lab extension loaded, models reached the page), and the plots
        step = "wait for the plots"
        if nb.min_images:
            images = notebook.locator(".jp-OutputArea-output img")
            expect(images.nth(nb.min_images - 1)).to_be_visible(timeout=WIDGET_RENDER_S * 1000)
        for label in nb.controls:
            step = f"wait for the widget labelled {label!r}"
            cell, control = find_control(page, notebook, label, expect)
            step = f"find the result: an Output/HTML widget matching {nb.result!r} in the cell of {label!r}"
            result = cell.locator(".widget-output, .widget-html, .widget-htmlmath")
            result = result.filter(has_text=_pattern(nb.result)).first
            expect(result).to_be_visible(timeout=WIDGET_RENDER_S * 1000)
            before = result.inner_text().strip()

            # 5. change the control; the value it shows, then the result must change
            step = f"change the widget labelled {label!r}"
            old, new = change_control(control, nb.presses, expect)
            step = f"wait for the result to change from {before!r} (widget {label!r}: {old} -> {new})"
            expect(result).not_to_have_text(before, timeout=RESULT_CHANGE_S * 1000)
            expect(result).to_have_text(_pattern(nb.result), timeout=RESULT_CHANGE_S * 1000)
            page.evaluate(JS_KERNEL_SYNC, [nb.path, KERNEL_IDLE_S * 1000])  # every press's update has arrived
            expect(result).to_have_text(_pattern(nb.result))
            after = result.inner_text().strip()
            assert after != before, f"result unchanged: {before!r}"
            errors = cell_errors(page)  # a callback that raised shows its traceback in the Output widget
            assert not errors, "errors after changing a widget:\n" + "\n".join(errors)
            print(f"{nb.path}: {label!r} {old} -> {new}; result {before!r} -> {after!r}")
        control.scroll_into_view_if_needed()
    except (AssertionError, sync_api.TimeoutError) as e:
        message = str(e) if "server log (end)" in str(e) else f"{e}{_context(page, lab)}"
        raise AssertionError(f"{nb.path}: failed at step '{step}':\n{message}") from None
    finally:
        with contextlib.suppress(Exception):
            page.screenshot(path=str(nb.screenshot))
    # running cells must not have written outputs into the notebook (autosave is off in the lab's settings)
    assert hashlib.sha256((ROOT / nb.path).read_bytes()).hexdigest() == before_file, f"{nb.path} was modified"


@pytest.mark.slow
def test_errors_in_cells_are_caught(page, lab, sync_api):
    """The check above sees a traceback printed on stderr and an exception (the fixture fails on purpose)."""
    path = "tests/browser/errors_fixture.ipynb"
    open_notebook(page, lab, path, sync_api.expect)
    assert run_all_cells(page, lab, path, 60, sync_api.expect) == "a cell failed"
    errors = cell_errors(page)
    assert any("ValueError: planted by the error fixture" in e for e in errors), errors
    assert any("ZeroDivisionError" in e and "Traceback" in e for e in errors), errors


# the first exercise notebook a learner meets, and its first exercise's answer (the solution's code cell)
EXERCISE = "exercises/01_compute.ipynb"
JS_FIRST_CHECK = """() => {
    // the index of the notebook's first check cell ("check.…(…)"), or -1
    const cells = window.jupyterapp.shell.currentWidget.content.model.cells;
    for (let i = 0; i < cells.length; i++) {
        const cell = cells.get(i);
        if (cell.type === 'code' && cell.sharedModel.getSource().trimStart().startsWith('check.')) return i;
    }
    return -1;
}"""
JS_SAVED = "() => !window.jupyterapp.shell.currentWidget.context.model.dirty"  # the save has come back
JS_SOURCE = "(i) => window.jupyterapp.shell.currentWidget.content.model.cells.get(i).sharedModel.getSource()"


def _first_answer(solution: Path) -> str:
    """The source of the solution notebook's first code cell with an answer region (`### BEGIN SOLUTION`)."""
    sources = ["".join(c["source"]) for c in json.loads(solution.read_text(encoding="utf-8"))["cells"]
               if c["cell_type"] == "code"]  # fmt: skip
    return next(source for source in sources if "### BEGIN SOLUTION" in source)


@pytest.mark.slow
def test_learner_opens_an_exercise_from_the_file_browser(page, lab, sync_api):
    """As a learner: `make lab`'s first page is START.md, rendered, with a link to every chapter and exercise
    notebook, and no kernel; through the file browser, exercises/, then the first exercise notebook, which a save
    right after opening leaves as it was; run down to its first check ("not
    attempted yet"); type the answer into the exercise cell; run it and the check again ("passed")."""
    expect = sync_api.expect
    before = {p: hashlib.sha256((ROOT / p).read_bytes()).hexdigest() for p in (EXERCISE, lab_tool.LANDING)}
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    screenshot = ARTIFACTS / "learner_first_steps.png"
    step = "open the server's first page"
    try:
        # 1. the server's root redirects to make lab's first page, the landing notebook with its links rendered
        page.goto(f"{lab.url}?token={lab.token}", wait_until="domcontentloaded")
        page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell", timeout=APP_LOAD_S * 1000)
        page.evaluate("() => window.jupyterapp.restored")
        landing = ".jp-MarkdownViewer .jp-RenderedMarkdown"  # rendered (the lab's overrides.json), not as source
        expect(page.locator(landing).first).to_contain_text("start here", timeout=APP_LOAD_S * 1000)
        links = re.findall(r"\]\(([^)\s]+\.ipynb)\)", (ROOT / lab_tool.LANDING).read_text(encoding="utf-8"))
        expect(page.locator(landing + " a:not(.jp-InternalAnchorLink)")).to_have_count(len(links))  # not the ¶
        assert json.loads(_get(lab.api("api/sessions"))[1]) == [], "the landing page started a kernel"

        # 2. the file browser: into exercises/ (double-click the folder), then open the notebook (double-click)
        step = "open exercises/ in the file browser"
        folder, name = EXERCISE.split("/")
        def item(text: str):  # a file browser row by its exact name (a row also shows the file's age)
            named = page.locator(".jp-DirListing-itemText", has_text=re.compile(rf"^{re.escape(text)}$"))
            return page.locator("#filebrowser .jp-DirListing-item").filter(has=named)

        item(folder).dblclick()
        expect(page.locator("#filebrowser .jp-BreadCrumbs")).to_contain_text(folder)
        step = f"open {name} from the file browser"
        item(name).dblclick()
        page.wait_for_function(JS_KERNEL_IDLE, arg=EXERCISE, timeout=KERNEL_IDLE_S * 1000)
        notebook = page.locator(NOTEBOOK)

        # 3a. opened and its kernel started, saved without an edit: the file keeps its bytes (llmlab.labserver)
        step = "save the opened exercise notebook"
        page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
        page.wait_for_function(JS_SAVED, timeout=RESULT_CHANGE_S * 1000)
        assert hashlib.sha256((ROOT / EXERCISE).read_bytes()).hexdigest() == before[EXERCISE], \
            "opening and saving the exercise notebook changed it"

        # 3. select the first check cell; run every cell above it, then it: it reports "not attempted yet"
        step = "run down to the first check"
        index = page.evaluate(JS_FIRST_CHECK)
        assert index > 0, f"{EXERCISE} has no check cell"
        check_cell, answer_cell = notebook.locator(".jp-Cell").nth(index), notebook.locator(".jp-Cell").nth(index - 1)
        check_cell.locator(".jp-InputPrompt").click()
        assert run_cells(page, lab, EXERCISE, ["notebook:run-all-above"], 60, expect) == "done", _context(page, lab)
        check_cell.locator(".jp-InputPrompt").click()
        assert run_cells(page, lab, EXERCISE, ["notebook:run-cell"], 60, expect) == "done", _context(page, lab)
        verdict = check_cell.locator(".jp-OutputArea-output")
        expect(verdict).to_contain_text(re.compile(r"Exercise \d+\.\d+ .*not attempted yet"))

        # 4. type the answer into the exercise cell (replacing its raise line), run it and the check: "passed"
        step = "type the answer in and run the check again"
        answer = _first_answer(ROOT / "solutions" / name)
        assert page.evaluate(JS_SOURCE, index - 1).splitlines()[0] == answer.splitlines()[0]  # the same def line
        answer_cell.locator(".cm-content").click()
        page.keyboard.press("ControlOrMeta+a")
        page.keyboard.insert_text(answer)  # as pasted: no auto-indent or bracket closing on the way in
        typed = f"([i, text]) => ({JS_SOURCE})(i) === text"  # the cell's model holds exactly the answer
        page.wait_for_function(typed, arg=[index - 1, answer], timeout=RESULT_CHANGE_S * 1000)
        page.keyboard.press("Escape")
        commands = ["notebook:run-cell-and-select-next", "notebook:run-cell"]  # the answer, then the check
        assert run_cells(page, lab, EXERCISE, commands, 60, expect) == "done", _context(page, lab)
        expect(verdict).to_contain_text(re.compile(r"Exercise \d+\.\d+ .*: passed"))
        print(f"{EXERCISE}: {verdict.inner_text().strip()}")
    except (AssertionError, sync_api.TimeoutError) as e:
        message = str(e) if "server log (end)" in str(e) else f"{e}{_context(page, lab)}"
        raise AssertionError(f"failed at step '{step}':\n{message}") from None
    finally:
        with contextlib.suppress(Exception):
            page.screenshot(path=str(screenshot))
    # nothing was saved: the exercise and the landing page are as they were (autosave is off in the lab's settings)
    assert before == {p: hashlib.sha256((ROOT / p).read_bytes()).hexdigest() for p in before}
