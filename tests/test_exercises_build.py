"""`llmlab exercises build` never overwrites a learner's work: an exercise notebook edited since it was built is
refused by name (nothing written) unless --force; a stale, untouched one is rebuilt."""

import pytest

from llmlab import cli
from llmlab.exercises import notebooks
from tests.test_exercises import copy_fixture, edit_cell


@pytest.fixture
def project(tmp_path):
    root = copy_fixture(tmp_path / "project")
    notebooks.build(root)
    return root


def test_an_edited_exercise_is_not_overwritten(project, capsys):
    mine = project / "exercises" / "01_softmax.ipynb"
    edit_cell(mine, "check.softmax(softmax)", "check.softmax(softmax)  # my answer is above")
    edit_cell(project / "solutions" / "02_cross_entropy.ipynb", "from logits", "from the logits")  # stale beside it
    saved, stale = mine.read_bytes(), (project / "exercises" / "02_cross_entropy.ipynb").read_bytes()
    with pytest.raises(notebooks.NotebookError, match="01_softmax.ipynb: edited since it was built"):
        notebooks.build(project)
    assert mine.read_bytes() == saved  # and nothing else was written either
    assert (project / "exercises" / "02_cross_entropy.ipynb").read_bytes() == stale
    assert cli.main(["exercises", "build", "--root", str(project)]) == 2
    assert "--force" in capsys.readouterr().err
    assert cli.main(["exercises", "build", "--root", str(project), "--force"]) == 0
    assert mine.read_bytes() != saved and notebooks.check(project) == []


def test_a_stale_untouched_exercise_is_rebuilt(project):
    edit_cell(project / "solutions" / "01_softmax.ipynb", "correct for logits of any size", "for any logits")
    notebooks.build(project)
    assert notebooks.check(project) == []
