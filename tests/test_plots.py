"""llmlab.plots: each helper draws its data onto a matplotlib Agg figure (a bar per item, the labels and titles it
promises) and refuses arguments it cannot draw, naming them."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from matplotlib.text import Annotation  # noqa: E402

from llmlab import plots  # noqa: E402
from llmlab.parallel import pipeline  # noqa: E402
from llmlab.timeline import Span, Timeline  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def _axes():
    return plt.subplots()[1]


def _texts(ax):  # the written labels, not the arrows (annotations without text)
    return [t.get_text() for t in ax.texts if not isinstance(t, Annotation)]


# --- plot_timeline ------------------------------------------------------------------------------------------------


def test_timeline_draws_a_numbered_bar_per_span():
    t = pipeline.simulate("1f1b", 3, 4)
    ax = plots.plot_timeline(t)
    assert len(ax.patches) == len(t.spans) == 24
    assert [label.get_text() for label in ax.get_yticklabels()] == ["stage 0", "stage 1", "stage 2"]
    assert sorted(_texts(ax)) == sorted(str(s.item) for s in t.spans)  # every span is wide enough here
    assert ax.get_title() == f"idle {t.idle:.0%}" and ax.get_xlabel() == "time"
    forward = next(p for p in ax.patches if p.get_width() == 1.0)  # forwards take 1, backwards 2
    assert forward.get_facecolor() == to_rgba("C0")
    assert ax.get_legend() is None


def test_timeline_scale_split_kinds_and_legend():
    t = Timeline((Span(0, "compute", 0, 0.5, 1.5), Span(0, "comm", 0, 1.5, 2.0), Span(1, "compute", 0, 0.5, 1.0)),
                 "rank")
    ax = plots.plot_timeline(t, _axes(), title="async", xlabel="ms", scale=1e3, split_kinds=True, legend=True)
    compute, comm = ax.patches[0], ax.patches[2]
    assert (compute.get_x(), compute.get_width()) == (0.0, 1e3)  # from the first start, in ms
    assert comm.get_y() > compute.get_y()  # its own band, below compute's
    assert [x.get_text() for x in ax.get_legend().get_texts()] == ["compute", "comm"]
    assert (ax.get_title(), ax.get_xlabel()) == ("async", "ms")


def test_timeline_leaves_narrow_spans_unnumbered():
    spans = (Span(0, "F", 0, 0.0, 100.0), Span(0, "F", 1, 100.0, 100.5))
    ax = plots.plot_timeline(Timeline(spans))
    assert len(ax.patches) == 2 and _texts(ax) == ["0"]


def test_timeline_refuses_what_it_cannot_draw():
    with pytest.raises(ValueError, match="timeline must be an llmlab.timeline.Timeline, got list"):
        plots.plot_timeline([Span(0, "F", 0, 0.0, 1.0)])
    with pytest.raises(ValueError, match="scale=0"):
        plots.plot_timeline(pipeline.simulate("gpipe", 2, 2), scale=0)


# --- stacked_bars -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("horizontal", [False, True])
def test_stacked_bars_stack_each_part_on_the_last(horizontal):
    ax = _axes()
    bars = plots.stacked_bars(ax, ["a", "b"], {"x": [1.0, 2.0], "y": [3.0, 4.0]}, horizontal=horizontal,
                              colors=["C3", "C4"])
    assert list(bars) == ["x", "y"] and len(ax.patches) == 4
    top = bars["y"][1]
    start, length = (top.get_x(), top.get_width()) if horizontal else (top.get_y(), top.get_height())
    assert (start, length) == (2.0, 4.0)  # "y" of "b" starts where its "x" ends
    assert top.get_facecolor() == to_rgba("C4")
    assert [x.get_text() for x in ax.legend().get_texts()] == ["x", "y"]


def test_stacked_bars_refuse_mismatched_data():
    with pytest.raises(ValueError, match=r"parts\['x'\] has 1 values for 2 labels"):
        plots.stacked_bars(_axes(), ["a", "b"], {"x": [1.0]})
    with pytest.raises(ValueError, match="parts must name at least one part"):
        plots.stacked_bars(_axes(), ["a"], {})
    with pytest.raises(ValueError, match="colors has 1 colours for 2 parts"):
        plots.stacked_bars(_axes(), ["a"], {"x": [1], "y": [2]}, colors=["C0"])


# --- diagrams -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [1, 3, 4])
def test_data_parallel_diagram_has_two_boxes_per_rank(ranks):
    ax = plots.data_parallel_diagram(ranks)
    assert len(ax.patches) == 2 * ranks + 1  # a batch slice and a model per rank, one all-reduce under them
    assert any(f"/ {ranks}" in text and f"∇L{ranks - 1}" in text for text in _texts(ax))
    assert ax.get_title() == "data parallelism: split the batch, average the gradients"
    with pytest.raises(ValueError, match="ranks=0"):
        plots.data_parallel_diagram(0)


@pytest.mark.parametrize("by,label", [("out", "A_2: rank 2"), ("in", "A_2\nrank 2")])
def test_weight_split_has_a_shard_per_rank(by, label):
    ax = plots.weight_split(_axes(), 4, by, "title")
    assert len(ax.patches) == 4 + 1  # the shards and the weight's outline
    shards = ax.patches[:4]
    if by == "out":
        assert {s.get_width() for s in shards} == {2.0} and {s.get_height() for s in shards} == {1.0}
    else:
        assert {s.get_width() for s in shards} == {0.5} and {s.get_height() for s in shards} == {4.0}
    assert label in _texts(ax) and ax.get_title() == "title"
    with pytest.raises(ValueError, match="by='diagonal'"):
        plots.weight_split(_axes(), 4, "diagonal")


def test_flow_chart_boxes_top_down_with_the_highlighted_shaded():
    steps = [("x", False), ("all-reduce", True), ("y", False)]
    ax = plots.flow_chart(_axes(), steps, "flow")
    assert len(ax.patches) == 3 and _texts(ax) == ["x", "all-reduce", "y"]
    assert [p.get_y() for p in ax.patches] == pytest.approx([1.7, 0.7, -0.3])  # the first on top
    assert ax.patches[1].get_facecolor() == to_rgba("C3", 0.3)
    assert len([a for a in ax.texts if isinstance(a, Annotation)]) == 2  # arrows between boxes
    with pytest.raises(ValueError, match="steps must hold at least one"):
        plots.flow_chart(_axes(), [])


def test_sharded_state_divides_the_sharded_parts_by_the_ranks():
    per = {"params": 2, "grads": 2, "optimizer_state": 12}
    sharded = {"DP": set(), "ZeRO-1": {"optimizer_state"}, "ZeRO-3": set(per)}
    ax = plots.sharded_state(per, sharded, 4, totals={"DP": 16, "ZeRO-1": 7, "ZeRO-3": 4},
                             labels={"params": "parameters"}, title="ZeRO")
    assert len(ax.patches) == 3 * 4 * (3 + 1)  # rows × ranks × (a bar per part, a dotted box)
    widths = [p.get_width() for p in ax.patches if isinstance(p, Rectangle) and p.get_fill()]
    assert widths[:3] == [2, 2, 12] and widths[12 + 2] == 3 and widths[24:27] == [0.5, 0.5, 3]
    assert {"16Ψ per GPU", "7Ψ per GPU", "4Ψ per GPU", "DP", "ZeRO-3", "GPU 3"} <= set(_texts(ax))
    assert "3" in _texts(ax)  # rank 3 owns the last optimizer shard
    assert [x.get_text() for x in ax.get_legend().get_texts()] == ["parameters", "grads", "optimizer_state"]
    with pytest.raises(ValueError, match=r"sharded\['ZeRO-1'\] names \['adam'\]"):
        plots.sharded_state(per, {"ZeRO-1": {"adam"}}, 4)
    with pytest.raises(ValueError, match="ranks=9"):
        plots.sharded_state(per, sharded, 9)


# --- figures of measurements --------------------------------------------------------------------------------------


def test_tile_orders_draws_each_order_and_the_panels():
    orders = {"row-major": [divmod(pid, 4) for pid in range(8)],
              "column-major": [(pid % 2, pid // 2) for pid in range(8)]}
    panels = {"row-major": {2: 3.0, 4: 5.0}, "column-major": {2: 3.0, 4: 4.0}}
    fig = plots.tile_orders(orders, 4, panels)
    *grids, lines = fig.axes
    assert len(grids) == 2 and [ax.get_title() for ax in grids] == list(orders)
    for ax, order in zip(grids, orders.values(), strict=True):
        image = ax.images[0].get_array()
        assert image.shape == (2, 4) and int(np.sum(image)) == 4  # the first wave of 4 shaded
        assert sorted(int(t) for t in _texts(ax)) == list(range(len(order)))
    assert [list(line.get_ydata()) for line in lines.lines] == [[3.0, 5.0], [3.0, 4.0]]
    assert "first wave of 4 programs" in fig._suptitle.get_text()
    with pytest.raises(ValueError, match="panels must have the orders' names"):
        plots.tile_orders(orders, 4, {"row-major": {2: 3.0}})
    with pytest.raises(ValueError, match="wave=0"):
        plots.tile_orders(orders, 0, panels)


def test_allreduce_sweep_draws_measurements_model_and_crossovers():
    sizes = [1e3, 1e4, 1e5]
    seconds = {"ring": [1e-4, 2e-4, 1e-3], "tree": [5e-5, 2e-4, 2e-3]}
    fig = plots.allreduce_sweep(sizes, seconds, {impl: [s / t for s, t in zip(sizes, v, strict=True)]
                                                 for impl, v in seconds.items()},
                                model={"ring": [1e-4, 1e-3]}, model_sizes=[1e3, 1e5],
                                crossovers={"predicted": 2e4, "measured": None}, title="4 ranks")
    time_ax, bw_ax = fig.axes
    assert [line.get_label() for line in time_ax.get_lines()] == ["ring, measured", "tree, measured",
                                                                 "ring, α-β fit", "predicted"]
    assert time_ax.get_lines()[2].get_color() == time_ax.get_lines()[0].get_color()  # the model in ring's colour
    assert len(bw_ax.get_lines()) == 2 and bw_ax.get_lines()[0].get_ydata()[0] == pytest.approx(1e3 / 1e-4 / 1e9)
    assert time_ax.get_title() == "4 ranks: time" and time_ax.get_xscale() == "log"
    with pytest.raises(ValueError, match="tree has 2 values for 3 sizes"):
        plots.allreduce_sweep(sizes, {"tree": [1, 2]}, {})
    with pytest.raises(ValueError, match=r"model\['torch'\] is not an implementation"):
        plots.allreduce_sweep(sizes, seconds, {}, model={"torch": [1.0]}, model_sizes=[1e3])
    with pytest.raises(ValueError, match=r"model\['ring'\] has 1 values for 2 model_sizes"):
        plots.allreduce_sweep(sizes, seconds, {}, model={"ring": [1.0]}, model_sizes=[1e3, 1e4])
