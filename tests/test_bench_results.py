"""README's results tables are made from the committed bench records, never typed in."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmlab import bench

ROOT = Path(__file__).resolve().parents[1]


def test_readme_tables_match_the_records():
    assert bench.sync_readme(ROOT / "README.md", ROOT / "results", check=True), \
        "README's results tables differ from results/*.json: run `llmlab results`"


def test_records_are_real_bench_records():
    for path in sorted((ROOT / "results").glob("*.json")):
        rec = json.loads(path.read_text())
        assert rec["bench"] in bench.BENCHES, path
        assert {"device", "tier", "triton", "versions", "created", "results"} <= set(rec), path
        assert rec["results"] and all("impl" in row and "peer" in row for row in rec["results"]), path


def test_sync_and_check(tmp_path):
    rec = bench.record("gemm", [{"impl": "a", "peer": "b", "size": 4, "ratio": 0.5}])
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "gemm.json").write_text(json.dumps(rec))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{bench.RESULTS_BEGIN}\nold\n{bench.RESULTS_END}\nend\n")
    records = str(tmp_path / "results")
    cli = [sys.executable, "-m", "llmlab.cli", "results", "--readme", str(readme), "--records", records]
    assert subprocess.run([*cli, "--check"], capture_output=True).returncode == 1
    assert subprocess.run(cli, capture_output=True).returncode == 0
    assert subprocess.run([*cli, "--check"], capture_output=True).returncode == 0
    text = readme.read_text()
    assert "| impl | peer | size | ratio |" in text and "| a | b | 4 | 0.5 |" in text and text.endswith("end\n")
    readme.write_text("no markers")
    with pytest.raises(ValueError, match="has no results section"):
        bench.sync_readme(readme, tmp_path / "results")
