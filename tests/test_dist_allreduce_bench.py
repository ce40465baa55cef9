"""llmlab.dist.allreduce_bench, llmlab.dist.trace (the ring step by step, traffic per rank) and the all-reduce
cost widget's pure functions. Shapes and arithmetic only: nothing here asserts a speed (README,
"Tests": speed is measured by `llmlab bench`)."""

import json
import math

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from llmlab import bench as benches  # noqa: E402
from llmlab import plots, timing, widgets  # noqa: E402
from llmlab.dist import allreduce_bench, cost, trace  # noqa: E402

SIZES = [1024, 16384]  # two small sizes: enough to fit α and β


@pytest.fixture(scope="module")
def cluster(clusters):
    return clusters(3)


@pytest.fixture(scope="module")
def run():
    return allreduce_bench.measure(SIZES, world_size=2, repeats=2, span_s=0.002)


def test_a_tiny_run_gives_well_formed_rows_and_a_record(run):
    assert (run.world_size, run.backend, run.sizes, run.repeats) == (2, "gloo", tuple(SIZES), 2)
    assert set(run.seconds) == set(allreduce_bench.IMPLS)
    assert all(len(t) == 2 and min(t) > 0 for t in run.seconds.values())
    assert all(len(t.samples) == 2 and t.calls >= 1 and t.load is not None for ts in run.timings.values() for t in ts)
    rows = run.rows()
    timed = [r for r in rows if "size" in r]
    assert [(r["impl"], r["size"]) for r in timed] == [("ring", 1024), ("tree", 1024), ("ring", 16384),
                                                        ("tree", 16384)]
    for r in timed:
        assert r["peer"] == "torch"
        i = SIZES.index(r["size"])
        assert r["ratio"] == pytest.approx(run.comparison(r["impl"], "torch", i).ratio)  # median per-repeat ratio
        assert r["impl_ms"] == pytest.approx(run.timings[r["impl"]][i].ms) and r["impl_spread"] >= 0
        # nccl-tests' busbw: algbw · 2(n−1)/n, which is algbw itself on 2 ranks
        assert r["impl_busbw_GBs"] == pytest.approx(r["size"] / (r["impl_ms"] / 1e3) / 1e9)
    fits = [r for r in rows if r.get("peer") == "α-β fit"]
    assert [r["impl"] for r in fits] == ["ring", "tree", "torch", "ring+tree (one link)"]
    assert all(r["alpha_us"] >= 0 and r["inv_beta_GBs"] > 0 and r["fit_rms"] >= 0 for r in fits)
    (cross,) = [r for r in rows if r["impl"].startswith("ring/tree crossover")]
    assert cross["crossover_B"] is None or cross["crossover_B"] > 0
    # 2 ranks: the ring has no more latency steps than the tree, so the model never prefers the tree
    assert cross["peer_crossover_B"] == run.predicted_crossover() == 0.0
    record = benches.record("allreduce", rows)
    assert record["sizes"] == SIZES and record["results"] == rows
    json.dumps(record)  # JSON-ready
    assert benches.get("allreduce") is allreduce_bench.bench
    assert allreduce_bench.recent(2) is run


def constructed(n, sizes, seconds, noise=(1.0,)):
    """An AllReduceRun from exact times: each repeat k is every time × noise[k]."""
    timings = {impl: tuple(timing.Timing.from_samples([t * f for f in noise]) for t in ts)
               for impl, ts in seconds.items()}
    return allreduce_bench.AllReduceRun(n, "gloo", tuple(sizes), timings)


def model_times(n, sizes, alpha, beta):
    seconds = {"ring": tuple(cost.ring_allreduce_time(s, n, alpha, beta) for s in sizes),
               "tree": tuple(cost.tree_allreduce_time(s, n, alpha, beta) for s in sizes)}
    return seconds | {"torch": seconds["ring"]}


