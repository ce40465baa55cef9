"""How long a collective takes: the α-β (latency-bandwidth) model, bus bandwidth, and fitting α, β to timings.

A message of S bytes over one link costs α + S·β: α seconds of latency per message, β seconds per byte
(1 / bandwidth). A collective on n ranks is a number of message steps, so its time is

    a(n)·α + b(n)·S·β          S = the collective's buffer size in bytes (nccl-tests' "size")

| collective            | a(n)          | b(n)       | why                                                      |
|-----------------------|---------------|------------|----------------------------------------------------------|
| ring all-reduce       | 2(n−1)        | 2(n−1)/n   | reduce-scatter + all-gather, each n−1 steps of S/n bytes |
| tree all-reduce       | 2⌈log₂n⌉      | 2          | reduce up + broadcast down, pipelined (see below)        |
| reduce-scatter        | n−1           | (n−1)/n    | S = the full input                                       |
| all-gather            | n−1           | (n−1)/n    | S = the full output                                      |
| all-to-all (pairwise) | n−1           | (n−1)/n    | S = what one rank sends in all, its own chunk included   |
| broadcast (tree)      | ⌈log₂n⌉       | 1          | pipelined down a binary tree                             |

Tree all-reduce, exactly: with the data cut in segments that flow through the tree like a pipeline, reduce
and broadcast each take ≈ depth·α + S·β once the pipeline is full, so t ≈ 2⌈log₂n⌉α + 2Sβ (the form NCCL's
double binary tree reaches: Sanders, Speck & Träff 2009, "Two-tree algorithms for full bandwidth broadcast,
reduction and scan"; NVIDIA, "Massively scale your deep learning training with NCCL 2.4", 2019). It ignores
the pipeline's fill time. `pipelined=False` gives the textbook unsegmented tree, 2⌈log₂n⌉(α + Sβ). Ring's
bandwidth term is below the tree's for every n, its latency term above it once n > 3: the tree wins for small
messages, the ring for large ones, and they cross at `crossover_bytes` (C12 in CLAIMS.md).

Bus bandwidth (nccl-tests, doc/PERFORMANCE.md): algbw = S / t, and busbw = algbw × b(n) / b_link, i.e.
×2(n−1)/n for all-reduce, ×(n−1)/n for reduce-scatter, all-gather and all-to-all, ×1 for broadcast. busbw is
comparable to a link's peak whatever n is.

`LINKS` holds typical α and β of common links (C15); the bf16 gradients of a 7B model on 8 GPUs over NVLink 4:

    link = LINKS["nvlink4"]
    ring_allreduce_time(2 * 7e9, 8, link.alpha, link.beta)      # ≈ 0.054 s
    link_times(2 * 7e9, 8)                                      # the same over every link in LINKS
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from llmlab import validation

__all__ = ["Link", "LINKS", "Fit", "COLLECTIVES", "collective_time", "ring_allreduce_time", "ring_pieces_time",
           "tree_allreduce_time",
           "reduce_scatter_time", "all_gather_time", "all_to_all_time", "broadcast_time", "algorithm_bandwidth",
           "bus_bandwidth", "fit_alpha_beta", "crossover_bytes", "link_times", "NODE_LINKS", "NETWORK_LINKS",
           "C15_STEP", "gradient_allreduce_times"]


def _log2(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


# collective → (a(n), b(n)): time = a(n)·α + b(n)·S·β
COLLECTIVES = {
    "ring_all_reduce": (lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n),
    "tree_all_reduce": (lambda n: 2 * _log2(n), lambda n: 2.0 if n > 1 else 0.0),
    "reduce_scatter": (lambda n: n - 1, lambda n: (n - 1) / n),
    "all_gather": (lambda n: n - 1, lambda n: (n - 1) / n),
    "all_to_all": (lambda n: n - 1, lambda n: (n - 1) / n),
    "broadcast": (lambda n: _log2(n), lambda n: 1.0 if n > 1 else 0.0),
}
# nccl-tests' busbw factor, by the name it uses and by ours
_BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
               "all_gather": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
               "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0}
_BUS_FACTOR.update(ring_all_reduce=_BUS_FACTOR["all_reduce"], tree_all_reduce=_BUS_FACTOR["all_reduce"])


def _check(nbytes, n, alpha=0.0, beta=0.0) -> None:
    validation.integer("n", n, low=1, hint="(the number of ranks)")
    if not nbytes >= 0:
        raise ValueError(f"nbytes={nbytes!r} must be >= 0")
    if not alpha >= 0 or not beta >= 0:
        raise ValueError(f"alpha={alpha!r} and beta={beta!r} must be >= 0 (seconds per message, per byte)")


def collective_time(collective: str, nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Seconds for `collective` (a key of COLLECTIVES) on `n` ranks over a buffer of `nbytes` bytes."""
    if collective not in COLLECTIVES:
        raise ValueError(f"collective={collective!r} must be one of {sorted(COLLECTIVES)}")
    _check(nbytes, n, alpha, beta)
    a, b = COLLECTIVES[collective]
    return a(n) * alpha + b(n) * nbytes * beta


