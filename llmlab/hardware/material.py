"""The course text's GPU table (§5.1), checked cell by cell against the sourced spec sheet.

    | 型号 | FP32 TFLOPS | 显存容量 | 显存带宽 | 互联带宽 |
    | A100 | 19.5 | 80GB  | 2039GB/s | 600GB/s |
    | H100 | 51   | 80GB  | 3350GB/s | 900GB/s |
    | MI250| 45.3 | 128GB | 3277GB/s | 800GB/s |

`check_table()` compares each cell with the spec-sheet rows the model name could mean and says what is
right, wrong or misleading about it; the chapter shows the result next to the spec sheet, and claim C14
(`llmlab.claims.ch05`) counts its verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmlab.hardware.specs import SPECS

__all__ = ["MATERIAL_TABLE", "COLUMNS", "Cell", "check_table"]

COLUMNS = {"fp32_tflops": "FP32 TFLOPS", "memory_gb": "memory GB", "hbm_gbs": "bandwidth GB/s",
           "link_gbs": "interconnect GB/s"}
MATERIAL_TABLE = {
    "A100": {"fp32_tflops": 19.5, "memory_gb": 80, "hbm_gbs": 2039, "link_gbs": 600},
    "H100": {"fp32_tflops": 51, "memory_gb": 80, "hbm_gbs": 3350, "link_gbs": 900},
    "MI250": {"fp32_tflops": 45.3, "memory_gb": 128, "hbm_gbs": 3277, "link_gbs": 800},
}
# the spec-sheet rows each of the material's model names can stand for
CANDIDATES = {"A100": ("A100 SXM",), "H100": ("H100 SXM", "H100 PCIe"), "MI250": ("MI250", "MI250X")}


@dataclass(frozen=True)
class Cell:
    gpu: str
    column: str
    material: float
    matches: tuple[str, ...]  # the spec-sheet rows whose figure equals the material's
    verdict: str  # "right", "misleading" or "wrong"
    note: str


def _note(gpu: str, column: str, matches: tuple[str, ...], rows: dict) -> tuple[str, str]:
    if not matches:
        options = ", ".join(f"{name} {getattr(s, column):g}" for name, s in rows.items())
        return "wrong", f"no card of that name has it ({options})"
    spec = SPECS[matches[0]]
    if column == "fp32_tflops":
        return "misleading", (f"right for the {' / '.join(matches)}, but training runs on tensor cores: bf16 dense "
                              f"is {spec.bf16_tflops:g} TFLOP/s ({spec.bf16_tflops / spec.fp32_tflops:.0f}×)")
    if column == "link_gbs":
        return "misleading", (f"the {' / '.join(matches)}'s total of both directions over all links: "
                              f"{spec.link_gbs_per_direction:g} GB/s each way")
    if spec.dies > 1:
        return "misleading", f"summed over the package's {spec.dies} dies, which software sees as {spec.dies} GPUs"
    return "right", f"the {' / '.join(matches)}"


def check_table() -> list[Cell]:
    """Every cell of the material's table, matched against the spec sheet, with a verdict and why."""
    cells = []
    for gpu, row in MATERIAL_TABLE.items():
        rows = {name: SPECS[name] for name in CANDIDATES[gpu]}
        for column, value in row.items():
            matches = tuple(name for name, s in rows.items() if abs(getattr(s, column) - value) < 0.5)
            verdict, note = _note(gpu, column, matches, rows)
            cells.append(Cell(gpu, COLUMNS[column], value, matches, verdict, note))
    for g in MATERIAL_TABLE:  # a row quoting two different cards: flag each cell that is only one card's figure
        row = [c for c in cells if c.gpu == g]
        cards = {m for c in row for m in c.matches}
        if len(cards) < 2:
            continue
        for i, c in enumerate(cells):
            if c.gpu != g or c.verdict == "wrong" or set(c.matches) >= cards:  # a figure every candidate shares
                continue
            others = {}  # the other card → the row's columns that are its figures, not this cell's card's
            for o in row:
                if set(o.matches) & set(c.matches):  # a figure this cell's card shares
                    continue
                for card in o.matches:
                    others.setdefault(card, []).append(o.column)
            mix = "; ".join(f"the row's {', '.join(columns)} {'is' if len(columns) == 1 else 'are'} the {card}'s"
                            for card, columns in sorted(others.items()))
            cells[i] = Cell(c.gpu, c.column, c.material, c.matches, "misleading",
                            f"{c.note}; one row, two cards: {mix}")
    return cells
