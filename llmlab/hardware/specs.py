"""The spec sheet: peak figures of the accelerators the course talks about, each with its source.

The compute columns differ by up to an order of magnitude, and the course text's table (§5.1) picks the wrong one
for training:

- `fp32_tflops`: FP32 on the ordinary (SIMT) cores — what the course's table lists;
- `tf32_tflops`: FP32 matmuls on the tensor cores in TF32 (10-bit mantissa), dense — what "fp32" training's
  matmuls run on from the A100 on where TF32 is switched on (TensorFlow's and JAX's default; PyTorch's after
  `torch.set_float32_matmul_precision("high")`): half the BF16 rate on NVIDIA's datasheets, not a sixteenth;
- `bf16_tflops`: BF16 on the tensor/matrix cores, dense — what mixed-precision training runs on. Vendors'
  headline tensor figures are often *with 2:4 structured sparsity* (`bf16_sparse_tflops`, 2× dense), which
  only kernels written for pruned 2:4 weights reach;
- `fp8_tflops`: FP8 on the tensor cores, dense, where the chip has it (Hopper, Blackwell): 2× BF16.

`for_device(name)` finds the row of a GPU as its driver names it ("NVIDIA H100 PCIe" → the PCIe row, not the SXM
one), and of one die where the software sees each die as a device (an MI250X is two GCDs: each gets half the
package's figures).

Memory: `memory_gb` is the label ("80 GB"), `memory_bytes` the capacity in bytes. NVIDIA's and AMD's "GB" of HBM
are binary gigabytes (GiB, 2³⁰ bytes), loosely named: an "80 GB" A100 reports 81920 MiB = 80 GiB = 85.9·10⁹ bytes
in nvidia-smi, 7% more than 80·10⁹. Each row's capacity is the driver's total where a reading is cited (nvidia-smi's
"MiB" total × 2²⁰: `_SMI`), else the label taken as GiB; a budget is a fraction of `memory_bytes`, never of
`memory_gb` × 10⁹. (The CUDA context and the driver's reservations take a few hundred MiB of it.)

Interconnect figures (`link_gbs`) are what vendors quote: the total of both directions over all links of one
GPU (NVLink 4 on H100: 18 links × 25 GB/s × 2 directions = 900 GB/s, i.e. 450 GB/s each way).

    from llmlab.hardware import SPECS
    h100 = SPECS["H100 SXM"]
    h100.bf16_tflops, h100.ridge_point()        # 989.0 TFLOP/s, 295 FLOP/byte
    for_device("NVIDIA H100 PCIe").name         # 'H100 PCIe'
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

__all__ = ["Spec", "SPECS", "spec", "for_device", "cpu_peak_tflops"]


@dataclass(frozen=True)
class Spec:
    name: str
    fp32_tflops: float  # FP32 on the SIMT cores (vector), dense
    bf16_tflops: float  # BF16 on tensor/matrix cores, dense (no sparsity); SIMT FP32 where there are none
    bf16_sparse_tflops: float | None  # with 2:4 structured sparsity; None where not offered
    tf32_tflops: float | None  # FP32 matmuls on the tensor cores as TF32, dense; None where there is no TF32
    fp8_tflops: float | None  # FP8 on the tensor cores, dense; None where the chip has no FP8
    memory_gb: float  # the vendor's label ("80 GB"): binary gigabytes, loosely named (see memory_bytes)
    hbm_gbs: float  # memory bandwidth, GB/s
    link: str
    link_gbs: float  # interconnect per GPU, GB/s, both directions together (as vendors quote it)
    dies: int  # compute dies the software sees as separate devices (MI250/MI250X: 2)
    source: str
    notes: str = ""
    memory_bytes: int = 0  # the capacity in bytes (0: memory_gb × 2³⁰, the label read as GiB); set in __post_init__

    def __post_init__(self):
        if not self.memory_bytes:
            object.__setattr__(self, "memory_bytes", round(self.memory_gb * 2**30))

    @property
    def link_gbs_per_direction(self) -> float:
        return self.link_gbs / 2

    def peak_flops(self, precision: str = "bf16") -> float:
        """Peak FLOP/s for `precision`: 'bf16' (tensor, dense), 'bf16_sparse', 'tf32', 'fp8' or 'fp32' (SIMT)."""
        table = {"bf16": self.bf16_tflops, "fp32": self.fp32_tflops, "bf16_sparse": self.bf16_sparse_tflops,
                 "tf32": self.tf32_tflops, "fp8": self.fp8_tflops}
        if precision not in table:
            raise ValueError(f"precision={precision!r}; choose from {sorted(table)}")
        if table[precision] is None:
            raise ValueError(f"{self.name} has no {precision} figure")
        return table[precision] * 1e12

    def ridge_point(self, precision: str = "bf16") -> float:
        """FLOPs per byte of memory traffic above which a kernel can be compute-bound (peak / bandwidth)."""
        return self.peak_flops(precision) / (self.hbm_gbs * 1e9)


def cpu_peak_tflops(cores: int, ghz: float, fp32_lanes: int, fma_units: int) -> float:
    """A CPU's FP32 peak: cores × clock × SIMD lanes × FMA units × 2 FLOPs per fused multiply-add."""
    return cores * ghz * 1e9 * fp32_lanes * fma_units * 2 / 1e12


