"""The α-β cost model: formulas by hand, nccl-tests' bus bandwidth, fitting α and β back from noisy timings."""

import math

import numpy as np
import pytest

from llmlab.dist import cost

ALPHA, BETA = 5e-6, 1 / 10e9  # 5 µs per message, 10 GB/s


def test_ring_allreduce_by_hand():
    # n = 4, S = 1 MB: 2·3 = 6 messages, and each rank sends 2·3/4 of the buffer
    assert cost.ring_allreduce_time(1e6, 4, ALPHA, BETA) == pytest.approx(6 * 5e-6 + 1.5 * 1e6 / 10e9)
    assert cost.ring_allreduce_time(1e6, 1, ALPHA, BETA) == 0.0  # one rank: nothing to send
    assert cost.ring_allreduce_time(0, 8, ALPHA, BETA) == pytest.approx(14 * 5e-6)  # latency only


def test_ring_in_pieces_by_hand():
    S, n = 8e6, 4  # each step's chunk m = 2 MB
    # one piece and no reduction cost: the plain ring
    plain = cost.ring_allreduce_time(S, n, ALPHA, BETA)
    assert cost.ring_pieces_time(S, n, ALPHA, BETA, 0.0, 1) == pytest.approx(plain)
    gamma = BETA / 4  # additions 4× faster than the link: with k pieces all but the last piece's add hides
    m = S / n
    whole = 3 * (ALPHA + m * BETA + m * gamma) + 3 * (ALPHA + m * BETA)
    assert cost.ring_pieces_time(S, n, ALPHA, BETA, gamma, 1) == pytest.approx(whole)
    k = 8
    piped = 3 * (k * ALPHA + m * BETA + m / k * gamma) + 3 * (k * ALPHA + m * BETA)
    assert cost.ring_pieces_time(S, n, ALPHA, BETA, gamma, k) == pytest.approx(piped)
    # additions slower than the link: the adds set the pace, k−1 of them behind the first piece's send
    slow = 4 * BETA
    send, add = ALPHA + m / k * BETA, m / k * slow
    assert add > send
    assert cost.ring_pieces_time(S, n, ALPHA, BETA, slow, k) == pytest.approx(
        3 * (send + k * add) + 3 * (k * ALPHA + m * BETA))
    with pytest.raises(ValueError, match=r"pieces=0 an int ≥ 1"):
        cost.ring_pieces_time(S, n, ALPHA, BETA, gamma, 0)


def test_tree_allreduce_by_hand():
    # n = 8: depth 3, up and down: 6 latencies; pipelined: 2S·β; unsegmented: every level pays S·β
    assert cost.tree_allreduce_time(1e6, 8, ALPHA, BETA) == pytest.approx(6 * 5e-6 + 2e6 / 10e9)
    assert cost.tree_allreduce_time(1e6, 8, ALPHA, BETA, pipelined=False) == pytest.approx(6 * (5e-6 + 1e6 / 10e9))
    assert cost.tree_allreduce_time(1e6, 5, ALPHA, BETA) == pytest.approx(6 * 5e-6 + 2e6 / 10e9)  # ⌈log₂5⌉ = 3
    assert cost.tree_allreduce_time(1e6, 1, ALPHA, BETA) == 0.0


def test_other_collectives_by_hand():
    S, n = 8e6, 4
    for fn in (cost.reduce_scatter_time, cost.all_gather_time, cost.all_to_all_time):
        assert fn(S, n, ALPHA, BETA) == pytest.approx(3 * 5e-6 + 0.75 * S / 10e9)
    assert cost.broadcast_time(S, n, ALPHA, BETA) == pytest.approx(2 * 5e-6 + S / 10e9)
    # a ring all-reduce is a reduce-scatter followed by an all-gather
    assert cost.ring_allreduce_time(S, n, ALPHA, BETA) == pytest.approx(
        cost.reduce_scatter_time(S, n, ALPHA, BETA) + cost.all_gather_time(S, n, ALPHA, BETA))


def test_bus_bandwidth_is_nccl_tests_definition():
    # nccl-tests: algbw = S/t; busbw = algbw · 2(n−1)/n (all-reduce), (n−1)/n (rs, ag, a2a), 1 (broadcast)
    S, t, n = 64 * 2**20, 0.01, 8
    algbw = S / t
    assert cost.algorithm_bandwidth(S, t) == algbw
    assert cost.bus_bandwidth(S, t, n) == pytest.approx(algbw * 14 / 8)
    for c in ("reduce_scatter", "all_gather", "all_to_all"):
        assert cost.bus_bandwidth(S, t, n, c) == pytest.approx(algbw * 7 / 8)
    assert cost.bus_bandwidth(S, t, n, "broadcast") == pytest.approx(algbw)
    # a ring all-reduce that runs exactly at link speed has busbw = link bandwidth, whatever n is
    for n in (2, 4, 16):
        seconds = cost.ring_allreduce_time(S, n, 0.0, BETA)
        assert cost.bus_bandwidth(S, seconds, n) == pytest.approx(1 / BETA)


