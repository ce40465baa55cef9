"""The claims package's registry: mechanics (on claims registered here, in private registries), the reference
table, the audit, the chapter modules it finds, and the coverage test: every claim of every chapter that exists is
registered and really computed. What each chapter's claims measure is tested in tests/test_claims_chNN.py."""

import math
from pathlib import Path

import pytest
import torch

from llmlab import claims, timing
from llmlab.claims import ch06

ROOT = Path(__file__).resolve().parent.parent


def _time_a_sum() -> float:
    """A small real measurement, defined outside llmlab (a function calling only this is not library code)."""
    return timing.measure(lambda: torch.ones(3).sum(), min_rounds=3).seconds


# --- the reference table ------------------------------------------------------------------------------------

def test_reference_table_parses():
    rows = claims.load_reference()
    assert [r.id for r in rows] == [f"C{i}" for i in range(1, 22)]
    assert {r.id: r.chapter for r in rows}["C14"] == 5
    c1 = rows[0]
    assert c1.section == "1" and "3.14" in c1.says and "3.15e23" in c1.reference
    assert "training_flops" in c1.how
    assert all(r.says and r.reference and r.how for r in rows)


def test_bad_reference_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no claims file"):
        claims.load_reference(tmp_path / "missing.md")
    (tmp_path / "empty.md").write_text("# nothing here\n")
    with pytest.raises(ValueError, match="no claim rows"):
        claims.load_reference(tmp_path / "empty.md")
    (tmp_path / "short.md").write_text("| C1 | 1 | says |\n")
    with pytest.raises(ValueError, match=r"short.md:1: a claim row needs 5 cells"):
        claims.load_reference(tmp_path / "short.md")


# --- registry mechanics -------------------------------------------------------------------------------------

def test_register_measure_and_render():
    reg = claims.Registry()

    @reg.register("C1", chapter=1)
    def c1():
        t = _time_a_sum()
        return claims.Measurement(value=t, unit="s", text=f"a sum took {t * 1e6:.0f} µs",
                                  device=claims.here(), verdict="holds" if t < 1 else "wrong")

    @reg.register("C3", chapter=1, says="Tensor Cores <are> SIMT | units", reference="see the spec sheet")
    def c3():
        return claims.Measurement(value=(_time_a_sum(), 2.0), unit="s", text="pair", device="computed",
                                  verdict="misleading")

    assert c1().verdict == "holds"  # the decorator returns the function itself
    assert reg.ids() == ["C1", "C3"] and reg.ids(chapter=2) == []
    assert reg.get("C1").says == claims.load_reference()[0].says  # default text from llmlab/CLAIMS.md
    table = reg.table(1)
    assert [r.verdict for r in table.rows] == ["holds", "misleading"]
    assert table.rows[0].measurement.unit == "s"

    md = table.to_markdown()
    assert str(table) == md
    assert md.splitlines()[0] == "| id | the material says | measured here (device) | verdict |"
    assert "Tensor Cores <are> SIMT \\| units" in md  # a | inside a cell is escaped
    assert "| pair (computed) | misleading |" in md and f"({claims.here()}) | holds |" in md
    html = table._repr_html_()
    assert html.startswith("<table>") and "&lt;are&gt;" in html and "<are>" not in html
    assert html.count("<tr>") == 3  # header + two claims


def test_error_in_a_measure_function_is_a_row_not_a_crash():
    reg = claims.Registry()

    @reg.register("C2", chapter=1)
    def c2():
        return 1 / 0

    @reg.register("C4", chapter=1)
    def c4():
        return 3.0  # not a Measurement

    rows = reg.table(1).rows
    assert rows[0].measured == "error: ZeroDivisionError: division by zero" and rows[0].verdict == "error"
    assert "return 1 / 0" in rows[0].error  # the traceback is kept for the HTML view
    assert rows[1].measured.startswith("error: TypeError: the measure function returned float")
    assert "<details>" in reg.table(1)._repr_html_()


