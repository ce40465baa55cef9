"""Check 1.3 (re-exported by llmlab.checks.ch01): a tiled Triton GEMM kernel, written whole by the learner.

    from llmlab.checks import ch01 as check
    check.tiled_gemm(matmul_kernel)             # 1.3 (a @triton.jit kernel, launched here by `launch`)

The learner's kernel has the signature of llmlab's own (`llmlab.kernels.gemm`, less its grouped program order and
fused epilogue): `matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
stride_cm, stride_cn, BLOCK_M, BLOCK_N, BLOCK_K)`, one program per (BLOCK_M, BLOCK_N) tile of C on the 2-D grid
(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)). `launch` runs it as the check does, for the learner's own experiments.

Every run draws `cases()`: 1×1×1, whole tiles on a 2×1 grid, a ragged case with random block sizes, column-major A,
B and C, an fp16 case of integers whose running sum reaches ±4096 before it cancels (exact in fp32, lost in fp16),
and a random fp16 case. C is compared with torch.matmul in float64 (`_tolerances`). Under the Triton interpreter
(the CPU tier) one program costs ~7 ms and one K step ~1.3 ms, so the cases keep to a few programs each: a call
takes well under a second on a 2-core CPU (~0.3 s, busy).

How a wrong kernel is named without reading it: every operand is a strided view into a NaN-filled storage several
times its size, so a load past an edge reads NaN (never another tensor's memory, never past the storage) and a store
past one lands in C's storage where the check looks. When C is wrong, the check compares the whole of C's storage
with what each named mistake would have left there, emulated in float64: A, B or C addressed with its strides
swapped or as if contiguous, A's or B's pointers advanced along the wrong dimension, the program ids swapped or the
tile offsets stepped by the other block size, the pointers never advanced, the accumulator overwritten; and it names
a store outside C, loads past the K edge (C all NaN when K is not a multiple of BLOCK_K), NaN on a case of whole
tiles (addresses outside A or B), and an fp16 accumulator (the integer case comes out 0).
"""

from __future__ import annotations

import ast
import inspect
import itertools
import random
import textwrap
from dataclasses import dataclass

import torch
import triton

from llmlab import runtime
from llmlab.checks import Hint, Mismatch, assert_close, check, fresh_rng

__all__ = ["tiled_gemm", "launch", "cases", "Case", "BLOCKS"]

# (BLOCK_M, BLOCK_N, BLOCK_K) the cases draw from; tl.dot needs each ≥ 16 on a GPU
BLOCKS = ((16, 16, 16), (32, 16, 16), (16, 32, 32), (16, 32, 16))
PAD = 32  # ≥ every block size: a tile hanging over an edge of A, B or C stays in NaN padding
BIG = 64  # the integer case's large entries: 64 · 64 = 4096, where fp16's spacing is 4, so 4096 + 1 rounds to 4096


@dataclass(frozen=True)
class Case:
    """One launch of the learner's kernel: C (M, N) = A (M, K) @ B (K, N)."""

    M: int
    N: int
    K: int
    blocks: tuple[int, int, int] = (16, 16, 16)
    dtype: torch.dtype = torch.float32
    column_major: bool = False  # A, B and C all column-major: their strides must be used
    integer: bool = False  # the cancelling fp16 case (`_integer_operands`)

    @property
    def what(self) -> str:
        bm, bn, bk = self.blocks
        kind = "fp16 integers whose running sum reaches ±4096 and cancels" if self.integer \
            else str(self.dtype).removeprefix("torch.")
        layout = ", all column-major" if self.column_major else ""
        return (f"C = A @ B with A {self.M}×{self.K}, B {self.K}×{self.N}{layout}, {kind}, BLOCK_M={bm}, "
                f"BLOCK_N={bn}, BLOCK_K={bk}")