@pytest.mark.parametrize("collective,n", [("ring_all_reduce", 4), ("tree_all_reduce", 8), ("all_gather", 3)])
def test_fit_recovers_alpha_beta_from_noisy_timings(collective, n):
    rng = np.random.default_rng(0)
    sizes = np.geomspace(1e3, 64e6, 14)
    times = [cost.collective_time(collective, s, n, ALPHA, BETA) for s in sizes]
    noisy = [(s, t * (1 + rng.normal(0, 0.03))) for s, t in zip(sizes, times, strict=True)]  # ±3% noise
    fit = cost.fit_alpha_beta(noisy, n, collective)
    # with 3% noise on 14 points spread over the latency- and bandwidth-bound regimes, both come back to ~5%
    assert fit.alpha == pytest.approx(ALPHA, rel=0.05) and fit.beta == pytest.approx(BETA, rel=0.05)
    assert 0.01 < fit.residual < 0.06
    exact = cost.fit_alpha_beta(list(zip(sizes, times, strict=True)), n, collective)
    assert exact.alpha == pytest.approx(ALPHA, rel=1e-9) and exact.residual < 1e-9


def test_fit_keeps_alpha_and_beta_non_negative():
    # no latency, and small messages measured 20% fast: unconstrained least squares gives α ≈ −4 ns
    data = [(s, s * BETA * 1.5 * (0.8 if s < 1e5 else 1.0)) for s in np.geomspace(1e3, 1e8, 8)]
    fit = cost.fit_alpha_beta(data, 4)
    assert fit.alpha == 0.0 and fit.beta == pytest.approx(BETA, rel=0.15) and fit.residual > 0.05


def test_crossover_is_where_ring_and_tree_are_equal():
    for n in (4, 8, 64):
        for pipelined in (True, False):
            s = cost.crossover_bytes(n, ALPHA, BETA, pipelined)
            assert cost.ring_allreduce_time(s, n, ALPHA, BETA) == pytest.approx(
                cost.tree_allreduce_time(s, n, ALPHA, BETA, pipelined))
            below, above = s / 10, s * 10
            assert cost.tree_allreduce_time(below, n, ALPHA, BETA, pipelined) < cost.ring_allreduce_time(
                below, n, ALPHA, BETA)
            assert cost.tree_allreduce_time(above, n, ALPHA, BETA, pipelined) > cost.ring_allreduce_time(
                above, n, ALPHA, BETA)
    assert cost.crossover_bytes(8, ALPHA, BETA) == pytest.approx(8 * (7 - 3) * ALPHA / BETA)  # n(n−1−log₂n)α/β
    assert cost.crossover_bytes(3, ALPHA, BETA) == 0.0  # n ≤ 3: the ring is never slower
    assert cost.crossover_bytes(8, ALPHA, 0.0) == math.inf


def test_links_and_claim_c15_arithmetic():
    assert cost.LINKS["rdma100"].beta == pytest.approx(1 / 12.5e9)  # 100 Gb/s = 12.5 GB/s
    assert cost.LINKS["nvlink4"].beta == pytest.approx(1 / 450e9)  # per direction: half of the "900 GB/s"
    times = cost.link_times(2 * 7e9, 8)  # bf16 gradients of a 7B model, 8 ranks
    assert times["rdma100"] / times["nvlink4"] == pytest.approx(36, rel=0.01)  # 450 / 12.5
    assert all(link.source for link in cost.LINKS.values())
    assert sorted(cost.NODE_LINKS + cost.NETWORK_LINKS) == sorted(cost.LINKS)  # every link, in one group each


@pytest.mark.parametrize("call", [
    lambda: cost.ring_allreduce_time(1e6, 0, ALPHA, BETA),
    lambda: cost.tree_allreduce_time(1e6, 2.0, ALPHA, BETA),
    lambda: cost.ring_allreduce_time(-1, 4, ALPHA, BETA),
    lambda: cost.ring_allreduce_time(1e6, 4, -ALPHA, BETA),
    lambda: cost.bus_bandwidth(1e6, 0.0, 4),
    lambda: cost.bus_bandwidth(1e6, 1.0, 4, "gather"),
    lambda: cost.bus_bandwidth(-5, 1.0, 4),
    lambda: cost.collective_time("scan", 1e6, 4, ALPHA, BETA),
    lambda: cost.fit_alpha_beta([(1e3, 1e-3)], 4),
    lambda: cost.fit_alpha_beta([(1e3, 1e-3), (1e4, -1e-3)], 4),
    lambda: cost.fit_alpha_beta([(1e3, 1e-3), (1e4, 2e-3)], 1),
    lambda: cost.crossover_bytes(0, ALPHA, BETA),
])
def test_bad_input_is_a_value_error(call):
    with pytest.raises(ValueError):
        call()


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"n=0 must be an int >= 1"):
        cost.ring_allreduce_time(1e6, 0, ALPHA, BETA)
    with pytest.raises(ValueError, match=r"nbytes=-1 must be >= 0"):
        cost.all_gather_time(-1, 4, ALPHA, BETA)
