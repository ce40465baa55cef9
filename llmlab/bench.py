"""`llmlab bench NAME`: an implementation and its peer run side by side; a table of ratios and a JSON record.

A bench is a function `bench(sizes=None) -> list[dict]` that lives next to the code it measures (the
`vector_add` bench is in `kernels/vector_add.py`, installed as `llmlab.kernels.vector_add`). Each dict is one row
of the table: what was run (`impl`, `peer`), the problem size, the measurements, and a `ratio` = impl / peer (for
times, below 1 means the implementation beats its peer). A bench times with `llmlab.timing`; this module holds
the command side: the registry of benches by name, the run that prints the table and the record, and the README's
results section made from the records:

    llmlab bench vector_add --json runs/vector_add.json

The JSON record (device, versions, tier, sizes, results) is what the README's results tables are made from. A
timed row carries its ratio's `spread` (half the interquartile range of the per-round ratios over their median)
and the machine's `load` while it was measured (`timing.Comparison.row()`); tables show the spread as `±8%`.
"""

from __future__ import annotations

import importlib
import json
import platform
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from llmlab import hardware, runtime
from llmlab.tables import format_table

__all__ = ["BENCHES", "names", "get", "record", "run", "shown", "markdown_table", "results_section", "sync_readme"]

# name -> "module:function". A new bench adds one line here; its module is imported only when it runs.
BENCHES: dict[str, str] = {
    "vector_add": "llmlab.kernels.vector_add:bench",
    "gemm": "llmlab.kernels.gemm:bench",
    "attention": "llmlab.kernels.attention:bench",
    "grouped_gemm": "llmlab.kernels.grouped_gemm:bench",
    "quant": "llmlab.quant:bench",
    "fp8": "llmlab.fp8:bench",
    "precision": "llmlab.precision:bench",
    "checkpoint": "llmlab.memory.checkpoint:bench",
    "compress": "llmlab.memory.compress:bench",
    "zero": "llmlab.memory.zero:bench",
    "moe": "llmlab.moe:bench",
    "allreduce": "llmlab.dist.allreduce_bench:bench",
}


def names() -> list[str]:
    return sorted(BENCHES)


def get(name: str):
    """The bench function registered as `name` (its module is imported now)."""
    if name not in BENCHES:
        raise ValueError(f"bench {name!r} unknown; known benches: {', '.join(names())}")
    module, _, function = BENCHES[name].partition(":")
    return getattr(importlib.import_module(module), function)


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def record(name: str, rows: list[dict]) -> dict:
    """The JSON record of one bench run: where it ran, with what, on which sizes, and its rows."""
    return {
        "bench": name,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": hardware.device_name(runtime.device()),
        "tier": runtime.tier().name,
        "triton": "interpreted" if runtime.configure_triton() else "compiled",
        "versions": {"python": platform.python_version(), "torch": _version("torch"),
                     "triton": _version("triton"), "llmlab": _version("llmlab")},
        "sizes": sorted({row["size"] for row in rows if "size" in row}),
        "results": rows,
    }


def run(name: str, json_path: str | Path | None = None) -> int:
    """Run the bench `name`; print its table and its JSON record (one line), also written to `json_path`."""
    bench = get(name)
    rows = bench()
    rec = record(name, rows)
    print(f"bench {name} · {rec['device']} · {rec['tier']} tier · Triton {rec['triton']}")
    print(format_table(shown(rows)))
    print("ratio = impl / peer (for times: below 1, the implementation is faster than its peer); spread: ± of the "
          "ratio over its rounds; load: the machine's load average while measured")
    print(json.dumps(rec))
    if json_path is not None:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rec, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


# --- the README's results tables, made from committed records -------------------------------------------------

RESULTS_BEGIN, RESULTS_END = "<!-- results:begin (llmlab results) -->", "<!-- results:end -->"
_UNTIMED_NOTE = ("(recorded before bench rows carried their spread and load: run the bench again with `--json` to "
                 "record them)")


def shown(rows: list[dict]) -> list[dict]:
    """Rows as a table shows them: a number `spread` (a fraction) as ±N%; every other value as it is."""
    return [{**row, "spread": f"±{row['spread']:.0%}"} if isinstance(row.get("spread"), (int, float)) else row
            for row in rows]


def markdown_table(rec: dict) -> str:
    """One bench record as a README section: where and with what it ran, then its rows (spread as ±N%, load); a
    record of timed rows from before rows carried their spread says so under its table."""
    rows = rec["results"]
    dated = any("impl_ms" in row for row in rows) and not any("spread" in row for row in rows)
    return (f"**{rec['bench']}** — {rec['device']} ({rec['tier']} tier, Triton {rec['triton']}, "
            f"torch {rec['versions']['torch']}), {rec['created']}\n\n" + format_table(shown(rows)).markdown
            + (f"\n\n{_UNTIMED_NOTE}" if dated else ""))


def results_section(records_dir: str | Path) -> str:
    """Every record in `records_dir` (*.json, by name) as markdown, between the README's markers."""
    records = [json.loads(p.read_text()) for p in sorted(Path(records_dir).glob("*.json"))]
    body = "\n\n".join(markdown_table(r) for r in records) or "(no recorded runs yet)"
    return f"{RESULTS_BEGIN}\n{body}\n{RESULTS_END}"


def sync_readme(readme: str | Path, records_dir: str | Path, check: bool = False) -> bool:
    """Rewrite the README's results section from the records; with `check`, only say whether it is current."""
    path = Path(readme)
    text = path.read_text()
    if RESULTS_BEGIN not in text or RESULTS_END not in text:
        raise ValueError(f"{path} has no results section (the lines {RESULTS_BEGIN!r} … {RESULTS_END!r})")
    head, rest = text.split(RESULTS_BEGIN, 1)
    new = head + results_section(records_dir) + rest.split(RESULTS_END, 1)[1]
    if check:
        return new == text
    path.write_text(new)
    return True