_NVIDIA = "NVIDIA {} datasheet ({}); tensor figures there are quoted with sparsity, dense = half"
# The total memory nvidia-smi reports (MiB = 2²⁰ bytes), as printed in public logs of these GPUs: A100 80GB SXM4/PCIe
# 81920 MiB (e.g. github.com/dexmal/dexbotic issue 41, an A800-SXM4-80GB, the A100's export variant), H100 80GB HBM3
# 81559 MiB, H200 143771 MiB = 140.4 GiB = 150.8·10⁹ bytes (so NVIDIA's "141 GB" reads as GiB rounded up — assumed:
# the datasheet does not say which GB), B200 183359 MiB = 179.1 GiB (the HGX B200 datasheet's "180 GB" per GPU).
_SMI = {"A100": 81920, "H100": 81559, "H200": 143771, "B200": 183359}

SPECS: dict[str, Spec] = {s.name: s for s in [
    Spec("A100 SXM", fp32_tflops=19.5, bf16_tflops=312, bf16_sparse_tflops=624, tf32_tflops=156, fp8_tflops=None,
         memory_gb=80, memory_bytes=_SMI["A100"] * 2**20, hbm_gbs=2039,
         link="NVLink 3 (12 links)", link_gbs=600, dies=1, source=_NVIDIA.format("A100 Tensor Core GPU", 2021),
         notes="80 GB SXM4 model; the 40 GB model has 1555 GB/s"),
    Spec("A100 PCIe", fp32_tflops=19.5, bf16_tflops=312, bf16_sparse_tflops=624, tf32_tflops=156, fp8_tflops=None,
         memory_gb=80, memory_bytes=_SMI["A100"] * 2**20, hbm_gbs=1935,
         link="NVLink bridge (pairs) / PCIe Gen4 x16 64 GB/s", link_gbs=600, dies=1,
         source=_NVIDIA.format("A100 Tensor Core GPU", 2021),
         notes="80 GB PCIe model (the 40 GB one has 1555 GB/s); the SXM part's compute at a 300 W limit; without a "
               "bridge, GPUs talk over PCIe Gen4 x16 (64 GB/s both directions)"),
    Spec("H100 SXM", fp32_tflops=67, bf16_tflops=989, bf16_sparse_tflops=1979, tf32_tflops=495, fp8_tflops=1979,
         memory_gb=80, memory_bytes=_SMI["H100"] * 2**20, hbm_gbs=3350,
         link="NVLink 4 (18 links)", link_gbs=900, dies=1, source=_NVIDIA.format("H100 Tensor Core GPU", 2023)),
    Spec("H100 PCIe", fp32_tflops=51, bf16_tflops=756, bf16_sparse_tflops=1513, tf32_tflops=378, fp8_tflops=1513,
         memory_gb=80, hbm_gbs=2000,
         link="NVLink bridge (pairs) / PCIe Gen5 x16 128 GB/s", link_gbs=600, dies=1,
         source=_NVIDIA.format("H100 Tensor Core GPU", 2023),
         notes="HBM2e; without a bridge, GPUs talk over PCIe Gen5 x16 (128 GB/s both directions); memory: the label "
               "read as 80 GiB (no driver reading cited; the SXM part reports 81559 MiB)"),
    Spec("H200 SXM", fp32_tflops=67, bf16_tflops=989, bf16_sparse_tflops=1979, tf32_tflops=495, fp8_tflops=1979,
         memory_gb=141, memory_bytes=_SMI["H200"] * 2**20, hbm_gbs=4800,
         link="NVLink 4 (18 links)", link_gbs=900, dies=1, source=_NVIDIA.format("H200 Tensor Core GPU", 2024),
         notes="the H100's compute with HBM3e"),
    Spec("B200", fp32_tflops=75, bf16_tflops=2250, bf16_sparse_tflops=4500, tf32_tflops=1125, fp8_tflops=4500,
         memory_gb=180, memory_bytes=_SMI["B200"] * 2**20, hbm_gbs=7700,
         link="NVLink 5 (18 links)", link_gbs=1800, dies=1,
         source="NVIDIA HGX B200 datasheet (2024), per GPU; tensor figures there are quoted with sparsity",
         notes="two dies joined by a 10 TB/s link, seen by software as one GPU"),
    Spec("MI250X", fp32_tflops=47.9, bf16_tflops=383, bf16_sparse_tflops=None, tf32_tflops=None, fp8_tflops=None,
         memory_gb=128, hbm_gbs=3277,
         link="Infinity Fabric (8 links × 100 GB/s)", link_gbs=800, dies=2,
         source="AMD Instinct MI250X product page (2021): peak FP32 vector, FP16/BF16 matrix (no TF32)",
         notes="two GCDs, each a separate device with 64 GB and 1.6 TB/s; FP32 matrix is 95.7; memory: the label "
               "read as 128 GiB"),
    Spec("MI250", fp32_tflops=45.3, bf16_tflops=362.1, bf16_sparse_tflops=None, tf32_tflops=None, fp8_tflops=None,
         memory_gb=128, hbm_gbs=3277,
         link="Infinity Fabric (6 links × 100 GB/s)", link_gbs=600, dies=2,
         source="AMD Instinct MI250 product page (2021): peak FP32 vector, FP16/BF16 matrix",
         notes="two GCDs, each a separate device with 64 GB and 1.6 TB/s; 800 GB/s is the MI250X's 8 links; memory: "
               "the label read as 128 GiB"),
    Spec("laptop CPU", fp32_tflops=cpu_peak_tflops(cores=8, ghz=3.0, fp32_lanes=8, fma_units=2),
         bf16_tflops=cpu_peak_tflops(cores=8, ghz=3.0, fp32_lanes=8, fma_units=2), bf16_sparse_tflops=None,
         tf32_tflops=None, fp8_tflops=None, memory_gb=32, hbm_gbs=89.6, link="none (one socket)", link_gbs=0, dies=1,
         source="computed: 8 cores × 3 GHz × 8 fp32 lanes (AVX2) × 2 FMA units × 2; dual-channel DDR5-5600 "
                "= 2 × 8 B × 5600 MT/s",
         notes="a typical 2023 laptop; no tensor units, so bf16 runs at the fp32 rate at best; 32 GiB of DRAM"),
]}


