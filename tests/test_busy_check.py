"""tools/busy_check.py's rules, on small synthetic pages shaped like nbconvert's lab template (nothing is built)."""

import html
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from llmlab import site, timing
from llmlab.claims import INCONCLUSIVE, ClaimsTable

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("busy_check", ROOT / "tools" / "busy_check.py")
busy_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(busy_check)


def output(text: str, mime: str = "text/plain") -> str:
    """One cell output as the lab template writes it."""
    return (f'<div class="jp-OutputArea-child"><div class="jp-OutputPrompt jp-OutputArea-prompt"></div>'
            f'<div class="jp-RenderedText jp-OutputArea-output" data-mime-type="{mime}" tabindex="0">'
            f"<pre>{html.escape(text)}</pre></div></div>")


def claims_output(rows: dict[str, str]) -> str:
    head = "".join(f'<th style="text-align:left">{html.escape(h)}</th>' for h in ClaimsTable.HEADER)
    body = "".join(f"<tr><td>{c}</td><td>says</td><td>measured 1.2× ±4%<br>(cpu)</td>"
                   f'<td style="color:#1a7f37;font-weight:bold">{html.escape(v)}</td></tr>' for c, v in rows.items())
    return (f'<div class="jp-RenderedHTMLCommon jp-RenderedHTML jp-OutputArea-output" data-mime-type="text/html">'
            f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>")


def page(*outputs: str, markdown: str = "") -> str:
    """A page: a style sheet, a markdown cell, a code cell's source, then the given outputs."""
    return ("<html><head><style>.jp-OutputArea-output { color: red } /* InvariantWarning: in a style */</style>"
            f'</head><body><div class="jp-RenderedMarkdown jp-MarkdownOutput">{markdown}</div>'
            '<div class="highlight"><pre>for _ in tqdm(range(3)): pass  # 0%|   | 0/3 in the source</pre></div>'
            f'<div class="jp-OutputArea jp-Cell-outputArea">{"".join(outputs)}<img src="x.png"></div></body></html>')


def test_verdicts_are_read_from_claims_tables_only():
    other = ('<div class="jp-RenderedHTMLCommon jp-OutputArea-output"><table><tr><th>id</th><th>verdict</th></tr>'
             "<tr><td>C99</td><td>holds</td></tr></table></div>")
    text = page(output("hello"), other, claims_output({"C7": "holds with conditions", "C8": INCONCLUSIVE}))
    assert busy_check.verdicts(text) == {"C7": "holds with conditions", "C8": INCONCLUSIVE}
    assert busy_check.verdicts(page(output("no claims"))) == {}


def test_a_verdict_may_only_differ_where_one_build_could_not_decide():
    quiet = page(claims_output({"C7": "misleading", "C8": "holds", "C9": "holds", "C12": INCONCLUSIVE}))
    busy = page(claims_output({"C7": INCONCLUSIVE, "C8": "holds", "C9": "holds with conditions", "C12": "holds"}))
    assert busy_check.compare_pages("02.html", quiet, busy) == [
        "02.html: C9 reads 'holds with conditions' in the busy build but 'holds' in the quiet one"]
    assert busy_check.compare_pages("02.html", quiet, quiet) == []
    assert busy_check.compare_pages("02.html", page(claims_output({"C1": "holds"})), page()) == [
        "02.html: C1 is in the quiet build only"]


def test_invariant_warnings_and_frozen_bars_in_outputs_fail_naming_the_page():
    warned = output("/tmp/ipykernel_1/2.py:3: InvariantWarning: invariant violated: roof 1 < point 2\n"
                    "  invariants.check(point <= roof, ...)\n", mime="application/vnd.jupyter.stderr")
    frozen = output("GEMMs:   0%|          | 0/3 [00:00<?, ?it/s]")
    done = output("shapes: 100%|██████████| 4/4 [00:02<00:00,  1.9it/s]")
    markdown = "<p>a violation prints <code>InvariantWarning: invariant violated: …</code></p>"
    assert busy_check.page_problems("01.html", page(output("fine"), done, markdown=markdown)) == []
    assert busy_check.compare_pages("01.html", page(warned), page(frozen)) == [
        "01.html (quiet): InvariantWarning: invariant violated: roof 1 < point 2",
        "01.html (busy): a frozen progress bar: '0%|          | 0/3'"]


def test_run_problems_and_the_report(tmp_path):
    load = timing.Load(1.5, 2)
    (tmp_path / "q").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "q" / "06_x.html").write_text(page(claims_output({"C16": "holds", "C17": "holds"})))
    (tmp_path / "b" / "06_x.html").write_text(page(claims_output({"C16": INCONCLUSIVE, "C17": "wrong"})))
    quiet = [site.Page(Path("06_x.ipynb"), tmp_path / "q" / "06_x.html", "X", 75.0, load)]
    busy = [site.Page(Path("06_x.ipynb"), tmp_path / "b" / "06_x.html", "X", 90.0, timing.Load(4.2, 2),
                      "cell 3: ValueError: no")]
    text, problems = busy_check.report(quiet, busy, 2)
    assert problems == ["06_x.html (quiet): ran 75 s, over its 60 s budget",
                        "06_x.html (busy): failed: cell 3: ValueError: no",
                        "06_x.html: C17 reads 'wrong' in the busy build but 'holds' in the quiet one"]
    assert "load 1.5 on 2 cores" in text and "load 4.2 on 2 cores" in text and "3 problems:" in text
    assert any(line.split()[:3] == ["C16", "06_x", "holds"] and line.endswith(INCONCLUSIVE)
               for line in text.splitlines())  # the verdicts side by side


def test_chapters_are_picked_by_prefix(tmp_path):
    for name in ("01_compute.ipynb", "02_parallelism.ipynb", "notes.ipynb"):
        (tmp_path / name).write_text("{}")
    assert [p.name for p in busy_check.chapters(None, tmp_path)] == ["01_compute.ipynb", "02_parallelism.ipynb"]
    assert [p.name for p in busy_check.chapters(["02", "0"], tmp_path)] == ["02_parallelism.ipynb",
                                                                            "01_compute.ipynb"]
    with pytest.raises(ValueError, match="--chapters '09' names no notebook"):
        busy_check.chapters(["09"], tmp_path)


def test_bad_options_are_refused():
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "busy_check.py"), "--busy", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--busy=0 must be at least 1" in run.stderr