def ring_allreduce_time(nbytes, n, alpha, beta) -> float:
    """2(n−1)α + 2(n−1)/n·S·β."""
    return collective_time("ring_all_reduce", nbytes, n, alpha, beta)


def ring_pieces_time(nbytes, n, alpha, beta, gamma, pieces: int) -> float:
    """The ring all-reduce with a reduction cost γ (seconds per byte added) and each step's chunk of m = S/n bytes
    cut into `pieces` pieces, each added while the next travels: per reduce-scatter step a two-stage pipeline of
    k pieces, send (α + m/k·β) then add (m/k·γ), taking send + add + (k−1)·max(send, add); per all-gather step
    k sends, k·α + m·β. With k = 1 the add waits for the whole chunk: α + m·β + m·γ per reduce-scatter step.
    More pieces hide the adds (all but the last piece's) and pay k·α: the best k is about √(m·γ/α) when β ≥ γ.
    """
    _check(nbytes, n, alpha, beta)
    if not (gamma >= 0 and isinstance(pieces, int) and pieces >= 1):
        raise ValueError(f"gamma={gamma!r} must be ≥ 0 and pieces={pieces!r} an int ≥ 1")
    k, m = pieces, nbytes / n
    send, add = alpha + m / k * beta, m / k * gamma
    return (n - 1) * (send + add + (k - 1) * max(send, add)) + (n - 1) * (k * alpha + m * beta)


def tree_allreduce_time(nbytes, n, alpha, beta, pipelined: bool = True) -> float:
    """2⌈log₂n⌉α + 2Sβ pipelined (the default); 2⌈log₂n⌉(α + Sβ) for one unsegmented message."""
    if pipelined:
        return collective_time("tree_all_reduce", nbytes, n, alpha, beta)
    _check(nbytes, n, alpha, beta)
    return 2 * _log2(n) * (alpha + nbytes * beta)


def reduce_scatter_time(nbytes, n, alpha, beta) -> float:
    """(n−1)α + (n−1)/n·S·β, S the full input."""
    return collective_time("reduce_scatter", nbytes, n, alpha, beta)


def all_gather_time(nbytes, n, alpha, beta) -> float:
    """(n−1)α + (n−1)/n·S·β, S the full output."""
    return collective_time("all_gather", nbytes, n, alpha, beta)


def all_to_all_time(nbytes, n, alpha, beta) -> float:
    """(n−1)α + (n−1)/n·S·β, S what one rank sends in all."""
    return collective_time("all_to_all", nbytes, n, alpha, beta)


def broadcast_time(nbytes, n, alpha, beta) -> float:
    """⌈log₂n⌉α + Sβ (pipelined tree)."""
    return collective_time("broadcast", nbytes, n, alpha, beta)


