"""llmlab.labserver: the JupyterLab server's pre-save hook keeps a shipped notebook's language_info as in its file,
so opening, running and saving a chapter without an edit writes the same bytes (tests/test_browser.py saves one
in JupyterLab itself)."""

import copy
import json
from pathlib import Path

import nbformat
import pytest
from jupyter_server.services.contents.filemanager import FileContentsManager

from llmlab.labserver import keep_language_info

KERNEL_SAYS = {"name": "python", "version": "3.12.9", "mimetype": "text/x-python", "file_extension": ".py"}


@pytest.fixture
def manager(tmp_path):
    return FileContentsManager(root_dir=str(tmp_path), pre_save_hook=keep_language_info)


def write(manager, path: str, language_info=None) -> bytes:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# A chapter")])
    nb.cells[0].id = "fixed"
    if language_info is not None:
        nb.metadata.language_info = language_info
    file = Path(manager.root_dir, path)
    file.parent.mkdir(parents=True, exist_ok=True)
    text = nbformat.writes(nb) + "\n"  # as the project writes its notebooks
    file.write_text(text, encoding="utf-8")
    return text.encode("utf-8")


def save_as_jupyterlab_does(manager, path: str, edit=None) -> None:
    """Save the notebook as JupyterLab does once its kernel has started: with the kernel's language_info."""
    model = manager.get(path)
    content = json.loads(json.dumps(model["content"]))
    content["metadata"]["language_info"] = copy.deepcopy(KERNEL_SAYS)
    if edit:
        edit(content)
    manager.save({"type": "notebook", "format": "json", "content": content}, path)


@pytest.mark.parametrize("folder", ["chapters", "exercises", "solutions"])
@pytest.mark.parametrize("language_info", [None, {"name": "python"}], ids=["none", "its own"])
def test_a_shipped_notebook_saved_unedited_keeps_its_bytes(manager, folder, language_info):
    path = f"{folder}/01_a.ipynb"
    before = write(manager, path, language_info)
    save_as_jupyterlab_does(manager, path)
    assert Path(manager.root_dir, path).read_bytes() == before


def test_an_edit_is_saved_and_only_language_info_is_kept(manager):
    write(manager, "exercises/01_a.ipynb")

    def answer(content):
        content["cells"][0]["source"] = "# My answer"

    save_as_jupyterlab_does(manager, "exercises/01_a.ipynb", answer)
    saved = json.loads(Path(manager.root_dir, "exercises/01_a.ipynb").read_text())
    assert "".join(saved["cells"][0]["source"]) == "# My answer" and "language_info" not in saved["metadata"]


@pytest.mark.parametrize("path", ["mine.ipynb", "notes/01_a.ipynb", "chapters/deeper/01_a.ipynb"])
def test_a_learner_s_own_notebook_is_saved_as_sent(manager, path):
    write(manager, path)
    save_as_jupyterlab_does(manager, path)
    assert json.loads(Path(manager.root_dir, path).read_text())["metadata"]["language_info"] == KERNEL_SAYS


def test_a_new_notebook_is_saved_as_sent(manager):
    model = manager.new_untitled(path="", type="notebook")
    assert manager.get(model["path"])["type"] == "notebook"  # no file to keep metadata from: nothing is changed