def test_duplicate_unknown_and_mismatched_ids_refused():
    reg = claims.Registry()
    reg.register("C5", chapter=2)(lambda: None)
    with pytest.raises(ValueError, match="claim C5 is already registered by .*<lambda>"):
        @reg.register("C5", chapter=2)
        def another():
            return None
    with pytest.raises(ValueError, match=r"claim_id='C99' is not in llmlab/CLAIMS.md \(known: C1, C2, .*C21\)"):
        reg.register("C99", chapter=1)
    with pytest.raises(ValueError, match=r"chapter=3, but llmlab/CLAIMS.md puts C5 in §2.1, which is chapter"):
        reg.register("C5", chapter=3)
    with pytest.raises(ValueError, match="must take no arguments"):
        reg.register("C6", chapter=2)(lambda x: x)
    with pytest.raises(ValueError, match=r"chapter=0 must be an int >= 1 \(a chapter number\)"):
        reg.table(0)


def test_reregistering_the_same_function_replaces_it():
    """A module re-imported in a notebook (importlib.reload) registers the same function again: allowed."""
    reg = claims.Registry()

    def c7():
        return None

    reg.register("C7", chapter=2)(c7)
    reg.register("C7", chapter=2, says="new text")(c7)
    assert reg.get("C7").says == "new text"


def test_measurement_checks_its_fields():
    with pytest.raises(ValueError, match="verdict='true' must be one of"):
        claims.Measurement(1.0, "x", "t", "computed", "true")
    with pytest.raises(ValueError, match="value='3x' must be a number"):
        claims.Measurement("3x", "x", "t", "computed", "holds")
    with pytest.raises(ValueError, match="text must say"):
        claims.Measurement(1.0, "x", "", "computed", "holds")
    assert claims.Measurement({"a": 1, "b": 2.5}, "x", "t", "computed", "wrong").numbers() == [1.0, 2.5]


# --- the audit: is a measure function a real computation? ---------------------------------------------------

def _claim(fn, claim_id="C1"):
    return claims.Claim(claim_id, 1, "says", "reference", fn)


def test_audit_accepts_a_computation():
    def computed():
        t = _time_a_sum()
        return claims.Measurement(t, "s", "timed", claims.here(), "holds" if t < 3.5 else "wrong")

    assert claims.llmlab_references(computed) == []  # _time_a_sum is this file's, not llmlab's
    assert claims.llmlab_references(lambda: timing.measure(print)) == ["llmlab.timing"]

    def uses_library():
        t = timing.measure(lambda: math.sqrt(2), min_rounds=3).seconds
        return claims.Measurement(t, "s", "timed", claims.here(), "holds" if t < 3.5 else "wrong")

    def imports_library():
        from llmlab.hardware import device_name

        return claims.Measurement(float(len(device_name())), "chars", "a name", "computed", "holds")

    assert claims.audit(_claim(uses_library)) == []
    assert claims.llmlab_references(imports_library) == ["llmlab.hardware"]  # the name `import` loads
    assert claims.audit(_claim(imports_library)) == []


def test_audit_rejects_constants_and_non_library_code():
    def typed_in():
        claims.here()  # llmlab.claims and llmlab.runtime say where, they compute nothing
        return claims.Measurement(3.15e23, "FLOP", "6ND", "computed", "holds")

    problems = claims.audit(_claim(typed_in))
    assert len(problems) == 2
    assert "refers to no llmlab library code" in problems[0]
    assert "the measured value(s) [3.15e+23] are typed in" in problems[1]

    def typed_tuple():
        timing.measure(int, max_rounds=1, min_rounds=1)
        return claims.Measurement((120.0, 31.4), "GB", "ZeRO", "computed", "holds")

    assert claims.audit(_claim(typed_tuple)) == [
        "C1: the measured value(s) [120.0, 31.4] are typed in "
        "test_claims.test_audit_rejects_constants_and_non_library_code.<locals>.typed_tuple's source; "
        "compute them with llmlab code (reference figures belong in the library)"]

    def raises():
        timing.measure(print, min_rounds=0)

    assert "raised ValueError: min_rounds=0 must be an integer >= 1" in claims.audit(_claim(raises))[0]


