"""The course text's GPU table checked against the spec sheet: which cells are right and why the rest are not."""

from llmlab.hardware import material


def _cell(gpu, column):
    return next(c for c in material.check_table() if c.gpu == gpu and c.column == column)


def test_every_cell_is_judged():
    cells = material.check_table()
    assert len(cells) == 12 and {c.verdict for c in cells} <= {"right", "misleading", "wrong"}


def test_known_problems_are_flagged():
    assert _cell("A100", "memory GB").verdict == "right"
    assert "bf16 dense is 312" in _cell("A100", "FP32 TFLOPS").note  # right number, wrong column to choose by
    assert _cell("H100", "FP32 TFLOPS").matches == ("H100 PCIe",)  # 51 is the PCIe card's
    assert _cell("H100", "bandwidth GB/s").matches == ("H100 SXM",)  # 3350 is the SXM's: the row mixes two cards
    assert "450 GB/s each way" in _cell("H100", "interconnect GB/s").note  # a bidirectional total
    assert "2 dies" in _cell("MI250", "memory GB").note
    assert _cell("MI250", "interconnect GB/s").matches == ("MI250X",)  # 800 GB/s is the MI250X's 8 links


def test_a_mixed_row_says_which_figures_are_whose():
    """The H100 row quotes the PCIe card's FP32 and the SXM module's bandwidth and NVLink: each of those cells names
    the other card's columns; 80 GB, both cards' capacity, is right and mixes nothing."""
    memory = _cell("H100", "memory GB")
    assert memory.verdict == "right" and memory.matches == ("H100 SXM", "H100 PCIe")
    assert _cell("H100", "FP32 TFLOPS").note.endswith(
        "one row, two cards: the row's bandwidth GB/s, interconnect GB/s are the H100 SXM's")
    assert _cell("H100", "bandwidth GB/s").note.endswith("the row's FP32 TFLOPS is the H100 PCIe's")
    assert _cell("MI250", "FP32 TFLOPS").note.endswith("the row's interconnect GB/s is the MI250X's")


def test_a_wrong_number_is_called_wrong(monkeypatch):
    monkeypatch.setitem(material.MATERIAL_TABLE, "A100", {**material.MATERIAL_TABLE["A100"], "hbm_gbs": 3000})
    cell = _cell("A100", "bandwidth GB/s")
    assert cell.verdict == "wrong" and "A100 SXM 2039" in cell.note
