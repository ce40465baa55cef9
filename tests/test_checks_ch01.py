"""Chapter 1's exercise checks (llmlab.checks.ch01): each passes the reference answer, reports an unwritten
answer as not attempted, and fails a plausible wrong answer with a message naming the mistake and the hint."""


import llmlab.kernels  # noqa: F401  (first: interpreted Triton on the CPU tier, before any kernel below)
import pytest
import triton
import triton.language as tl
from check_answers import Mistake, Reference
from grading import not_attempted

from llmlab.checks import ch01


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
            MASK_K: tl.constexpr, ADVANCE: tl.constexpr, ACCUMULATE: tl.constexpr):
    """The exercise's kernel with switches for the three classic mistakes (all True: the right answer)."""
    pid_m = tl.program_id(axis=0)
    pid_n = tl.program_id(axis=1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
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
        if ADVANCE:
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


class Variant:
    """`_kernel` launched with its mistake switches set, looking to the check like a learner's kernel."""

    def __init__(self, **switches):
        self.switches = dict(MASK_K=True, ADVANCE=True, ACCUMULATE=True) | switches
        self.fn = _kernel.fn

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _kernel[grid](*args, **kwargs, **self.switches)


@triton.jit
def _unwritten_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                      stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    for _k in range(0, tl.cdiv(K, BLOCK_K)):
        raise NotImplementedError("Exercise 1.3: The Triton GEMM's K loop")


def test_k_loop_shapes_cover_the_edges():
    shapes = ch01.k_loop_shapes()
    block_k = ch01.K_LOOP_BLOCKS["BLOCK_K"]
    assert (1, 1, 1) in shapes and any(K % block_k == 0 for _, _, K in shapes)
    assert sum(K % block_k != 0 and K > block_k for _, _, K in shapes) >= 2  # partial last block after whole ones


# --- 1.4 ----------------------------------------------------------------------------------------------------

def implied_mfu(n_params, tokens, gpus, days, peak):
    return 6 * n_params * tokens / (gpus * days * 86_400 * peak)


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

    Reference(ch01.gemm_k_loop, Variant()),
    # K = 1 (the first shape) is not a multiple of BLOCK_K: the unmasked loads read the NaN around A and B
    Mistake(ch01.gemm_k_loop, Variant(MASK_K=False), match="values are NaN.*not a multiple of BLOCK_K",
            hint="the K edge offs_k < K - k·BLOCK_K"),
    Mistake(ch01.gemm_k_loop, Variant(ADVANCE=False), match="never advanced along K", hint="advance a_ptrs"),
    Mistake(ch01.gemm_k_loop, Variant(ACCUMULATE=False), match="overwritten instead of accumulated",
            hint="acc = tl.dot(a, b, acc)"),

    Reference(ch01.implied_mfu, implied_mfu),
    Mistake(ch01.implied_mfu, lambda *args: implied_mfu(*args) / 3, match="forward pass only", hint="6·N·D"),
    Mistake(ch01.implied_mfu, lambda n, d, g, days, p: 6 * n * d / (g * days * 3600 * p), match="used hours",
            hint="86,400"),
    Mistake(ch01.implied_mfu, lambda *args: 100 * implied_mfu(*args), match="not a percentage", hint="6·N·D"),
]


@pytest.mark.parametrize("check, answer", [(ch01.block_flops, unwritten), (ch01.gemm_roofline, unwritten),
                                           (ch01.gemm_k_loop, _unwritten_kernel), (ch01.implied_mfu, unwritten)])
def test_an_unwritten_answer_is_not_attempted(check, answer, capsys):
    not_attempted(check, answer, capsys=capsys)