def cases(rng: random.Random | None = None) -> list[Case]:
    """The cases one check runs, fresh odd sizes every time; fp32 first, then the integer fp16 case, then fp16."""
    rng = rng or fresh_rng()

    def odd(lo: int, hi: int) -> int:
        return rng.randrange(lo | 1, hi, 2)

    return [Case(1, 1, 1),  # one partial tile in every dimension
            Case(32, 16, 32),  # whole tiles only, a 2×1 grid (swapped program ids leave a tile unwritten), 2 K steps
            # ragged M, N and K (never a multiple); BLOCK_M = 16 < BLOCK_N < M + 16: block sizes mixed up show
            Case(odd(17, 48), odd(3, 32), odd(33, 80), rng.choice([b for b in BLOCKS if b[0] < b[1]])),
            Case(odd(17, 40), odd(17, 40), odd(17, 48), rng.choice(BLOCKS), column_major=True),
            Case(odd(3, 24), odd(3, 24), odd(33, 64), integer=True, dtype=torch.float16),  # ≥ 3 K steps of 16
            Case(odd(3, 40), odd(3, 24), odd(17, 64), rng.choice(BLOCKS), dtype=torch.float16)]


# --- the operands: strided views into NaN ---------------------------------------------------------------------

@dataclass
class _Operands:
    a: torch.Tensor  # (M, K) views into a_storage, b_storage, c_storage (1-D, NaN outside the views)
    b: torch.Tensor  # (K, N)
    c: torch.Tensor  # (M, N), NaN until the kernel writes it
    a_storage: torch.Tensor
    b_storage: torch.Tensor
    c_storage: torch.Tensor


