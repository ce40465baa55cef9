"""The vector_add Triton kernel (under the interpreter on CPU): any size, every dtype, every element written,
and bad input refused with the argument named."""

import functools
import json
import random
import warnings

import pytest
import torch
from llmlab.kernels import vector_add

from llmlab import bench, cli, runtime

DEVICE = runtime.device()
DTYPES = vector_add.SUPPORTED_DTYPES


def assert_exact(out, x, y):
    """One addition, rounded once to the dtype, as PyTorch does: the results must be identical, so no
    tolerance (NaN where PyTorch gives NaN — never the poison left in an unwritten element)."""
    torch.testing.assert_close(out, vector_add.reference(x, y), rtol=0, atol=0, equal_nan=True)


def poisoned_like(x):
    return torch.full_like(x, float("nan"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [0, 1, 127, 1024, 1025, 5000])
def test_matches_reference_and_writes_every_element(n, dtype):
    x, y = (torch.randn(n, device=DEVICE).to(dtype) for _ in range(2))
    out = poisoned_like(x)
    assert vector_add.add(x, y, out=out) is out
    assert not out.isnan().any(), "an element of out was never written"
    assert_exact(out, x, y)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_sizes_shapes_and_block_sizes(dtype):
    rng = random.Random(1234)
    gen = torch.Generator().manual_seed(1234)
    shapes = [(rng.randint(1, 20000),)] + [tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 3)))
                                           for _ in range(7)]
    for shape in shapes:
        block = 2 ** rng.randint(4, 10)
        x, y = (torch.randn(shape, generator=gen).to(DEVICE, dtype) for _ in range(2))
        out = vector_add.add(x, y, block_size=block)
        assert out.shape == x.shape and out.dtype == dtype
        assert_exact(out, x, y)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values_and_wide_magnitudes(dtype):
    """Infinities, NaN, signed zeros, the largest finite value (the sum overflows to inf), tiny and huge
    magnitudes: where the interpreter's bf16 path (see EMULATE_BF16) must round exactly as PyTorch does."""
    finfo = torch.finfo(dtype)
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, finfo.max, -finfo.max,
                            finfo.tiny, finfo.eps], dtype=torch.float32)
    x = torch.cat([special, torch.randn(1000) * torch.logspace(-30, 30, 1000)]).to(DEVICE, dtype)
    y = torch.cat([torch.tensor([1.0, float("inf"), 1.0, -0.0, -0.0, finfo.max, -1.0, finfo.tiny, 1.0]),
                   torch.randn(1000)]).to(DEVICE, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # interpreted, NumPy warns on inf - inf and overflow
        out = vector_add.add(x, y)
    assert_exact(out, x, y)


def test_non_contiguous_inputs_are_made_contiguous():
    x = torch.randn(33, 65, device=DEVICE).t()  # a transposed view
    y = torch.randn(65, 33, device=DEVICE)
    assert not x.is_contiguous()
    assert_exact(vector_add.add(x, y), x, y)


def test_in_place_into_x():
    x, y = torch.randn(3000, device=DEVICE), torch.randn(3000, device=DEVICE)
    expected = x + y
    vector_add.add(x, y, out=x)
    assert_exact(x, expected, torch.zeros_like(x))


@pytest.mark.parametrize("bad, match", [
    (lambda x: ([1.0, 2.0], x), "x must be a torch.Tensor"),
    (lambda x: (x, 3.0), "y must be a torch.Tensor"),
    (lambda x: (x, x[:-1]), r"y.shape=\(9,\) differs from x.shape=\(10,\)"),
    (lambda x: (x, x.half()), "y.dtype=torch.float16 differs from x.dtype=torch.float32"),
    (lambda x: (x.long(), x.long()), "x.dtype=torch.int64 is not supported"),
    (lambda x: (x.double(), x.double()), "x.dtype=torch.float64 is not supported"),
])
def test_bad_inputs_name_the_argument(bad, match):
    x, y = bad(torch.randn(10, device=DEVICE))
    with pytest.raises(ValueError, match=match):
        vector_add.add(x, y)


def test_bad_out_and_block_size():
    x = torch.randn(10, device=DEVICE)
    with pytest.raises(ValueError, match=r"out.shape=\(11,\) differs"):
        vector_add.add(x, x, out=torch.empty(11, device=DEVICE))
    with pytest.raises(ValueError, match="out.dtype=torch.bfloat16 differs"):
        vector_add.add(x, x, out=torch.empty(10, device=DEVICE, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be contiguous"):
        vector_add.add(x.view(2, 5), x.view(2, 5), out=torch.empty(5, 2, device=DEVICE).t())
    for block in (0, 1000, -4, 2.0, True):
        with pytest.raises(ValueError, match=rf"block_size={block!r} must be a .*power of two"):
            vector_add.add(x, x, block_size=block)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to mix devices")
def test_mixed_devices_refused():
    with pytest.raises(ValueError, match="y is on cpu but x is on cuda:0"):
        vector_add.add(torch.randn(4, device="cuda"), torch.randn(4))


def test_bench_rows():
    rows = vector_add.bench(sizes=(100, 3000))
    assert [r["size"] for r in rows] == [100, 3000]
    for r in rows:
        assert r["impl_ms"] > 0 and r["peer_ms"] > 0
        assert r["ratio"] > 0 and r["spread"] >= 0 and r["load"]  # per-round ratios' median, spread, machine load
    with pytest.raises(ValueError, match=r"sizes\[1\]=0 must be a positive int"):
        vector_add.bench(sizes=(10, 0))


def test_llmlab_bench_vector_add(tmp_path, monkeypatch, capsys):
    """`llmlab bench vector_add --json PATH`: table, one JSON line, the file; an unknown name refused."""
    monkeypatch.setattr(vector_add, "bench", functools.partial(vector_add.bench, sizes=(100, 2000)))
    path = tmp_path / "runs" / "vector_add.json"
    assert cli.main(["bench", "vector_add", "--json", str(path)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].split() == ["impl", "peer", "size", "dtype", "impl_ms", "peer_ms", "ratio", "spread", "load",
                                  "impl_GB/s", "peer_GB/s"]
    record = json.loads(path.read_text())
    assert json.loads(next(line for line in printed if line.startswith("{"))) == record
    assert record["bench"] == "vector_add" and record["sizes"] == [100, 2000]
    assert record["tier"] == runtime.tier().name and set(record["versions"]) >= {"python", "torch", "triton"}
    assert [r["size"] for r in record["results"]] == [100, 2000]

    with pytest.raises(ValueError, match="bench 'nope' unknown; known benches: .*vector_add"):
        bench.run("nope")
    assert cli.main(["bench", "nope"]) == 2
