"""llmlab.site (`llmlab site`): chapters executed into HTML pages with their outputs, failures named, an index."""

from pathlib import Path

import nbformat
import pytest

from llmlab import cli, site

ROOT = Path(__file__).resolve().parents[1]


def notebook(path, *cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(c[3:]) if c.startswith("md:") else nbformat.v4.new_code_cell(c)
                for c in cells]
    nbformat.write(nb, path)
    return path


def test_pages_carry_outputs_and_failures_are_named(tmp_path, capsys, monkeypatch):
    good = notebook(tmp_path / "01_good.ipynb", "md:# Chapter A (甲)", "x = 6 * 7\nprint('answer', x)",
                    "import pathlib\nprint(pathlib.Path.cwd().name)",
                    "import os\nfrom tqdm.auto import tqdm\nfrom tqdm.std import tqdm as text_bar\n"
                    "for _ in tqdm(range(3), desc='widget bar'): pass\n"
                    "for _ in text_bar(range(3), desc='text bar'): pass\n"
                    "print('TQDM_DISABLE =', os.environ.get('TQDM_DISABLE'))")
    bad = notebook(tmp_path / "02_bad.ipynb", "md:## no top heading", "print('before')", "1 / 0", "print('after')")
    out = tmp_path / "pages"
    (out).mkdir()
    (out / "01_good.html").write_text("an older page")
    lines = []
    monkeypatch.setattr(site, "BUDGET_S", 0.5)  # below any chapter's time (a kernel takes seconds to start)
    pages = site.build([good, bad], out, timeout=120, log=lines.append)
    assert [p.html.name for p in pages] == ["01_good.html", "02_bad.html"] and len(lines) == 2
    assert lines[0].endswith(" ok, over the 0.5 s budget") and "FAILED cell 3: ZeroDivisionError" in lines[1]
    page = (out / "01_good.html").read_text()
    assert "answer 42" in page and tmp_path.name in page  # executed, in the notebook's own folder
    assert pages[0].title == "Chapter A (甲)" and pages[0].problem == "" and "an older page" not in page
    # no bar on the page (tqdm writes "desc: 0%|"): the widget's output dropped, the text bar off by TQDM_DISABLE
    assert "TQDM_DISABLE = 1" in page and "widget bar:" not in page and "text bar:" not in page
    assert pages[1].title == "02_bad" and pages[1].problem.startswith("cell 3: ZeroDivisionError")
    broken = (out / "02_bad.html").read_text()
    assert "before" in broken and "ZeroDivisionError" in broken and "after" in broken  # errors do not stop a run
    index = (out / "index.html").read_text()
    assert 'href="01_good.html">Chapter A (甲)</a>' in index and "failed: cell 3: ZeroDivisionError" in index
    assert f"ran in {pages[0].seconds:.0f} s at {pages[0].load}</li>" in index and " on " in str(pages[0].load)
    assert sorted(p.name for p in out.iterdir()) == ["01_good.html", "02_bad.html", "index.html"]  # no temp files
    assert (out / "index.html").stat().st_mode & 0o044 == 0o044  # readable by a web server

    assert cli.main(["site", str(bad), "--out", str(out)]) == 1
    assert "02_bad.ipynb: cell 3: ZeroDivisionError" in capsys.readouterr().err


def test_frozen_bars_are_those_stopped_short_of_their_total():
    text = ("GEMMs:   0%|          | 0/3 [00:00<?, ?it/s]\nshapes: 100%|██████████| 4/4 [00:02<00:00,  1.9it/s]\n"
            " 40%|████      | 2/5 [00:01<00:01]\nC7 ratio 0.96× ±4%| not a bar\n")
    assert site.frozen_bars(text) == ["0%|          | 0/3", "40%|████      | 2/5"]
    assert site.frozen_bars("no bar here: 12%") == []


def test_a_chapter_that_runs_too_long_is_stopped(tmp_path):
    slow = notebook(tmp_path / "03_slow.ipynb", "md:# Slow", "import time\ntime.sleep(60)")
    page = site.build_page(slow, tmp_path, timeout=8)
    assert "did not finish within 8 s" in page.problem and page.seconds < 30


def test_bad_input_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="notebook='.*missing.ipynb' is not a .ipynb file"):
        site.build_page(tmp_path / "missing.ipynb", tmp_path)
    with pytest.raises(ValueError, match="timeout=0"):
        site.build_page(notebook(tmp_path / "a.ipynb", "1"), tmp_path, timeout=0)
    with pytest.raises(ValueError, match="notebooks is empty"):
        site.build([], tmp_path)
    assert cli.main(["site", str(tmp_path / "notes.txt")]) == 2
    assert "llmlab site: error: notebook=" in capsys.readouterr().err


def test_a_wrong_answer_reads_as_a_verdict_in_the_page(tmp_path):
    """Issue 27: exercise 4.1's solution with a learner's off-by-one planted (the chunk received) shows, in its
    built page, one ❌ line and a hint — no gloo abort text, no traceback into llmlab/checks; an error in the
    learner's own code (4.4 dividing by zero) shows its traceback from their cell only."""
    nb = nbformat.read(ROOT / "solutions" / "04_communication.ipynb", as_version=4)
    answer = nb.cells[3]
    assert "c = (rank - step - 2) % n" in answer.source and "check.ring_reduce_scatter" in nb.cells[4].source
    answer.source = answer.source.replace("c = (rank - step - 2) % n", "c = (rank - step - 1) % n")
    planted = "check.choose_allreduce(lambda S, N, a, b: S / 0, None, None, None)"
    nb.cells = [*nb.cells[:5], nbformat.v4.new_code_cell(planted)]
    nbformat.write(nb, tmp_path / "planted.ipynb")
    page = site.build_page(tmp_path / "planted.ipynb", tmp_path, timeout=120)
    text = page.html.read_text()
    assert text.count("❌ Exercise 4.1") == 1 and text.count("❌ Exercise 4.4") == 1
    assert "Hint 1 of 3: look at the index of the chunk you receive" in text
    assert "terminate called" not in text and "what():" not in text and "llmlab/checks" not in text
    ours = text[text.index("❌ Exercise 4.4"):]
    assert "Traceback of your code" in ours and "ZeroDivisionError" in ours and "S / 0" in ours
    assert "Traceback" not in text[:text.index("❌ Exercise 4.4")]