def algorithm_bandwidth(nbytes, seconds) -> float:
    """algbw = S / t, bytes per second."""
    if not seconds > 0:
        raise ValueError(f"seconds={seconds!r} must be > 0")
    _check(nbytes, 1)
    return nbytes / seconds


def bus_bandwidth(nbytes, seconds, n: int, collective: str = "all_reduce") -> float:
    """busbw as nccl-tests defines it: algbw × 2(n−1)/n (all-reduce), ×(n−1)/n (reduce-scatter, all-gather,
    all-to-all), ×1 (broadcast, reduce). Bytes per second."""
    if collective not in _BUS_FACTOR:
        raise ValueError(f"collective={collective!r} must be one of {sorted(_BUS_FACTOR)}")
    _check(nbytes, n)
    return algorithm_bandwidth(nbytes, seconds) * _BUS_FACTOR[collective](n)


class Fit(NamedTuple):
    alpha: float  # seconds per message
    beta: float  # seconds per byte
    residual: float  # root-mean-square relative error of the fitted times: 0.1 means ±10% typically


def fit_alpha_beta(measurements, n: int = 2, collective: str = "ring_all_reduce") -> Fit:
    """Fit α, β ≥ 0 to [(nbytes, seconds), ...] of `collective` on `n` ranks, by least squares.

    Relative errors are minimised (each row divided by its time): timings from 1 KB to 64 MB span decades, and
    plain least squares would fit the largest ones only and leave α to noise.
    """
    if collective not in COLLECTIVES:
        raise ValueError(f"collective={collective!r} must be one of {sorted(COLLECTIVES)}")
    _check(0, n)
    data = np.asarray(measurements, dtype=float).reshape(-1, 2)  # (m, 2): nbytes, seconds
    if len(data) < 2 or len(np.unique(data[:, 0])) < 2:
        raise ValueError(f"measurements need at least 2 different sizes, got {len(data)} rows")
    if (data[:, 0] < 0).any() or (data[:, 1] <= 0).any():
        raise ValueError("measurements must be (nbytes >= 0, seconds > 0) pairs")
    a, b = COLLECTIVES[collective]
    if a(n) == 0:
        raise ValueError(f"n={n}: a collective on one rank sends nothing; there is no α or β to fit")
    size, t = data[:, 0], data[:, 1]
    design = np.stack([np.full_like(size, a(n)), b(n) * size], axis=1) / t[:, None]  # (m, 2), relative rows
    coef = np.linalg.lstsq(design, np.ones_like(t), rcond=None)[0]
    if (coef < 0).any():  # the best non-negative fit then has one of them at 0: fit the other alone
        keep = int(coef[1] > coef[0])
        coef = np.zeros(2)
        coef[keep] = max(0.0, np.linalg.lstsq(design[:, keep:keep + 1], np.ones_like(t), rcond=None)[0][0])
    residual = float(np.sqrt(np.mean((design @ coef - 1.0) ** 2)))
    return Fit(float(coef[0]), float(coef[1]), residual)


def crossover_bytes(n: int, alpha: float, beta: float, pipelined: bool = True) -> float:
    """The size where ring and tree all-reduce take equal time: the tree is faster below it, the ring above.

    Pipelined: 2(n−1)α + 2(n−1)/n·Sβ = 2⌈log₂n⌉α + 2Sβ  ⇒  S = n·(n−1−⌈log₂n⌉)·α/β. 0.0 means the ring is never
    slower (n ≤ 3, where the ring has no more latency steps than the tree); inf when β = 0 and α > 0.
    """
    _check(0, n, alpha, beta)
    steps = n - 1 - _log2(n)  # the ring's extra latency terms, per phase
    if steps <= 0 or alpha == 0:
        return 0.0
    bw_gap = (1 / n) if pipelined else (_log2(n) - (n - 1) / n)  # the tree's extra S·β, per phase
    return math.inf if beta == 0 else steps * alpha / (bw_gap * beta)