def test_fits_and_crossover_follow_the_model():
    n, alpha, beta = 4, 2e-4, 1 / 5e8
    sizes = tuple(1024 * 4**k for k in range(8))
    seconds = model_times(n, sizes, alpha, beta)
    model = constructed(n, sizes, seconds)
    link = model.link_fit()
    assert (link.alpha, link.beta) == (pytest.approx(alpha), pytest.approx(beta)) and link.residual < 1e-9
    assert all(abs(r) < 1e-9 for rs in model.residuals().values() for r in rs)
    assert model.fit("tree").alpha == pytest.approx(alpha)
    predicted = cost.crossover_bytes(n, alpha, beta)  # 4α/β = 400 kB
    assert model.predicted_crossover() == pytest.approx(predicted)
    # read off the measured curves by linear interpolation of log(ring/tree) in log(size) between 256 KiB and
    # 1 MiB: the gap is not linear there, so it lands within 10% of the exact crossing, not on it
    assert model.crossover() == pytest.approx(predicted, rel=0.1)
    assert (model.faster(0), model.faster(-1)) == ("tree", "ring")
    assert model.link().alpha == pytest.approx(alpha)
    assert list(model.measured()) == [f"{impl} (measured, 4 ranks)" for impl in allreduce_bench.IMPLS]
    slower_tree = {**seconds, "tree": tuple(2 * t for t in seconds["ring"])}
    faster_ring = constructed(n, sizes, slower_tree)
    assert faster_ring.crossover() is None and faster_ring.crossover_range() == (0.0, 0.0)


def test_repeats_give_the_crossovers_their_ranges_and_the_sentence_follows_them():
    n, alpha, beta = 4, 2e-4, 1 / 5e8
    sizes = tuple(1024 * 4**k for k in range(8))
    # every repeat scaled alike: the ratios and the fits are the model's in each repeat, the ranges a point
    same = constructed(n, sizes, model_times(n, sizes, alpha, beta), noise=(1.0, 1.3, 0.8, 1.1, 0.9))
    assert same.repeats == 5 and same.faster(0) == "tree" and same.faster(-1) == "ring"
    lo, hi = same.predicted_range()
    assert lo == pytest.approx(hi) == pytest.approx(cost.crossover_bytes(n, alpha, beta))
    m_lo, m_hi = same.crossover_range()
    assert m_lo == pytest.approx(m_hi) == pytest.approx(same.crossover())
    assert "lower than measured" in same.crossover_says()  # interpolation lands above the exact crossing
    # the ring measured slower at the large sizes than the model says: the measured crossover moves up, far
    seconds = model_times(n, sizes, alpha, beta)
    ring = [t * (3 if s >= 1 << 20 else 1) for s, t in zip(sizes, seconds["ring"], strict=True)]
    slow = {**seconds, "ring": tuple(ring)}
    says = constructed(n, sizes, slow, noise=(1.0, 1.1, 0.9)).crossover_says()
    assert "lower than measured" in says and "at least" in says and "predicts" in says


def test_a_comparison_the_repeats_disagree_on_is_not_conclusive():
    sizes = (1024, 4096)
    ring = [timing.Timing.from_samples([1.0, 3.0, 1.0, 3.0]), timing.Timing.from_samples([4.0, 4.0, 4.0, 4.0])]
    tree = [timing.Timing.from_samples([2.0, 2.0, 2.0, 2.0]), timing.Timing.from_samples([8.0, 8.0, 8.0, 8.0])]
    run = allreduce_bench.AllReduceRun(4, "gloo", sizes, {"ring": tuple(ring), "tree": tuple(tree),
                                                           "torch": tuple(ring)})
    assert run.faster(0) == "not conclusive" and run.faster(1) == "ring"
    assert run.comparison("ring", "tree", 0).ratios == (0.5, 1.5, 0.5, 1.5)


