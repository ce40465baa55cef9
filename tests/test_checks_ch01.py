"""Chapter 1's exercise checks (llmlab.checks.ch01): each passes the reference answer, reports an unwritten
answer as not attempted, and fails a plausible wrong answer with a message naming the mistake and the hint."""


import random
import re
import statistics
from functools import partial

import llmlab.kernels  # noqa: F401  (first: interpreted Triton on the CPU tier, before any kernel below)
import pytest
import torch
import triton
import triton.language as tl
from check_answers import Mistake, Reference
from grading import not_attempted

from llmlab import flops
from llmlab.checks import ch01, ch01_gemm, ch01_log


def unwritten(*args):
    raise NotImplementedError("Exercise 1.x")


# --- 1.1 ----------------------------------------------------------------------------------------------------

def block_flops(B, T, C, n_head):
    hs = C // n_head
    return 2 * B * T * 3 * C * C + 2 * B * n_head * 2 * T * T * hs + 2 * B * T * C * C + 2 * 2 * B * T * 4 * C * C


# --- 1.2 ----------------------------------------------------------------------------------------------------

def gemm_roofline(m, n, k, nbytes, peak, bandwidth):
    intensity = 2 * m * n * k / ((m * k + k * n + m * n) * nbytes)
    return intensity, "compute" if intensity >= peak / bandwidth else "memory"


def one_byte(m, n, k, nbytes, peak, bw):
    return gemm_roofline(m, n, k, 1, peak, bw)


def no_write(m, n, k, nbytes, peak, bw):
    return 2 * m * n * k / ((m * k + k * n) * nbytes), "memory"


def flipped(*args):
    intensity, bound = gemm_roofline(*args)
    return intensity, {"memory": "compute", "compute": "memory"}[bound]


# --- 1.3 ----------------------------------------------------------------------------------------------------

@triton.jit
def _kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            PIDS: tl.constexpr, OFFSETS: tl.constexpr, STRIDES: tl.constexpr, MASK_K: tl.constexpr,
            ACC_FP32: tl.constexpr, ACCUMULATE: tl.constexpr, ADVANCE: tl.constexpr, MASK_STORE: tl.constexpr):
    """The exercise's kernel with a switch for each planted mistake (the defaults of `Variant`: the right answer)."""
    if PIDS == "swapped":
        pid_m, pid_n = tl.program_id(axis=1), tl.program_id(axis=0)
    else:
        pid_m, pid_n = tl.program_id(axis=0), tl.program_id(axis=1)
    if STRIDES == "contiguous":  # every matrix assumed row-major and dense
        stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn = K, 1, N, 1, N, 1
    elif STRIDES == "swapped A":
        stride_am, stride_ak = stride_ak, stride_am
    if OFFSETS == "blocks mixed up":
        offs_m = pid_m * BLOCK_N + tl.arange(0, BLOCK_M)
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    if STRIDES == "swapped B pointers":  # the pair swapped where the pointers are made, not where they advance
        b_ptrs = b_ptr + offs_k[:, None] * stride_bn + offs_n[None, :] * stride_bk
    else:
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    if ACC_FP32:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:  # the input dtype: tl.dot then accumulates in it
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if MASK_K:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        else:
            a = tl.load(a_ptrs, mask=offs_m[:, None] < M, other=0.0)
            b = tl.load(b_ptrs, mask=offs_n[None, :] < N, other=0.0)
        if ACCUMULATE:
            acc = tl.dot(a, b, acc)
        else:
            acc = tl.dot(a, b)
        if ADVANCE == "rows":  # A's pointers moved BLOCK_K rows down instead of BLOCK_K columns right
            a_ptrs += BLOCK_K * stride_am
            b_ptrs += BLOCK_K * stride_bk
        elif ADVANCE:
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    if MASK_STORE:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty))


class Variant:
    """`_kernel` launched with its mistake switches set, looking to the check like a learner's kernel."""

    def __init__(self, **switches):
        self.switches = dict(PIDS="right", OFFSETS="right", STRIDES="right", MASK_K=True, ACC_FP32=True,
                             ACCUMULATE=True, ADVANCE=True, MASK_STORE=True) | switches
        self.fn = _kernel.fn

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _kernel[grid](*args, **kwargs, **self.switches)