# --- coverage ----------------------------------------------------------------------------------------------

CHAPTERS = sorted(claims.chapter_notebooks(ROOT / "chapters"))


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda n: f"chapter{n:02d}")
def test_every_claim_of_each_chapter_is_registered_and_computed(chapter):
    """For each chapters/NN_*.ipynb: every claim llmlab/CLAIMS.md puts in chapter NN is registered (by the
    chapter modules llmlab.claims.chNN) and its function computes it with llmlab code. With no chapter yet,
    this is an empty set (reported as one skipped test)."""
    problems = claims.chapter_problems(chapter)
    assert not problems, "\n".join(problems)


def test_coverage_check_fails_for_a_chapter_without_its_claims(tmp_path):
    (tmp_path / "01_compute.ipynb").write_text("{}")
    (tmp_path / "notes.ipynb").write_text("{}")  # not a chapter: no NN_ prefix
    assert claims.chapter_notebooks(tmp_path) == {1: tmp_path / "01_compute.ipynb"}
    problems = claims.coverage_problems(tmp_path, registry=claims.Registry())
    assert [p.split()[0] for p in problems] == ["C1", "C2", "C3", "C4"]
    assert all("is not registered" in p for p in problems)

    reg = claims.Registry()
    for claim_id in ("C1", "C2", "C3"):
        reg.register(claim_id, chapter=1)(lambda: claims.Measurement(
            timing.measure(int, max_rounds=1, min_rounds=1).seconds, "s", "timed", "computed", "holds"))
    problems = claims.coverage_problems(tmp_path, registry=reg)
    assert len(problems) == 1 and problems[0].startswith("C4 (§1.1, chapter 1) is not registered")


def test_table_imports_the_chapter_modules_first(tmp_path, monkeypatch):
    """claims.table(chapter) runs load_all(), so a chapter's table is complete whatever it imported."""
    (tmp_path / "claimsdemo_mod.py").write_text(
        "from llmlab import claims, timing\n\n"
        "@claims.register('C16', chapter=6)\n"
        "def warmup():\n"
        "    t = timing.measure(int, max_rounds=1, min_rounds=1).seconds\n"
        "    return claims.Measurement(t, 's', 'timed', claims.here(), 'holds')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = claims.Registry()
    monkeypatch.setattr(claims, "REGISTRY", reg)
    monkeypatch.setattr(claims, "register", reg.register)
    monkeypatch.setattr(claims, "chapter_modules", lambda: ["claimsdemo_mod"])
    rows = claims.table(6).rows
    assert [(r.id, r.verdict) for r in rows] == [("C16", "holds")]
    assert [p.split()[0] for p in claims.chapter_problems(6)] == ["C17"]  # C16 passes the audit


def test_load_all_finds_one_module_per_chapter_and_each_claim_lives_in_its_chapters():
    assert claims.chapter_modules() == [f"llmlab.claims.ch{n:02d}" for n in range(1, 9)]
    claims.load_all()
    assert claims.REGISTRY.ids() == [r.id for r in claims.load_reference()]  # C1 … C21, every one registered
    for claim_id in claims.REGISTRY.ids():
        claim = claims.REGISTRY.get(claim_id)
        assert claim.measure.__module__ == f"llmlab.claims.ch{claim.chapter:02d}", claim.origin


def test_references_follow_a_chapter_modules_helpers_but_not_the_registry():
    """A claim that calls a helper of its chapter module computes with what the helper calls; the claims
    package's own functions (here(), the registry) compute nothing."""
    found = claims.llmlab_references(ch06.clipping)  # clipping() itself calls only ch06._spike_run
    assert "llmlab.train.clip.clip_grad_norm" in found
    assert not any(name.startswith("llmlab.claims") for name in found)
    assert claims.llmlab_references(lambda: claims.here()) == []
    assert claims.llmlab_references(lambda: claims.Measurement) == []