def test_a_burst_lasts_from_the_last_ranks_start_to_the_last_ranks_end():
    # 2 ranks, 1 size, 1 implementation timed: rank 1 left the barrier 5 s late; 4 calls per burst
    spans = [{"ring": [[(0.0, 10.0), (20.0, 26.0)]]}, {"ring": [[(5.0, 11.0), (20.0, 28.0)]]}]
    per_rank = [{"calls": {impl: [4] for impl in allreduce_bench.IMPLS},
                 "spans": {impl: r.get(impl, r["ring"]) for impl in allreduce_bench.IMPLS}} for r in spans]
    (t,) = allreduce_bench._summarise(per_rank, (1024,), timing.Load(1.0, 2))["ring"]
    assert t.samples == ((11.0 - 5.0) / 4, (28.0 - 20.0) / 4) and t.calls == 4 and t.load.cores == 2


@pytest.mark.parametrize("bad, match", [(dict(sizes=[1024]), "at least 2"), (dict(sizes=[1024, 1023]), "multiple"),
                                        (dict(sizes=[8, 8]), "repeats a size"), (dict(world_size=1), "world_size"),
                                        (dict(repeats=0), "repeats")])
def test_measure_refuses_bad_arguments(bad, match):
    with pytest.raises(ValueError, match=match):
        allreduce_bench.measure(**{"sizes": SIZES, **bad})


def test_piece_sizes_timed_on_the_same_repeats(cluster):
    run = allreduce_bench.measure_pieces(3 * 4096, [4096, 64], cluster=cluster, repeats=2, span_s=0.002)
    timings = run.timings
    assert set(timings) == {4096, 64} and all(len(t.samples) == 2 and t.seconds > 0 for t in timings.values())
    assert 0 < run.gamma < 1e-6  # seconds per byte added: faster than 1 MB/s on any machine
    assert allreduce_bench.paired(timings[64], timings[4096]).ratios  # one ratio per repeat
    for bad, match in ((dict(nbytes=10), "multiple of 4"), (dict(piece_sizes=[64, 64]), "2 different"),
                       (dict(piece_sizes=[64, 0]), r"piece_sizes\[1\]=0")):
        with pytest.raises(ValueError, match=match):
            allreduce_bench.measure_pieces(**{"nbytes": 4096, "piece_sizes": [64, 128], "cluster": cluster, **bad})


def test_the_ring_recorded_step_by_step(cluster):
    per_rank = cluster.run(trace.ring_steps)
    n = 3
    assert [len(steps) for steps in per_rank] == [2 * (n - 1)] * n
    for rank, steps in enumerate(per_rank):
        assert all(s.sent_to == (rank + 1) % n and s.received_from == (rank - 1) % n for s in steps)
        for s in steps[:n - 1]:  # reduce-scatter: what is received lacks my share, which I add
            assert rank not in s.received_ranks
        assert steps[n - 2].received_chunk == rank  # after N−1 steps rank r holds chunk r
        assert all(s.received_ranks == tuple(range(n)) for s in steps[n - 1:])  # all-gather: finished sums
    states = trace.ring_states(per_rank)  # (2(N−1)+1, N, N)
    full = (1 << n) - 1
    assert states.shape == (2 * n - 1, n, n)
    assert all(states[n - 1, r, r] == full for r in range(n)) and (states[-1] == full).all()
    assert len(plots.ring_steps(per_rank, trace.ring_states(per_rank)).axes) == 2 * n - 1


