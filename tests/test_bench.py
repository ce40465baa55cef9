"""llmlab.bench, the command side: the registry of benches and `run`, which prints a text table and a record."""

import json

import pytest

from llmlab import bench


def test_registry():
    assert bench.names() == sorted(bench.BENCHES) and "vector_add" in bench.names()
    assert all(target.count(":") == 1 and target.startswith("llmlab.") for target in bench.BENCHES.values())
    with pytest.raises(ValueError, match="bench 'nope' unknown; known benches: allreduce, attention, checkpoint, "):
        bench.get("nope")


def test_get_imports_the_module_only_when_asked(monkeypatch):
    monkeypatch.setitem(bench.BENCHES, "toy", "llmlab.tables:format_table")
    from llmlab import tables

    assert bench.get("toy") is tables.format_table


def test_run_prints_a_text_table_and_writes_the_record(monkeypatch, capsys, tmp_path):
    rows = [{"impl": "mine", "peer": "torch", "size": 1024, "impl_ms": 0.5, "peer_ms": 1.0, "ratio": 0.5}]
    monkeypatch.setattr(bench, "get", lambda name: lambda: rows)
    assert bench.run("toy", tmp_path / "out" / "toy.json") == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("bench toy · ")
    assert printed[1:4] == ["impl  peer   size  impl_ms  peer_ms  ratio", "----  -----  ----  -------  -------  -----",
                            "mine  torch  1024      0.5        1    0.5"]  # text, not HTML, in a terminal
    record = json.loads((tmp_path / "out" / "toy.json").read_text())
    assert json.loads(printed[5]) == record and record["results"] == rows and record["sizes"] == [1024]


def test_rows_show_their_spread_and_load():
    timed = [{"impl": "mine", "peer": "torch", "size": 8, "impl_ms": 0.5, "peer_ms": 1.0, "ratio": 0.5,
              "spread": 0.043, "load": "load 3.1 on 2 cores"}, {"impl": "fit", "peer": "model", "ratio": 1.2}]
    assert bench.shown(timed)[0]["spread"] == "±4%" and bench.shown(timed)[1] == timed[1]
    assert list(bench.shown(timed)[0]) == list(timed[0])  # the columns keep their order
    rec = bench.record("toy", timed)
    table = bench.markdown_table(rec)
    assert "| mine | torch | 8 | 0.5 | 1 | 0.5 | ±4% | load 3.1 on 2 cores |" in table
    assert "recorded before" not in table
    untimed = {k: v for k, v in timed[0].items() if k not in ("spread", "load")}
    old = bench.markdown_table(bench.record("toy", [untimed]))
    assert old.endswith("(recorded before bench rows carried their spread and load: run the bench again with "
                        "`--json` to record them)")