def _view(rows: int, cols: int, column_major: bool, size: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A (rows, cols) view, PAD elements of NaN after each row (column), at the start of a NaN storage of `size`."""
    storage = torch.full((size,), float("nan"), dtype=dtype, device=device)
    strides = (1, rows + PAD) if column_major else (cols + PAD, 1)
    return storage.as_strided((rows, cols), strides), storage


def _integer_operands(case: Case, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A (M, K), B (K, N) in fp16 whose products are: ±4096 in the first K block, +1 in each middle block, ∓4096 in
    the last, so C = (number of middle blocks) everywhere. In fp32 every partial sum is an exact integer; an fp16
    accumulator rounds ±4096 + 1 back to ±4096 (spacing 4 above 4096, a tie to even just below), loses every +1,
    and ends at exactly 0. A's other entries are random in {-1, 0, 1}, against zero rows of B."""
    M, N, K, bk = case.M, case.N, case.K, case.blocks[2]
    a = torch.randint(-1, 2, (M, K), generator=g).double()  # (M, K)
    b = torch.zeros(K, N, dtype=torch.float64)  # (K, N)
    sign = torch.randint(0, 2, (M,), generator=g).double() * 2 - 1  # (M,) each row's ±4096
    a[:, 0], b[0] = BIG * sign, BIG
    a[:, K - 1], b[K - 1] = BIG * sign, -BIG  # K - 1 lies in the last block, not the first: K > BLOCK_K
    for start in range(bk, (K - 1) // bk * bk, bk):  # each middle block: one column k with a[:, k]·b[k] = +1
        k = start + int(torch.randint(0, bk, (1,), generator=g))
        a[:, k], b[k] = 1, 1
    return a, b


def _operands(case: Case, rng: random.Random) -> _Operands:
    M, N, K = case.M, case.N, case.K
    # large enough for any element (i, j), i and j below max(M, N, K) + PAD, at any of the strides a mistake uses
    n = max(M, N, K) + 2 * PAD
    size, device = 2 * n * n, runtime.device()
    a, a_storage = _view(M, K, case.column_major, size, case.dtype, device)
    b, b_storage = _view(K, N, case.column_major, size, case.dtype, device)
    c, c_storage = _view(M, N, case.column_major, size, case.dtype, device)
    g = torch.Generator().manual_seed(rng.getrandbits(63))
    if case.integer:
        a_values, b_values = _integer_operands(case, g)
    else:
        a_values, b_values = torch.rand(M, K, generator=g) * 2 - 1, torch.rand(K, N, generator=g) * 2 - 1
    a.copy_(a_values)
    b.copy_(b_values)
    return _Operands(a, b, c, a_storage, b_storage, c_storage)


# --- the launcher -----------------------------------------------------------------------------------------------

def _placeholder_left(kernel) -> bool:
    """Does the kernel still contain the exercise's `raise NotImplementedError(...)`?

    Under the interpreter that raise would surface as an error from the launch; compiled Triton cannot even
    compile a `raise`. So the check reads the kernel's source first and reports "not attempted yet" itself.
    """
    fn = getattr(kernel, "fn", kernel)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id == "NotImplementedError":
                return True
    return False


def launch(kernel, a: torch.Tensor, b: torch.Tensor, *, BLOCK_M: int = 16, BLOCK_N: int = 16, BLOCK_K: int = 16,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """C = A @ B by `kernel` (exercise 1.3's signature) on the 2-D grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)), as the
    check launches it; any strides. `out` (M, N), if given, is written and returned (else a new tensor)."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D torch.Tensor, got {getattr(t, 'shape', type(t).__name__)}")
    if a.shape[1] != b.shape[0] or a.dtype != b.dtype:
        raise ValueError(f"a {tuple(a.shape)} {a.dtype} and b {tuple(b.shape)} {b.dtype}: need a.shape[1] == "
                         "b.shape[0] and one dtype")
    (M, K), N = a.shape, b.shape[1]
    out = torch.empty(M, N, dtype=a.dtype, device=a.device) if out is None else out  # (M, N)
    if M == 0 or N == 0:
        return out
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    try:
        kernel[grid](a, b, out, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0),
                     out.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    except Exception as e:  # the interpreter wraps the kernel's own error: report that one
        if type(e).__name__ == "InterpreterError" and e.__cause__ is not None:
            raise e.__cause__ from None
        raise
    return out


# --- what each named mistake leaves in C's storage, emulated in float64 --------------------------------------------

def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in float64, NaN wherever a NaN of a's row or b's column enters (as in any kernel: NaN · 0 = NaN)."""
    c = a.nan_to_num() @ b.nan_to_num()  # (M, N)
    c[a.isnan().any(1)] = float("nan")
    c[:, b.isnan().any(0)] = float("nan")
    return c


def _stored(ops: _Operands, values: torch.Tensor, strides=None) -> torch.Tensor | None:
    """C's storage, in float64 on the CPU, after a kernel wrote `values` (M, N; NaN: not written) at `strides`."""
    storage = torch.full(ops.c_storage.shape, float("nan"), dtype=torch.float64)
    try:
        view = storage.as_strided(values.shape, strides or ops.c.stride())
    except RuntimeError:
        return None
    written = ~values.isnan()
    view[written] = values[written]
    return storage


def _same(got: torch.Tensor, emulated: torch.Tensor | None) -> bool:
    """NaN in the same places and the rest within 1e-2: far above rounding (≤ 1e-3 even for fp16 C), far below the
    O(0.1–1) differences between two different mistakes on uniform [-1, 1) inputs."""
    if emulated is None or not torch.equal(got.isnan(), emulated.isnan()):
        return False
    finite = ~got.isnan()
    return bool(torch.allclose(got[finite], emulated[finite], rtol=1e-2, atol=1e-2))


@dataclass(frozen=True)
class _Addressing:
    """How a kernel addresses an operand: element (i, j) of K step s at s·BLOCK_K·advance + i·strides[0] +
    j·strides[1] (the K index counted within the step; C has no steps), and the mistake that is, if any."""

    strides: tuple[int, int]
    advance: int = 0
    mistake: str = ""  # "" for the right addressing, else what it does wrong, in words
    key: str = "strides"  # the mistake's hint: "strides" or "advance"


def _addressings(name: str, x: torch.Tensor) -> list[_Addressing]:
    """The right addressing of operand `name` ("A", "B" or "C") and the wrong ones a kernel may use: the stride pair
    swapped or a contiguous matrix's (advancing with the same or with the right stride), or, for A and B, the
    pointers advanced along the other dimension."""
    own, swapped, dense = x.stride(), x.stride()[::-1], (x.shape[1], 1)
    if name == "C":
        return [_Addressing(own), _Addressing(swapped, mistake="C written with its two strides swapped"),
                _Addressing(dense, mistake="C written as if contiguous (row stride N, column stride 1)")]
    k_dim = 1 if name == "A" else 0  # A's columns, B's rows run along K
    k_stride, other = ("stride_ak", "stride_am") if name == "A" else ("stride_bk", "stride_bn")
    sideways = "rows down" if name == "A" else "columns across"
    out = [_Addressing(own, own[k_dim])]
    for strides, words in ((swapped, "with its two strides swapped"),
                           (dense, "as if contiguous (row stride = its number of columns, column stride 1)")):
        for advance in dict.fromkeys((own[k_dim], strides[k_dim])):
            out.append(_Addressing(strides, advance, f"{name} read {words}"))
    out.append(_Addressing(own, own[1 - k_dim], f"{name}'s pointers advanced by BLOCK_K·{other} (BLOCK_K {sideways}) "
                                                f"instead of BLOCK_K·{k_stride}", key="advance"))
    return out


def _read(storage: torch.Tensor, shape: tuple[int, int], how: _Addressing, bk: int, k_dim: int):
    """The matrix a K loop addressing `storage` as `how` reads, step by step (each masked to the K left), in float64
    on the CPU; None when it would reach beyond the storage (no kernel the check launched read there)."""
    K = shape[k_dim]
    steps = []
    for start in range(0, K, bk):
        width = min(bk, K - start)
        step_shape = (shape[0], width) if k_dim == 1 else (width, shape[1])
        try:
            steps.append(storage.as_strided(step_shape, how.strides, storage_offset=start * how.advance))
        except RuntimeError:
            return None
    return torch.cat(steps, dim=k_dim).double().cpu()


def _addressing_mistake(ops: _Operands, case: Case, got: torch.Tensor, right: torch.Tensor) -> _Addressing | None:
    """The wrong addressing(s) whose C storage is `got` (as one _Addressing: the mistakes joined), else None."""
    bk = case.blocks[2]
    operands = {"A": _addressings("A", ops.a), "B": _addressings("B", ops.b), "C": _addressings("C", ops.c)}
    for how_a, how_b, how_c in itertools.product(*operands.values()):
        wrong = [h for h in (how_a, how_b, how_c) if h.mistake]
        if not wrong:
            continue
        a = _read(ops.a_storage, ops.a.shape, how_a, bk, k_dim=1)
        b = _read(ops.b_storage, ops.b.shape, how_b, bk, k_dim=0)
        if a is None or b is None:
            continue
        product = _product(a, b)  # (M, N)
        if product.isnan().all():
            continue  # every element NaN whichever way C is written: this emulation tells nothing
        emulated = _stored(ops, product, how_c.strides)
        if _same(right, emulated) or not _same(got, emulated):
            continue  # the same C as a right kernel's (a degenerate shape), or not what this kernel did
        key = "advance" if any(h.key == "advance" for h in wrong) else "strides"
        return _Addressing(how_c.strides, mistake=" and ".join(h.mistake for h in wrong), key=key)
    return None


def _unadvanced(a: torch.Tensor, b: torch.Tensor, bk: int) -> torch.Tensor:
    """C of a K loop whose pointers stay on the first block: step s adds that block, masked to K - s·BLOCK_K."""
    K = a.shape[1]
    return sum(a[:, :min(bk, K - start)] @ b[:min(bk, K - start)] for start in range(0, K, bk))


def _last_block(a: torch.Tensor, b: torch.Tensor, bk: int) -> torch.Tensor:
    """C of a K loop that overwrites the accumulator: only the last K block's product survives."""
    start = (a.shape[1] - 1) // bk * bk
    return a[:, start:] @ b[start:]


def _tolerances(case: Case, a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(rtol, atol) between the kernel's C and the float64 product of the same inputs (exact to ~2⁻⁵³).

    The kernel sums K products in an fp32 accumulator: each product and each addition on the way to one element
    rounds once (u = 2⁻²⁴; fp16 products are exact in fp32), at most K + 1 roundings on any path, so the error is at
    most (K + 2)·u·Σ|aᵢbᵢ| (the classic γ bound, with room), and Σ|aᵢbᵢ| ≤ s = max(|A| @ |B|). Compiled Triton
    multiplies fp32 tiles as TF32 by default: each operand keeps 10 mantissa bits, and Hopper's wgmma truncates the
    other 13 (up to 2⁻¹⁰ relative each, 2⁻⁹ per product): + 2⁻⁹·s. An fp16 C is rounded once more, by at most half
    its spacing: 2⁻¹¹ relative (rtol), doubling atol for the (1 + 2⁻¹¹) it scales, plus 2⁻²⁴, fp16's subnormal
    spacing, for results that round to 0. The integer case is exact in fp32, so its bound is met with room; every
    named mistake is off by O(1) or NaN (the integer case's fp16 accumulator: by ≥ 1).
    """
    s = (a.double().abs() @ b.double().abs()).max().item()
    atol = (case.K + 2) * 2.0**-24 * s
    if case.dtype == torch.float16:
        return 2.0**-11, 2 * atol + 2.0**-24
    if not runtime.triton_interpreted():
        atol += 2.0**-9 * s
    return 0.0, atol


# --- the named mistakes' hints -------------------------------------------------------------------------------------

_HINTS = {
    "strides": Hint(
        nudge="look at how your pointers turn a row index and a column index into an address, for A, B and C",
        idea="every matrix comes with its own two strides — a transposed or sliced one is not contiguous: element "
             "(i, j) of A is at a_ptr + i·stride_am + j·stride_ak, never at i·K + j, and never with the pair swapped",
        formula="a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak; b_ptrs = b_ptr + "
                "offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn; c_ptrs = c_ptr + offs_m[:, None] * "
                "stride_cm + offs_n[None, :] * stride_cn"),
    "tile offsets": Hint(
        nudge="look at how each program finds its tile: which program id, and which block size, for the rows?",
        idea="the launch grid is (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)): program (i, j) — i = program_id(axis=0) — owns "
             "rows i·BLOCK_M … i·BLOCK_M + BLOCK_M − 1 and columns j·BLOCK_N … of C; anything else computes some "
             "tiles twice and others never",
        formula="pid_m = tl.program_id(axis=0); pid_n = tl.program_id(axis=1); offs_m = pid_m * BLOCK_M + "
                "tl.arange(0, BLOCK_M); offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)"),
    "store mask": Hint(
        nudge="look at your tl.store: the last tile in each direction hangs over C's edge",
        idea="a store writes the whole (BLOCK_M, BLOCK_N) tile unless it is masked, so the rows ≥ M and columns ≥ N "
             "of an edge tile land in whatever memory follows C: mask the store to the part of the tile inside C",
        formula="tl.store(c_ptrs, c, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))"),
    "K edge": Hint(
        nudge="look at the masks of the two loads in your K loop: what stops the last step from reading past "
              "column K − 1 of A and row K − 1 of B?",
        idea="when K is not a multiple of BLOCK_K the last step has only K − k·BLOCK_K columns of A (rows of B) left: "
             "mask both loads along K too, with other=0.0 so the missing terms add nothing",
        formula="k_left = K - k * BLOCK_K; a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < "
                "k_left), other=0.0); b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), "
                "other=0.0)"),
    "advance": Hint(
        nudge="look at the end of your K loop's body: where do a_ptrs and b_ptrs point in the next step?",
        idea="each step must move both pointer tiles one block along K: A's BLOCK_K columns to the right, B's BLOCK_K "
             "rows down, each by its own stride along K",
        formula="a_ptrs += BLOCK_K * stride_ak; b_ptrs += BLOCK_K * stride_bk"),
    "overwrite": Hint(
        nudge="look at the line with tl.dot: does it add to acc, or replace it?",
        idea="C's tile is the sum over every K step of one tile product; assigning each step's product to acc keeps "
             "only the last",
        formula="acc = tl.dot(a, b, acc) (or acc += tl.dot(a, b))"),
    "accumulator": Hint(
        nudge="look at the dtype of your accumulator when A and B are fp16",
        idea="fp16 has 11 significant bits: 4096 + 1 rounds back to 4096, so a long sum in fp16 loses its small "
             "terms. Tensor cores multiply fp16 tiles but accumulate in fp32; cast to C's dtype once, at the store",
        formula="acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32); in the loop acc = tl.dot(a, b, acc); at the "
                "end tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=...)"),
}


def _judge(case: Case, ops: _Operands, want: torch.Tensor) -> None:
    """Pass when C (and nothing outside it) holds `want` (float64 A @ B, (M, N)) within `_tolerances`; else raise a
    Mismatch naming what C's storage shows, trying the named mistakes in turn."""
    M, N, K = case.M, case.N, case.K
    bm, bn, bk = case.blocks
    got_storage = ops.c_storage.double().cpu()
    got = ops.c.double().cpu()  # (M, N)
    nan = got.isnan()
    outside = ~got_storage.isnan() & ~_footprint(ops)
    rtol, atol = _tolerances(case, ops.a, ops.b)
    if not nan.any() and not outside.any() and torch.allclose(got, want, rtol=rtol, atol=atol):
        return
    right = _stored(ops, want)
    wrong = _addressing_mistake(ops, case, got_storage, right)
    if wrong:
        fix = "move each pointer tile BLOCK_K times its own stride along K" if wrong.key == "advance" \
            else "address each with its own stride arguments"
        raise Mismatch(f"{case.what}: C is what {wrong.mistake} gives — A here has strides {ops.a.stride()}, B "
                       f"{ops.b.stride()}, C {ops.c.stride()}: {fix}", mistake=wrong.key, hint=_HINTS[wrong.key])
    tiles = _tile_mistake(case, got_storage, ops, want)
    if tiles:
        raise Mismatch(f"{case.what}: {tiles}", mistake="tile offsets", hint=_HINTS["tile offsets"])
    if outside.any():
        raise Mismatch(f"{case.what}: {int(outside.sum())} values were written outside C's {M}×{N}, where the edge "
                       f"tiles (BLOCK_M={bm}, BLOCK_N={bn}) hang over it: the store is not masked to rows < M and "
                       "columns < N", mistake="store mask", hint=_HINTS["store mask"])
    if nan.any() and not (M % bm or N % bn or K % bk):
        raise Mismatch(f"{case.what}: {int(nan.sum())} of {nan.numel()} values of C are NaN, though every tile is "
                       "whole here and no mask matters: your loads read outside A or B, which are surrounded by NaN, "
                       f"so the addresses are off — A here has strides {ops.a.stride()}, B {ops.b.stride()}, C "
                       f"{ops.c.stride()}: address element (i, j) with the stride arguments", mistake="strides",
                       hint=_HINTS["strides"])
    if nan.all() and K % bk:
        raise Mismatch(f"{case.what}: every value of C is NaN — K={K} is not a multiple of BLOCK_K={bk}, so the last "
                       f"K step has only {K % bk} valid column(s) of A and row(s) of B, and a load without a mask on "
                       "the K edge read the NaN around them", mistake="K edge", hint=_HINTS["K edge"])
    if nan.any():
        rows, cols = nan.any(1).nonzero().flatten().tolist(), nan.any(0).nonzero().flatten().tolist()
        raise Mismatch(f"{case.what}: {int(nan.sum())} of {nan.numel()} values of C are NaN (rows {rows[:3]}…, "
                       f"columns {cols[:3]}…): a tile was never stored, or a load read outside A or B, which are "
                       "surrounded by NaN here")
    a, b = ops.a.double().cpu(), ops.b.double().cpu()
    try:
        assert_close(got, want, what=case.what, rtol=rtol, atol=atol)
    except Mismatch as e:
        if K > bk and _same(got, _unadvanced(a, b, bk)):
            raise Mismatch(f"{e}: C is what re-reading the first K block in every step gives: a_ptrs and b_ptrs are "
                           "never advanced along K", mistake="advance", hint=_HINTS["advance"]) from None
        if K > bk and _same(got, _last_block(a, b, bk)):
            raise Mismatch(f"{e}: C is only the last K block's product: acc is overwritten instead of accumulated",
                           mistake="overwrite", hint=_HINTS["overwrite"]) from None
        if case.integer and not got.any():
            raise Mismatch(f"{e}: C is 0 everywhere, exactly what an fp16 accumulator gives here (±4096 + 1 rounds "
                           "back to ±4096, so each middle step's +1 is lost before the last step cancels the ±4096): "
                           "the accumulator must be fp32", mistake="accumulator", hint=_HINTS["accumulator"]) from None
        raise


def _rows(count: int, step: int, block: int, size: int) -> torch.Tensor:
    """The indices < size that `count` programs cover when program p owns p·step … p·step + block − 1."""
    covered = torch.zeros(size, dtype=torch.bool)
    for p in range(count):
        covered[p * step:p * step + block] = True
    return covered


def _tile_mistake(case: Case, got: torch.Tensor, ops: _Operands, want: torch.Tensor) -> str | None:
    """What is wrong with the tiles the programs own, when C's storage (`got`) shows it: the program ids swapped,
    or the tile offsets stepped by the other dimension's block size; else None."""
    M, N = case.M, case.N
    bm, bn, _ = case.blocks
    grid_m, grid_n = triton.cdiv(M, bm), triton.cdiv(N, bn)
    rows_off, cols_off = "the row offsets step by the other block size (pid_m·BLOCK_N)", \
        "the column offsets step by the other block size (pid_n·BLOCK_M)"
    candidates = [] if bm == bn else [  # (rows written, columns written, what went wrong)
        (_rows(grid_m, bn, bm, M), _rows(grid_n, bn, bn, N), rows_off),
        (_rows(grid_m, bm, bm, M), _rows(grid_n, bm, bn, N), cols_off),
        (_rows(grid_m, bn, bm, M), _rows(grid_n, bm, bn, N), f"{rows_off}, and {cols_off}")]
    if grid_m != grid_n:  # program (p0, p1) computes tile (p1, p0)
        candidates.append((_rows(grid_n, bm, bm, M), _rows(grid_m, bn, bn, N),
                           f"on a grid of {grid_m}×{grid_n} programs, program_id(axis=0) was taken for the columns "
                           "of tiles and axis 1 for the rows"))
    for rows, cols, words in candidates:
        if rows.all() and cols.all():
            continue  # every element written: the same C as a right kernel's
        emulated = torch.full_like(want, float("nan"))  # (M, N): the rows and columns written hold the right C
        emulated[rows[:, None] & cols[None, :]] = want[rows[:, None] & cols[None, :]]
        if _same(got, _stored(ops, emulated)):
            return (f"only {int(rows.sum())} of C's {M} rows and {int(cols.sum())} of its {N} columns were written: "
                    + words)
    return None


def _footprint(ops: _Operands) -> torch.Tensor:
    """The elements of C's storage that C itself occupies (bool, on the CPU)."""
    inside = torch.zeros(ops.c_storage.shape, dtype=torch.bool)
    inside.as_strided(ops.c.shape, ops.c.stride()).fill_(True)
    return inside


@check("1.3", "a tiled Triton GEMM", hint=Hint(
    nudge="run your kernel on a small case of your own with check.launch(matmul_kernel, a, b) and compare it with "
          "a @ b: which rows, columns or tiles differ?",
    idea="each program owns one tile of C: its row and column offsets from its two program ids, pointer tiles into "
         "A and B from the offsets and the strides, a K loop of masked loads whose tl.dot adds into an fp32 "
         "accumulator while both pointer tiles move one block along K, and one masked store",
    formula="offs_m = pid_m·BLOCK_M + tl.arange(0, BLOCK_M) (likewise offs_n), offs_k = tl.arange(0, BLOCK_K); "
            "a_ptrs = a_ptr + offs_m[:, None]·stride_am + offs_k[None, :]·stride_ak (likewise b_ptrs); "
            "acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32); per step k: loads masked to rows < M, columns < N "
            "and offs_k < K − k·BLOCK_K with other=0.0, acc = tl.dot(a, b, acc), a_ptrs += BLOCK_K·stride_ak, "
            "b_ptrs += BLOCK_K·stride_bk; then tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] "
            "< M) & (offs_n[None, :] < N))"))
def tiled_gemm(kernel):
    """`kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M, BLOCK_N, BLOCK_K)`: one program per (BLOCK_M, BLOCK_N) tile of C on a 2-D grid."""

    import llmlab.kernels  # noqa: F401  (interpreted Triton on the CPU tier, before anything is launched)

    if _placeholder_left(kernel):
        raise NotImplementedError("Exercise 1.3")
    rng = fresh_rng()
    for case in cases(rng):
        ops = _operands(case, rng)
        bm, bn, bk = case.blocks
        launch(kernel, ops.a, ops.b, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, out=ops.c)
        _judge(case, ops, ops.a.double().cpu() @ ops.b.double().cpu())  # against torch.matmul in float64
