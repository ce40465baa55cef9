"""`make lab` (tools/lab.py) and the page it opens first (START.md, written by tools/landing.py), without a browser.

tests/test_browser.py starts JupyterLab with the same command line and clicks through to an exercise.
"""

import importlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lab, landing = _tool("lab"), _tool("landing")
LINK = re.compile(r"\]\(([^)\s]+)\)")  # a Markdown link's target


def flags(argv: list[str]) -> dict[str, str]:
    """The `--name=value` options of a command line, by name (a bare `--flag` maps to "")."""
    return dict((a[2:].split("=", 1) + [""])[:2] for a in argv if a.startswith("--"))


def test_make_lab_roots_jupyterlab_at_the_project_on_localhost():
    # the recipe make would run (-o: take the venv as set up, never rebuild it), then that recipe asked to print
    # the command line it would exec. --no-print-directory and a clean MAKEFLAGS/MAKELEVEL: under a parent make
    # (CI runs `make test`) a sub-make otherwise adds "Entering directory" lines.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    recipe = subprocess.run(["make", "--no-print-directory", "-n", "-o", ".venv/.llmlab-installed", "lab",
                             "PORT=8893"], cwd=ROOT, env=env, capture_output=True, text=True,
                            check=True).stdout.strip().splitlines()  # fmt: skip
    assert recipe == [".venv/bin/python tools/lab.py --port=8893"]
    run = subprocess.run([*shlex.split(recipe[0]), "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    *said, line = run.stdout.strip().splitlines()
    argv = shlex.split(line)
    assert argv[1:3] == ["-m", "jupyterlab"] and Path(argv[0]).samefile(ROOT / ".venv" / "bin" / "python")
    options = flags(argv)
    assert Path(options["ServerApp.root_dir"]) == ROOT  # chapters/ and exercises/ are both inside the root
    assert options["ServerApp.ip"] == "localhost"
    assert options["ServerApp.port"] == "8893"
    assert options["LabApp.default_url"] == "/lab/tree/START.md" and (ROOT / "START.md").is_file()
    # JupyterLab's own random token stays on: nothing sets a token or password (nor puts one where `ps` shows it)
    assert not [a for a in argv if re.search(r"token|password", a, re.I)]
    as_root = os.geteuid() == 0
    assert ("allow-root" in options) == as_root
    assert said == (["tools/lab.py: running as root (uid 0, as in most containers): adding --allow-root"]
                    if as_root else [])  # fmt: skip


def test_allow_root_only_for_uid_0():
    as_root, as_user = lab.command(8888, uid=0), lab.command(8888, uid=1000)
    assert as_root == [*as_user, "--allow-root"]
    assert "--allow-root" not in as_user


def test_a_bad_port_is_refused_naming_it(capsys):
    with pytest.raises(SystemExit) as stop:
        lab.main(["--port", "70000", "--dry-run"])
    assert stop.value.code == 2
    assert "--port 70000: a port is a number from 0 to 65535" in capsys.readouterr().err


def _landing_links(text: str) -> list[str]:
    return [unquote(t) for t in LINK.findall(text)]


def test_start_page_is_up_to_date():
    assert landing.LANDING == lab.LANDING == "START.md"
    assert landing.is_current(ROOT / lab.LANDING), "START.md is stale: run .venv/bin/python tools/landing.py"


def test_start_page_is_stale_when_a_notebook_is_added(tmp_path):
    _notebook(tmp_path / "chapters" / "01_a.ipynb", "# Chapter A")
    start = tmp_path / "START.md"
    assert not landing.is_current(start, tmp_path)  # missing
    start.write_text(landing.text(tmp_path), encoding="utf-8")
    assert landing.is_current(start, tmp_path)
    _notebook(tmp_path / "exercises" / "01_a.ipynb", "### Exercise 1.1: New")
    assert not landing.is_current(start, tmp_path)  # an exercise notebook added since


def test_the_server_opens_markdown_rendered_and_keeps_shipped_notebooks_as_they_are():
    options = flags(lab.command(8888, uid=1000))
    overrides = json.loads((Path(options["LabApp.app_settings_dir"]) / "overrides.json").read_text())
    assert overrides["@jupyterlab/docmanager-extension:plugin"]["defaultViewers"] == {"markdown": "Markdown Preview"}
    module, name = options["ContentsManager.pre_save_hook"].rsplit(".", 1)
    assert callable(getattr(importlib.import_module(module), name))


def test_every_start_page_link_resolves_and_every_notebook_is_linked():
    links = _landing_links((ROOT / lab.LANDING).read_text(encoding="utf-8"))
    assert all((ROOT / link).is_file() for link in links), [link for link in links if not (ROOT / link).is_file()]
    notebooks = {p.relative_to(ROOT).as_posix() for folder in ("chapters", "exercises")
                 for p in (ROOT / folder).glob("*.ipynb")}  # fmt: skip
    assert len(notebooks) >= 16 and sorted(links) == sorted(notebooks)


def _notebook(path: Path, *markdown: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    cells = [nbformat.v4.new_markdown_cell(m) for m in markdown] + [nbformat.v4.new_code_cell("x = 1")]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)


def test_start_page_follows_the_files(tmp_path):
    _notebook(tmp_path / "chapters" / "01_a.ipynb", "intro, no heading", "# Chapter A | pipes [and brackets]")
    _notebook(tmp_path / "exercises" / "01_a.ipynb", "# A's exercises", "### Exercise 1.1: First", "text",
              "## Exercise 1.2")  # fmt: skip
    _notebook(tmp_path / "chapters" / "02_b.ipynb", "no heading at all")
    _notebook(tmp_path / "exercises" / "03_c.ipynb", "### Exercise 3.1 — Only one")
    text = landing.text(tmp_path)
    table = text.split("|---|---|\n")[1]
    rows = table.splitlines()
    assert rows == [
        r"| [Chapter A \| pipes \[and brackets\]](chapters/01_a.ipynb) | [2 exercises](exercises/01_a.ipynb): "
        r"1.1 First · 1.2 |",
        "| [02_b](chapters/02_b.ipynb) | — |",
        "| — | [1 exercise](exercises/03_c.ipynb): 3.1 Only one |",
    ]
    assert sorted(_landing_links(text)) == ["chapters/01_a.ipynb", "chapters/02_b.ipynb", "exercises/01_a.ipynb",
                                            "exercises/03_c.ipynb"]  # fmt: skip
    assert text == landing.text(tmp_path)  # the same files give the same bytes


def test_start_page_needs_notebooks(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no notebooks in chapters/ or exercises/"):
        landing.text(tmp_path)


def test_jupyterlab_s_terminal_finds_the_project_s_llmlab_first():
    env = lab.environment({"PATH": "/usr/bin:/bin", "HOME": "/home/x"})
    first, *rest = env["PATH"].split(os.pathsep)
    assert Path(first, "llmlab").is_file() and Path(first, "python").samefile(sys.executable)
    assert rest == ["/usr/bin", "/bin"] and env["HOME"] == "/home/x"
    assert lab.environment(env)["PATH"] == env["PATH"]  # once, however often it is applied
