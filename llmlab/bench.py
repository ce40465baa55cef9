"""`llmlab bench NAME`: an implementation and its peer run side by side; a table of ratios and a JSON record.

A bench is a function `bench(sizes=None) -> list[dict]` that lives next to the code it measures (the
`vector_add` bench is in `llmlab/kernels/vector_add.py`). Each dict is one row of the table: what was run
(`impl`, `peer`), the problem size, the measurements, and a `ratio` = impl / peer (for times, below 1 means
the implementation beats its peer). This module holds the registry of benches by name, the timer every bench
shares, and the printing:

    llmlab bench vector_add --json runs/vector_add.json

The JSON record (device, versions, tier, sizes, results) is what the README's results tables are made from.
"""

from __future__ import annotations

import importlib
import json
import platform
import re
import statistics
import textwrap
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

__all__ = ["BENCHES", "names", "get", "synchronize", "median_seconds", "compare", "record", "format_table", "run"]

# name -> "module:function". A new bench adds one line here; its module is imported only when it runs.
BENCHES: dict[str, str] = {
    "vector_add": "llmlab.kernels.vector_add:bench",
    "gemm": "llmlab.kernels.gemm:bench",
    "quant": "llmlab.quant:bench",
    "precision": "llmlab.precision:bench",
    "checkpoint": "llmlab.memory.checkpoint:bench",
    "compress": "llmlab.memory.compress:bench",
    "zero": "llmlab.memory.zero:bench",
    "moe": "llmlab.moe:bench",
    "allreduce": "llmlab.dist.bench:bench",
}


def names() -> list[str]:
    return sorted(BENCHES)


def get(name: str):
    """The bench function registered as `name` (its module is imported now)."""
    if name not in BENCHES:
        raise ValueError(f"bench {name!r} unknown; known benches: {', '.join(names())}")
    module, _, function = BENCHES[name].partition(":")
    return getattr(importlib.import_module(module), function)


def synchronize(device) -> None:
    """Wait for `device`'s queued work (CUDA kernels run asynchronously); nothing to wait for on the CPU."""
    import torch

    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, *, device=None, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of `fn()` over `repeats` runs, after `warmup` untimed runs.

    GPU work is asynchronous: on a CUDA `device` the clock is read only after `torch.cuda.synchronize`, so
    the time is the kernel's, not the launch's. The median ignores the odd run slowed by the OS.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    if warmup < 0:
        raise ValueError(f"warmup={warmup} must be >= 0")
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compare(impl, peer, *, device=None, repeats: int = 5) -> dict:
    """Time `impl()` and `peer()` alternately (so a slow spell of the machine hits both) and compare medians.

    Returns {"impl_ms", "peer_ms", "ratio"} with ratio = impl time / peer time.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    impl()  # warm-up: first-call compilation, allocator growth
    peer()
    impl_s, peer_s = [], []
    for _ in range(repeats):
        impl_s.append(median_seconds(impl, device=device, repeats=1, warmup=0))
        peer_s.append(median_seconds(peer, device=device, repeats=1, warmup=0))
    i, p = statistics.median(impl_s), statistics.median(peer_s)
    return {"impl_ms": i * 1e3, "peer_ms": p * 1e3, "ratio": i / p}


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def record(name: str, rows: list[dict]) -> dict:
    """The JSON record of one bench run: where it ran, with what, on which sizes, and its rows."""
    from llmlab import hardware, runtime

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


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.3e}"
    return str(value)


_NUMBER = re.compile(r"[-+−]?[\d.]")


def format_table(rows: list[dict], width: int = 110) -> str:
    """A plain-text table of `rows`; columns are the rows' keys, in order of first appearance.

    Wider than `width` characters, the longest headers wrap onto more lines (at spaces, never inside a value or
    a word), shortest-loss first, until the table fits or no header can wrap further: a notebook's output or a
    page shows it unbroken instead of folding every row.
    """
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width={width!r} must be a positive int (characters)")
    if not rows:
        return "(no results)"
    columns = list(dict.fromkeys(key for row in rows for key in row))
    cells = [[_cell(row.get(c, "")) for c in columns] for row in rows]
    values = [max((len(r[i]) for r in cells), default=0) for i in range(len(columns))]
    widths = [max(len(c), v) for c, v in zip(columns, values, strict=True)]
    narrowest = [max(v, *(len(word) for word in c.split())) if c.split() else v
                 for c, v in zip(columns, values, strict=True)]
    for i in sorted(range(len(columns)), key=lambda i: narrowest[i] - widths[i]):  # most to gain first
        excess = sum(widths) + 2 * (len(widths) - 1) - width
        if excess <= 0:
            break
        widths[i] = max(narrowest[i], widths[i] - excess)
    headers = [textwrap.wrap(c, w, break_long_words=False) or [""] for c, w in zip(columns, widths, strict=True)]
    depth = max(map(len, headers))
    headers = [[""] * (depth - len(h)) + h for h in headers]  # bottom-aligned, next to the rule
    right = [all(r[i] in ("", "—") or _NUMBER.match(r[i]) for r in cells) for i in range(len(columns))]
    line = lambda values: "  ".join(v.rjust(w) if r else v.ljust(w)
                                    for v, w, r in zip(values, widths, right, strict=True)).rstrip()
    return "\n".join([*(line([h[k] for h in headers]) for k in range(depth)), line(["-" * w for w in widths]),
                      *map(line, cells)])


def run(name: str, json_path: str | Path | None = None) -> int:
    """Run the bench `name`; print its table and its JSON record (one line), also written to `json_path`."""
    bench = get(name)
    rows = bench()
    rec = record(name, rows)
    print(f"bench {name} · {rec['device']} · {rec['tier']} tier · Triton {rec['triton']}")
    print(format_table(rows))
    print("ratio = impl / peer (for times: below 1, the implementation is faster than its peer)")
    print(json.dumps(rec))
    if json_path is not None:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rec, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


# --- the README's results tables, made from committed records -------------------------------------------------

RESULTS_BEGIN, RESULTS_END = "<!-- results:begin (llmlab results) -->", "<!-- results:end -->"


def markdown_table(rec: dict) -> str:
    """One bench record as a README section: where and with what it ran, then its rows."""
    rows = rec["results"]
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = [f"**{rec['bench']}** — {rec['device']} ({rec['tier']} tier, Triton {rec['triton']}, "
             f"torch {rec['versions']['torch']}), {rec['created']}", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


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