def spec(name: str) -> Spec:
    if name not in SPECS:
        raise ValueError(f"no spec for {name!r}; known: {', '.join(SPECS)}")
    return SPECS[name]


def for_device(name: str) -> Spec | None:
    """The row of the GPU its driver names `name` ('NVIDIA H200' → 'H200 SXM'), None if the sheet has none.

    A row named '… PCIe' matches only a name that says PCIe, any other row only a name that says neither PCIe nor
    NVL (the H100 NVL and H200 NVL are other parts, with other peaks). Where software sees each die as a device
    (`dies` > 1: an MI250X is two GCDs) the row returned is one die's: every figure divided by `dies`.
    """
    words = {w.lower() for w in re.split(r"[\s/_-]+", name)}
    for row in SPECS.values():
        model, _, form = row.name.partition(" ")
        if model.lower() in words and (form == "PCIe") == ("pcie" in words) and "nvl" not in words:
            return row if row.dies == 1 else _one_die(row)
    return None


def _one_die(row: Spec) -> Spec:
    """`row` as one of its `dies` devices sees it: compute, memory and its bandwidth divided among the dies (the
    links are left as the package's: how they are shared between the dies is not on the sheet)."""
    split = {f: getattr(row, f) / row.dies if getattr(row, f) is not None else None
             for f in ("fp32_tflops", "bf16_tflops", "bf16_sparse_tflops", "tf32_tflops", "fp8_tflops", "memory_gb",
                       "hbm_gbs")}
    split["memory_bytes"] = row.memory_bytes // row.dies
    return replace(row, name=f"{row.name} (one of {row.dies} dies)", dies=1, **split,
                   notes=f"one die of the {row.name}: the package's figures / {row.dies}; {row.notes}")