def test_traffic_totals_and_the_double_tree_balance(cluster):
    nbytes = 3 * 2**16
    m = {a: trace.traffic_matrix(cluster.run(trace.traffic, a, nbytes)) for a in trace.ALGORITHMS}
    n = 3
    for matrix in m.values():  # any all-reduce here moves 2(N−1)·S in all: each of N−1 edges, S up and S down
        assert matrix.sum() == 2 * (n - 1) * nbytes
    assert (m["ring"].sum(1) == 2 * (n - 1) * nbytes // n).all()  # the ring: 2(N−1)/N·S from every rank
    assert m["tree"][0].sum() == 2 * nbytes  # the root sends S down to each of its two children
    assert m["tree"][1:].sum(1).tolist() == [nbytes, nbytes]  # leaves only send up
    assert len(plots.traffic(m, nbytes).axes) == len(trace.ALGORITHMS) + 1
    with pytest.raises(ValueError, match="algorithm"):
        trace.traffic("star")


def test_allreduce_cost_is_the_alpha_beta_model():
    link = cost.LINKS["nvlink4"]
    r = widgets.allreduce_cost(8, 2 * 7e9, "nvlink4")
    assert r["ring_s"] == pytest.approx(cost.ring_allreduce_time(14e9, 8, link.alpha, link.beta))
    assert r["tree_s"] == pytest.approx(cost.tree_allreduce_time(14e9, 8, link.alpha, link.beta))
    assert r["ring_busbw"] == pytest.approx(1 / link.beta, rel=1e-3)  # bandwidth-bound: busbw → link speed
    assert r["faster"] == "ring" and r["crossover_bytes"] == pytest.approx(cost.crossover_bytes(8, link.alpha,
                                                                                              link.beta))
    small = widgets.allreduce_cost(8, 1024, "rdma100", alpha=1e-3)
    assert small["alpha"] == 1e-3 and small["faster"] == "tree"
    here = cost.Link(1e-3, 1 / 4e8, "this machine", "fitted")
    mine = widgets.allreduce_cost(4, 2**20, "here", links={"here": here})
    assert mine["link_name"] == "this machine" and mine["beta"] == here.beta
    text = widgets.format_allreduce_cost(mine)
    assert "4 ranks" in text and "1 MiB" in text and "faster" in text
    fig = widgets.allreduce_cost_figure(mine, {"ring (measured)": [(1024, 2e-3), (2**20, 6e-3)]})
    assert len(fig.axes[0].get_lines()) >= 4  # two model curves, the marked size, the measured points
    with pytest.raises(ValueError, match="link="):
        widgets.allreduce_cost(4, 1024, "carrier pigeon")
    with pytest.raises(ValueError, match="n="):
        widgets.allreduce_cost(0, 1024)


def test_allreduce_cost_explorer_updates_and_keeps_a_static_result():
    pytest.importorskip("ipywidgets")
    box = widgets.allreduce_cost_explorer(n=8, nbytes=2**20, link="nvlink4")
    first = box.result.value
    box.controls["link"].value = "rdma100"
    assert box.controls["alpha"].value == cost.LINKS["rdma100"].alpha  # a link brings its own α
    assert box.result.value != first and "100 Gb/s" in box.result.value
    box.controls["alpha"].value = 1e-3
    assert box.cost()["alpha"] == 1e-3 and "1 ms" in box.result.value
    bundle, metadata = box._repr_mimebundle_()
    assert metadata["image/png"]["width"] == int(box.plot.layout.width.removesuffix("px"))  # shown at its size
    assert "faster" in bundle["text/plain"] and bundle["image/png"]
    assert math.isclose(box.cost()["nbytes"], 2**20)


def test_no_sync_bytes(cluster):
    from llmlab.accumulate import measure_no_sync, recent_no_sync

    saved = measure_no_sync(cluster, micro_batches=3)
    n = cluster.world_size
    assert saved.world_size == n and saved.micro_batches == 3
    # one ring all-reduce of the Ψ-byte gradient sends 2(N−1)/N·Ψ per rank (Ψ divisible by N here, or within a chunk)
    assert abs(saved.sent_no_sync - 2 * (n - 1) / n * saved.gradient_bytes) <= 2 * 4
    assert saved.sent_every_step == 3 * saved.sent_no_sync and saved.max_grad_difference < 1e-12
    assert recent_no_sync() is saved  # what the chapter measured, for claim C13