@triton.jit
def _unwritten_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                      stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    raise NotImplementedError("Exercise 1.3: A tiled Triton GEMM")


def test_the_cases_cover_the_edges():
    shapes = ch01_gemm.cases()
    assert shapes[0].M == shapes[0].N == shapes[0].K == 1  # a partial tile in every dimension
    for case in shapes:
        grid_m, grid_n = -(-case.M // case.blocks[0]), -(-case.N // case.blocks[1])
        if case.K % case.blocks[2] == 0 and grid_m != grid_n:
            break
    else:
        raise AssertionError("no case of whole K blocks on a non-square grid (swapped program ids show there)")
    assert sum(c.K % c.blocks[2] != 0 and c.K > c.blocks[2] for c in shapes) >= 3  # partial last K block after whole
    assert any(c.column_major for c in shapes) and any(c.integer for c in shapes)
    assert {c.dtype for c in shapes} == {torch.float32, torch.float16}


def test_the_integer_case_is_exact_in_fp32_and_zero_with_an_fp16_accumulator():
    case = next(c for c in ch01_gemm.cases() if c.integer)
    a, b = ch01_gemm._integer_operands(case, torch.Generator().manual_seed(0))
    middle = (case.K - 1) // 16 - 1
    assert torch.equal(a.float() @ b.float(), torch.full((case.M, case.N), float(middle)))
    acc = torch.zeros(case.M, case.N, dtype=torch.float16)
    for start in range(0, case.K, 16):
        acc = acc + (a[:, start:start + 16] @ b[start:start + 16]).half()  # (M, N), rounded to fp16 each step
    assert not acc.any()


def test_launch_runs_a_kernel_on_any_strides():
    a, b = torch.randn(40, 23).t(), torch.randn(40, 20)[:, ::2]  # (23, 40) column-major, (40, 10) every other column
    c = ch01.launch(Variant(), a, b, BLOCK_M=16, BLOCK_N=32, BLOCK_K=16)
    torch.testing.assert_close(c, a @ b)
    with pytest.raises(ValueError, match="a.shape\\[1\\] == b.shape\\[0\\]"):
        ch01.launch(Variant(), a, a)


# --- 1.4 ----------------------------------------------------------------------------------------------------

def implied_mfu(n_params, tokens, gpus, days, peak):
    return 6 * n_params * tokens / (gpus * days * 86_400 * peak)


# --- 1.5 ----------------------------------------------------------------------------------------------------

STEP_LINE = re.compile(r"step\s+(\d+)\s.*\sbatch (\d+)\s+([\d.]+) ms")


def step_lines(log_text, first):
    """(seconds, batch) of each step line from step `first` on."""
    matches = (STEP_LINE.fullmatch(line.strip()) for line in log_text.splitlines())
    return [(float(m[3]) / 1000, int(m[2])) for m in matches if m is not None and int(m[1]) >= first]


def palm_per_token(cfg):  # the solution's count: 6·N + 12·L·C·T
    L, C, T, V = cfg.n_layer, cfg.n_embd, cfg.block_size, cfg.vocab_size
    return 6 * (12 * L * C * C + V * C) + 12 * L * C * T


def six_n(cfg):
    return palm_per_token(cfg) - 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


def mfu_from_log(log_text, cfg, peak_flops, warmup=10, *, average=statistics.median, first=None,
                 per_token=palm_per_token, ms=False, sequences=False, percent=False):
    """The solution's answer; each switch plants one mistake: the mean, warm-up kept from step `first`, another FLOP
    count per token, milliseconds taken for seconds, batch taken for tokens, a percentage."""
    steps = step_lines(log_text, warmup + 1 if first is None else first)
    seconds = average([s * (1000 if ms else 1) for s, _ in steps])
    tokens = statistics.median([b for _, b in steps]) * (1 if sequences else cfg.block_size)
    return tokens / seconds * per_token(cfg) / peak_flops * (100 if percent else 1)


def llmlab_mfu_from_log(log_text, cfg, peak_flops, warmup=10):
    """The same with llmlab's own count and MFU: training_step_flops of one step's batch, flops.mfu on one device."""
    steps = step_lines(log_text, warmup + 1)
    batch = int(statistics.median([b for _, b in steps]))
    return flops.mfu(flops.training_step_flops(cfg, batch), statistics.median([s for s, _ in steps]), 1, peak_flops)


def test_the_logs_hold_what_the_mistakes_are_named_by():
    for log in ch01_log._logs(random.Random(0)) + ch01_log._logs(random.Random(1)):
        warm, kept = log.centi_ms[:log.warmup], log.kept
        steady = [t for t in kept if t < 2 * statistics.median(kept)]
        assert len(kept) % 2 == 1 and len(set(steady)) == len(steady)  # one middle value; every named answer differs
        assert 2 <= len(kept) - len(steady) < len(kept) / 2 and min(warm) > max(steady) and min(steady) >= 5000
        lines = log.text.splitlines()
        assert len(step_lines(log.text, 1)) == len(log.centi_ms) and len(lines) > len(log.centi_ms) + 1
        assert any(line.startswith("eval  step") for line in lines) == (len(log.centi_ms) >= 50)


# --- the tables: tests/test_checks_answers.py runs each once, tools/flake.py N times ------------------------------

ANSWERS = [
    Reference(ch01.block_flops, block_flops),
    Mistake(ch01.block_flops, lambda B, T, C, n_head: 24 * B * T * C * C,  # the weights only (6·N per token / 3)
            match="attention scores q·kᵀ and the weighted sum p·v .* are missing", hint="T×T per head"),
    Mistake(ch01.block_flops, lambda *args: block_flops(*args) // 2, match="a multiply-add is 2 FLOPs", hint="2·m·n·k"),
    Mistake(ch01.block_flops, lambda *args: 3 * block_flops(*args), match="forward \\+ backward", hint="six matmuls"),
    Mistake(ch01.block_flops, lambda *args: "many", match="expected a number", hint="six matmuls"),

    Reference(ch01.gemm_roofline, gemm_roofline),
    Mistake(ch01.gemm_roofline, one_byte, match="bytes per element, not 1", hint="bytes_per_element"),
    Mistake(ch01.gemm_roofline, no_write, match="write of C", hint="C written once"),
    Mistake(ch01.gemm_roofline, flipped, match="bound '(memory|compute)', expected", hint="ridge point"),
    Mistake(ch01.gemm_roofline, lambda *args: gemm_roofline(*args)[0], match="expected a pair", hint="ridge point"),

    Reference(ch01.tiled_gemm, Variant()),
    # K = 1 (the first case) is not a multiple of BLOCK_K: the unmasked loads read the NaN around A and B
    Mistake(ch01.tiled_gemm, Variant(MASK_K=False), match="every value of C is NaN .* not a multiple of BLOCK_K",
            hint="mask both loads along K"),
    # the first case's 1×1 C is one corner of a 16×16 tile: the rest of the tile lands around it
    Mistake(ch01.tiled_gemm, Variant(MASK_STORE=False), match="written outside C's 1×1",
            hint="mask=(offs_m[:, None] < M) & (offs_n[None, :] < N)"),
    Mistake(ch01.tiled_gemm, Variant(STRIDES="swapped A"), match="C is what A read with its two strides swapped gives",
            hint="never with the pair swapped"),
    Mistake(ch01.tiled_gemm, Variant(STRIDES="contiguous"),
            match="A 32×32, B 32×16.* NaN, though every tile is whole here.*the addresses are off",
            hint="never at i·K + j"),
    Mistake(ch01.tiled_gemm, Variant(STRIDES="swapped B pointers"),
            match="C is what B read with its two strides swapped", hint="never with the pair swapped"),
    Mistake(ch01.tiled_gemm, Variant(ADVANCE=False), match="never advanced along K", hint="a_ptrs += BLOCK_K"),
    Mistake(ch01.tiled_gemm, Variant(ADVANCE="rows"), match="A's pointers advanced by BLOCK_K·stride_am",
            hint="a_ptrs += BLOCK_K * stride_ak"),
    Mistake(ch01.tiled_gemm, Variant(ACCUMULATE=False), match="overwritten instead of accumulated",
            hint="acc = tl.dot(a, b, acc)"),
    Mistake(ch01.tiled_gemm, Variant(ACC_FP32=False), match="exactly what an fp16 accumulator gives",
            hint="dtype of your accumulator"),
    Mistake(ch01.tiled_gemm, Variant(PIDS="swapped"), match="program_id\\(axis=0\\) was taken for the columns",
            hint="i = program_id(axis=0)"),
    # the ragged case has BLOCK_M = 16 < BLOCK_N and M > 16: program 1's rows start at BLOCK_N, rows 16… stay NaN
    Mistake(ch01.tiled_gemm, Variant(OFFSETS="blocks mixed up"), match="step by the other block size",
            hint="offs_m = pid_m * BLOCK_M"),

    Reference(ch01.implied_mfu, implied_mfu),
    Mistake(ch01.implied_mfu, lambda *args: implied_mfu(*args) / 3, match="forward pass only", hint="6·N·D"),
    Mistake(ch01.implied_mfu, lambda n, d, g, days, p: 6 * n * d / (g * days * 3600 * p), match="used hours",
            hint="86,400"),
    Mistake(ch01.implied_mfu, lambda *args: 100 * implied_mfu(*args), match="not a percentage", hint="6·N·D"),

    Reference(ch01.mfu_from_log, mfu_from_log),
    Reference(ch01.mfu_from_log, llmlab_mfu_from_log),
    Mistake(ch01.mfu_from_log, partial(mfu_from_log, average=statistics.mean), match="the mean step time: the \\d+ "
            "slow steps", hint="a few slow steps must not move it"),
    Mistake(ch01.mfu_from_log, partial(mfu_from_log, first=1), match="the \\d+ warm-up steps are kept",
            hint="drop the first `warmup`"),
    Mistake(ch01.mfu_from_log, partial(mfu_from_log, first=1, average=statistics.mean),
            match="the mean over every step, warm-up included", hint="median of the kept steps"),
    Mistake(ch01.mfu_from_log, lambda log, cfg, peak, warmup: mfu_from_log(log, cfg, peak, warmup, first=warmup),
            match="step \\d+ is kept: .* off by one", hint="drop the first `warmup`"),
    Mistake(ch01.mfu_from_log, partial(mfu_from_log, per_token=six_n), match="attention matmuls are missing: that "
            "is 6·N", hint="12·L·C·T"),
    Mistake(ch01.mfu_from_log, partial(mfu_from_log, per_token=lambda cfg: palm_per_token(cfg) / 3),
            match="forward pass only", hint="6·N + 12·L·C·T"),
    Mistake(ch01.mfu_from_log, partial(mfu_from_log, per_token=lambda cfg: six_n(cfg) / 3), match="that is 2·N",
            hint="6·N + 12·L·C·T"),
    Mistake(ch01.mfu_from_log, partial(mfu_from_log, ms=True), match="1000× too small: the step times are in "
            "milliseconds", hint="ms / 1000"),
    Mistake(ch01.mfu_from_log, partial(mfu_from_log, sequences=True), match="batch counts sequences",
            hint="batch × cfg.block_size"),
    Mistake(ch01.mfu_from_log, partial(mfu_from_log, percent=True), match="not a percentage", hint="a fraction"),
    Mistake(ch01.mfu_from_log, lambda *args, **kwargs: f"{mfu_from_log(*args, **kwargs):.1%}",
            match="expected a number", hint="a fraction"),
]


@pytest.mark.parametrize("check, answer", [(ch01.block_flops, unwritten), (ch01.gemm_roofline, unwritten),
                                           (ch01.tiled_gemm, _unwritten_kernel), (ch01.implied_mfu, unwritten),
                                           (ch01.mfu_from_log, unwritten)])
def test_an_unwritten_answer_is_not_attempted(check, answer, capsys):
    not_attempted(check, answer, capsys=capsys)