class Link(NamedTuple):
    alpha: float  # seconds per message
    beta: float  # seconds per byte, per direction
    name: str
    source: str


_NCCL_LAT = ("α: NCCL's per-step hardware latency for a ring, LL protocol (small messages), in "
             "src/graph/tuning.cc (hwLat); typical, it varies with system and NCCL version")
LINKS = {
    "nvlink4": Link(0.6e-6, 1 / 450e9, "NVLink 4 (H100 SXM)",
                    "450 GB/s per direction = 900 GB/s total (NVIDIA H100 datasheet); " + _NCCL_LAT),
    "nvlink3": Link(0.6e-6, 1 / 300e9, "NVLink 3 (A100 SXM)",
                    "300 GB/s per direction = 600 GB/s total (NVIDIA A100 datasheet); " + _NCCL_LAT),
    "pcie5": Link(1.0e-6, 1 / 63e9, "PCIe 5.0 x16",
                  "32 GT/s × 16 lanes × 128/130 ≈ 63 GB/s per direction (PCI-SIG); " + _NCCL_LAT),
    "pcie4": Link(1.0e-6, 1 / 31.5e9, "PCIe 4.0 x16",
                  "16 GT/s × 16 lanes × 128/130 ≈ 31.5 GB/s per direction (PCI-SIG); " + _NCCL_LAT),
    "rdma100": Link(2.7e-6, 1 / 12.5e9, "100 Gb/s RDMA (RoCE / InfiniBand EDR)",
                    "100 Gb/s = 12.5 GB/s per direction; " + _NCCL_LAT + " (network)"),
    "rdma200": Link(2.7e-6, 1 / 25e9, "200 Gb/s RDMA (InfiniBand HDR)",
                    "200 Gb/s = 25 GB/s per direction; " + _NCCL_LAT + " (network)"),
    "ib_ndr400": Link(2.7e-6, 1 / 50e9, "400 Gb/s InfiniBand NDR",
                      "400 Gb/s = 50 GB/s per direction (NVIDIA ConnectX-7); " + _NCCL_LAT + " (network)"),
}
NODE_LINKS = ("nvlink4", "nvlink3", "pcie5", "pcie4")  # the LINKS inside one node, fastest first
NETWORK_LINKS = ("rdma100", "rdma200", "ib_ndr400")  # the LINKS between nodes, slowest first


def link_times(nbytes, n: int, collective: str = "ring_all_reduce", links=None) -> dict[str, float]:
    """Seconds of `collective` over each link: {link key: seconds}, e.g. for one step's gradient all-reduce."""
    return {key: collective_time(collective, nbytes, n, link.alpha, link.beta)
            for key, link in (links or LINKS).items()}


# --- C15: the material's network advice (§5.2), priced by the model in llmlab.claims.ch05 -----------------------

# The step C15 is priced on: a 7B-parameter model's bf16 gradients, all-reduced every step, by a ring on one 8-GPU
# node (NVLink or PCIe) and across 8 such nodes over each network (llmlab.hardware.cluster.allreduce_time: one NIC
# per GPU, hierarchical, or one per node, a flat ring); a step of 2^20 tokens computed by H100s at 40% MFU
# (chapter 1) is what the all-reduce could hide behind.
C15_STEP = {"n_params": 7e9, "bytes_per_param": 2, "node_gpus": 8, "cluster_gpus": 64, "tokens": 2**20,
            "gpu": "H100 SXM", "mfu": 0.4}


def gradient_allreduce_times(n_params: float, n: int, bytes_per_param: int = 2, links=None) -> dict[str, float]:
    """Seconds of one step's gradient all-reduce (a ring over `n` ranks) of `n_params` parameters stored in
    `bytes_per_param` bytes each (2: bf16), over every link: {link key: seconds}."""
    validation.positive("n_params", n_params)
    validation.integer("bytes_per_param", bytes_per_param, low=1)
    return link_times(n_params * bytes_per_param, n, "ring_all_reduce", links)
