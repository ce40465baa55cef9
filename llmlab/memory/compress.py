"""Activation compression: store what autograd saves for backward in 8 bits (or fewer), dequantize on use.

Saved activations dominate training memory (see `llmlab.memory.planner`). They are needed only to compute
gradients, and gradients tolerate noise (SGD is noisy anyway), so they can be kept in low precision:
Chen et al. 2021, "ActNN: Reducing Training Memory Footprint via 2-Bit Activation Compressed Training"
(per-group min-max quantization of every saved tensor; 2-bit with little loss).

Here the saved-tensor hooks do it. `pack` flattens a saved float tensor, cuts it into groups of
`group_size` elements and stores each group as integer codes plus its minimum and step, both fp32:

    step = (max - min) / (2^bits - 1)        code = round((x - min) / step)  in [0, 2^bits - 1]
    x̂ = min + code · step                     |x - x̂| <= step / 2   (half a step, for every element)

(with bits < 8, 8/bits codes share a byte); `unpack` rebuilds x̂ in the tensor's dtype when backward needs
it. So the forward is exact, and the gradient is computed from slightly wrong activations: approximate.

Bytes per element: bits/8 for the codes + 8/group_size for (min, step): with 8 bits and groups of 128,
1.0625 bytes instead of 4 (fp32: -73%) or 2 (bf16/fp16: -47%). The material's "75% less" is the fp32 case
without the scales; against half precision, 8 bits save half at most. Integer and bool tensors (token ids,
masks), parameters, tensors with an inf or NaN (they have no code), and tensors smaller than one group are
kept as they are.

    from llmlab.memory.compress import compressed_activations
    with compressed_activations(bits=8) as ca:
        loss = model(x, y)[1]
    loss.backward()                       # the backward unpacks (dequantizes) what it needs
    ca.original_bytes, ca.stored_bytes    # what autograd would have held, what it holds
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass

import torch

from llmlab import runtime, validation
from llmlab.data import MarkovSource, SyntheticDataset
from llmlab.memory import measure
from llmlab.model import GPT, GPTConfig
from llmlab.timing import compare

__all__ = ["BITS", "Packed", "quantize", "dequantize", "compressed_activations", "CompressedActivations",
           "saved_bytes", "loss_curves", "bench"]

BITS = (2, 4, 8)  # code widths that fill a byte exactly


def _check(bits, group_size) -> None:
    validation.one_of("bits", bits, BITS)
    validation.integer("group_size", group_size, low=8 // bits, hint="(codes per byte)")
    if group_size % (8 // bits):
        raise ValueError(f"group_size={group_size} must be a multiple of {8 // bits} (codes per byte at {bits} bits)")


@dataclass(frozen=True)
class Packed:
    """A quantized tensor: `codes` (groups, group_size·bits/8) uint8, `low` and `step` (groups, 1) fp32."""

    codes: torch.Tensor
    low: torch.Tensor
    step: torch.Tensor
    bits: int
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.low, self.step))


def _quantize(x: torch.Tensor, bits: int, group_size: int) -> Packed | None:
    """`quantize`, or None when x holds an inf or NaN (no code represents them)."""
    n, levels, per_byte = x.numel(), 2**bits - 1, 8 // bits
    flat = x.detach().reshape(-1).float()  # (n,)
    if n % group_size:  # pad with the last value: it cannot widen the last group's range
        flat = torch.cat([flat, flat[-1:].expand(group_size - n % group_size)])
    groups = flat.view(-1, group_size)  # (g, G)
    low = groups.amin(dim=1, keepdim=True)  # (g, 1)
    step = (groups.amax(dim=1, keepdim=True) - low) / levels  # (g, 1); inf or NaN if x is not finite
    if not bool(torch.isfinite(step).all()):
        return None
    step = torch.where(step > 0, step, torch.ones_like(step))  # a constant group: every code is 0
    codes = ((groups - low) / step).round_().clamp_(0, levels).to(torch.uint8)  # (g, G)
    if per_byte > 1:  # code j of each run of per_byte codes goes to bits [j·bits, (j+1)·bits) of a byte
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=x.device)  # (per_byte,)
        codes = (codes.view(codes.shape[0], -1, per_byte) << shifts).sum(dim=2, dtype=torch.uint8)  # (g, G/pb)
    return Packed(codes, low, step, bits, x.shape, x.dtype)


def quantize(x: torch.Tensor, bits: int = 8, group_size: int = 128) -> Packed:
    """Per-group min-max quantization of a finite float tensor `x` to `bits`-bit codes (see the module
    docstring); the last group is padded with x's last value."""
    _check(bits, group_size)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() == 0:
        raise ValueError(f"x must be a non-empty floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    packed = _quantize(x, bits, group_size)
    if packed is None:
        raise ValueError("x holds an inf or NaN: min-max quantization has no code for them")
    return packed


def dequantize(p: Packed) -> torch.Tensor:
    """x̂ = low + code · step, in the original shape and dtype."""
    codes, per_byte = p.codes, 8 // p.bits
    if per_byte > 1:
        shifts = torch.arange(0, 8, p.bits, dtype=torch.uint8, device=codes.device)  # (per_byte,)
        codes = ((codes.unsqueeze(-1) >> shifts) & (2**p.bits - 1)).flatten(1)  # (g, G)
    x = p.low + codes.float() * p.step  # (g, G)
    return x.view(-1)[:math.prod(p.shape)].view(p.shape).to(p.dtype)


def _whole_storage(t: torch.Tensor) -> torch.Tensor:
    """All of `t`'s storage as a 1-D tensor of t's dtype. Views of one storage (softmax's output, and the
    same memory as a (B·h, T, T) batch for att @ v) are then packed once, and each is rebuilt from it."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), 0, (n,), (1,))


class CompressedActivations:
    """The context `compressed_activations` returns: installs the hooks and keeps the accounts.

    original_bytes: what autograd would hold without compression (as `measure.SavedActivations` counts);
    stored_bytes: what it holds: packed codes and scales + the tensors kept as they were. Compression works
    on storages, like the counts: each storage is packed once however many views of it are saved.
    """

    def __init__(self, bits: int = 8, group_size: int = 128):
        _check(bits, group_size)
        self.bits, self.group_size = bits, group_size
        self._original, self._kept = measure.StorageCounter(), measure.StorageCounter()
        self._packed_bytes = 0
        self.compressed = self.kept = 0  # tensors packed / kept as they were
        self._cache: dict[tuple, tuple[weakref.ref, int, Packed]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    @property
    def original_bytes(self) -> int:
        return self._original.bytes

    @property
    def stored_bytes(self) -> int:
        return self._packed_bytes + self._kept.bytes

    @property
    def reduction(self) -> float:
        """1 - stored / original: the fraction of saved-activation memory compression removed."""
        return 1 - self.stored_bytes / self.original_bytes if self.original_bytes else 0.0

    def _pack(self, t: torch.Tensor):
        if measure.is_parameter(t):
            return t  # model state: held anyway, and its gradient would suffer
        self._original.add(t)
        key = measure.storage_key(t)
        hit = self._cache.get(key)
        # The same live storage, unmodified since it was packed (the version counter, shared by its views).
        if hit is not None and hit[0]() is t.untyped_storage() and hit[1] == t._version:
            return hit[2], t.shape, t.stride(), t.storage_offset()
        packed = None
        if t.is_floating_point() and t.numel() >= self.group_size:
            with torch.no_grad():
                packed = _quantize(_whole_storage(t), self.bits, self.group_size)
        if packed is None:  # ids, masks, tiny tensors, non-finite values: kept as they are
            self.kept += 1
            self._kept.add(t)
            return t
        self._cache[key] = (weakref.ref(t.untyped_storage()), t._version, packed)
        self.compressed += 1
        self._packed_bytes += packed.nbytes
        return packed, t.shape, t.stride(), t.storage_offset()

    @staticmethod
    def _unpack(saved):
        if isinstance(saved, torch.Tensor):
            return saved
        packed, shape, stride, offset = saved
        return dequantize(packed).as_strided(shape, stride, offset)  # the saved view of the storage

    def __enter__(self) -> CompressedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def compressed_activations(bits: int = 8, group_size: int = 128) -> CompressedActivations:
    """Within the `with` block, every float tensor autograd saves is stored in `bits`-bit codes."""
    return CompressedActivations(bits, group_size)


# --- measured: bytes, loss curves, time (`llmlab bench compress`; claim C11 uses them, llmlab.claims.ch03) ---

def _tiny_batch(dtype: torch.dtype, batch_size: int, seq_len: int, device):
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny")).to(device=device, dtype=dtype)
    data = SyntheticDataset(MarkovSource(model.config.vocab_size, seed=0), batch_size, seq_len)
    x, y = (t.to(device) for t in data.get_batch(0))  # (B, T) each
    return model, x, y


def saved_bytes(dtype: torch.dtype = torch.float32, bits: int = 8, batch_size: int = 8, seq_len: int = 64,
                device="cpu") -> dict[str, int]:
    """Saved-activation bytes of one forward of the tiny GPT in `dtype`: as measure.SavedActivations
    counts them uncompressed, and as `compressed_activations(bits)` stores them."""
    model, x, y = _tiny_batch(dtype, batch_size, seq_len, device)
    with measure.SavedActivations() as plain:
        model(x, y)
    with compressed_activations(bits) as ca:
        model(x, y)
    return {"uncompressed": plain.bytes, "compressed": ca.stored_bytes}


def loss_curves(steps: int = 50, bits: int = 8, batch_size: int = 8, seq_len: int = 32, lr: float = 3e-3,
                device="cpu") -> dict[str, list[float]]:
    """The tiny GPT trained `steps` AdamW steps from the same init on the same batches (a bigram Markov
    chain), with saved activations uncompressed and compressed to `bits`: {"uncompressed", "compressed"}."""

    curves = {}
    for name in ("uncompressed", "compressed"):
        torch.manual_seed(0)
        model = GPT(GPTConfig.preset("tiny")).to(device)
        data = SyntheticDataset(MarkovSource(model.config.vocab_size, seed=0), batch_size, seq_len)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        losses = []
        for _ in range(steps):
            x, y = (t.to(device) for t in data.next_batch())
            with compressed_activations(bits) if name == "compressed" else measure.SavedActivations():
                loss = model(x, y)[1]
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        curves[name] = losses
    return curves


def bench(batch_size: int | None = None, repeats: int = 5) -> list[dict]:
    """Saved bytes and forward + backward time of the tiny GPT with 8-bit compressed activations vs
    uncompressed, in fp32 and bf16 (this tier's device and batch size): the time ratio of interleaved rounds
    (`llmlab.timing.compare`) with its spread, the load and its `direction` ("slower": compression costs time)."""

    device, B = runtime.device(), batch_size or runtime.preset().batch_size
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        model, x, y = _tiny_batch(dtype, B, 64, device)

        def step(compress: bool, model=model, x=x, y=y) -> None:
            with compressed_activations() if compress else contextlib.nullcontext():  # the peer: plain autograd
                loss = model(x, y)[1]
            loss.backward()
            model.zero_grad(set_to_none=True)

        r = compare(lambda: step(True), lambda: step(False), device=device, min_rounds=repeats)
        b = saved_bytes(dtype, 8, B, 64, device)
        rows.append({"impl": "8-bit saved activations", "peer": f"{str(dtype)[6:]} saved activations",
                     "size": f"tiny B={B} T=64", **r.row(), "note": r.note(),
                     "direction": r.direction() if r.conclusive else "not conclusive",
                     "saved_MB": b["compressed"] / 1e6, "peer_saved_MB": b["uncompressed"] / 1e6,
                     "bytes_ratio": b["compressed"] / b["uncompressed"]})
    return rows
