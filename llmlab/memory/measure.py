"""Where the memory of a training step goes, measured: model state, saved activations, the allocator's peak.

A training step holds two kinds of memory (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", §3):

- **model state**: parameters, their gradients, and the optimizer's state (Adam keeps two moments per
  parameter; mixed precision adds an fp32 master copy). It lives for the whole of training.
- **residual state**, mostly *activations*: the tensors autograd saves during the forward pass because the
  backward pass needs them (a Linear saves its input to compute the weight's gradient, a softmax its output).
  They live from the forward until the backward has used them.

This module counts both exactly, in bytes of the storages that hold them, each storage once: tied weights
(the GPT's `wte` and `lm_head`), a tensor saved twice, or views of one buffer are one block of memory::

    from llmlab.memory import measure
    state = measure.model_state_bytes(model, optimizer)      # .params .grads .optimizer_state .total
    with measure.SavedActivations() as saved:               # counts what autograd saves for backward
        loss = model(x, y)[1]
    saved.bytes                                              # identical on CPU and GPU (see SavedActivations)
    with measure.peak_allocated("cuda") as peak:             # CUDA only: the caching allocator's peak
        model(x, y)[1].backward()
    peak.bytes

`tensor_bytes(tensors)` is the same deduplicated count for any tensors, e.g. the flat shards a ZeRO rank
keeps, so a test can compare the bytes one rank holds with the paper's formulas.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from llmlab import runtime

__all__ = ["StateBytes", "storage_key", "tensor_bytes", "model_state_bytes", "is_parameter", "StorageCounter",
           "SavedActivations",
           "saved_activation_bytes", "PeakMemory", "peak_allocated"]


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """What identifies the memory under `t`: its device and the address of its storage (not of `t`'s first
    element, which differs between views of one storage). Meta tensors have no addresses: there the
    storage's Python object, which every view of it shares, stands in."""
    storage = t.untyped_storage()
    return str(t.device), storage.data_ptr() if t.device.type != "meta" else id(storage)


def _tensors(name: str, tensors) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    if isinstance(tensors, torch.nn.Module):
        return list(tensors.parameters())
    tensors = list(tensors)
    bad = [type(t).__name__ for t in tensors if not isinstance(t, torch.Tensor)]
    if bad:
        raise ValueError(f"{name} must be tensors (or a module), got {bad[0]}")
    return tensors


def tensor_bytes(tensors: Iterable[torch.Tensor] | torch.Tensor, exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the storages under `tensors`, each storage counted once, leaving out those of `exclude`."""
    skip = {storage_key(t) for t in _tensors("exclude", exclude)}
    seen: dict[tuple[str, int], int] = {}
    for t in _tensors("tensors", tensors):
        key = storage_key(t)
        if key not in skip:
            seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


@dataclass(frozen=True)
class StateBytes:
    """Bytes of model state: parameters, gradients, optimizer state (moments, step counters, and the fp32
    master weights of mixed precision, which the ZeRO paper counts as optimizer state: its K = 12)."""

    params: int
    grads: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_state


def model_state_bytes(model: torch.nn.Module | Iterable[torch.Tensor], optimizer=None) -> StateBytes:
    """The model state of `model` (a module, or its parameter tensors) and of `optimizer`.

    `optimizer` is a torch.optim.Optimizer or anything with its two attributes: `state` (parameter -> dict of
    tensors, e.g. AdamW's exp_avg, exp_avg_sq and step) and `param_groups`. Parameters the optimizer updates
    that are not `model`'s (mixed precision's fp32 masters, a ZeRO rank's flat shard) count as optimizer state;
    every gradient present (`.grad` of the model's and of the optimizer's parameters) counts as gradients.
    """
    params = _tensors("model", model)
    owned = params[:]
    optimizer_tensors: list[torch.Tensor] = []
    if optimizer is not None:
        if not (hasattr(optimizer, "state") and hasattr(optimizer, "param_groups")):
            raise ValueError(f"optimizer must have .state and .param_groups (a torch.optim.Optimizer), got "
                             f"{type(optimizer).__name__}")
        model_keys = {storage_key(p) for p in params}
        for group in optimizer.param_groups:
            masters = [p for p in group["params"] if storage_key(p) not in model_keys]
            optimizer_tensors += masters
            owned += masters
        for state in optimizer.state.values():
            optimizer_tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    grads = [p.grad for p in owned if p.grad is not None]
    return StateBytes(params=tensor_bytes(params), grads=tensor_bytes(grads),
                      optimizer_state=tensor_bytes(optimizer_tensors))


def is_parameter(t: torch.Tensor) -> bool:
    """Is `t` a parameter or a view of one (Linear saves `weight.t()` for backward)? Model state, not an
    activation."""
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


class StorageCounter:
    """Bytes of the distinct storages of the tensors `add`ed, each counted once — and again if that storage
    has been freed since, so the allocator may have given its address to a new one. (A storage's Python
    object lives exactly as long as the storage, whichever tensors or views hold it: a weak reference to it
    says whether it is still the same memory.)"""

    def __init__(self):
        self._seen: dict[tuple[str, int], weakref.ref] = {}  # storage key -> the storage, weakly
        self.bytes = 0

    def add(self, t: torch.Tensor) -> int:
        """Count `t`'s storage unless it is already counted; return the bytes added (0 or its size)."""
        key, storage = storage_key(t), t.untyped_storage()
        first = self._seen.get(key)
        if first is not None and first() is storage:
            return 0
        self._seen[key] = weakref.ref(storage)
        self.bytes += storage.nbytes()
        return storage.nbytes()


class SavedActivations:
    """Counts the bytes autograd saves for the backward pass while the `with` block runs.

    PyTorch hands every tensor an op saves for backward to the pack hook of
    `torch.autograd.graph.saved_tensors_hooks`; this context installs one that records the tensor and returns
    it unchanged (training is unaffected). It counts:

    - each storage once (a log-softmax output saved by two ops, q/k/v views of one buffer), by its full size
      (a `StorageCounter`);
    - no parameters: a saved tensor that `is_parameter`, or shares storage with a tensor in `exclude` (pass
      buffers or non-Parameter weights there), is model state, counted by `model_state_bytes`.

    The count depends on the ops and shapes only, so it is the same on CPU and GPU, with one exception the
    planner models: dropout on CPU saves a float mask of the activation's dtype, on CUDA a 1-byte bool mask.

    Nested saved-tensor hooks take precedence over outer ones: what a region run under an inner hook saves
    (torch.utils.checkpoint's inner forward, `compressed_activations`) is not seen here; such a region
    reports its own bytes.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {storage_key(t) for t in _tensors("exclude", exclude)}
        self._counter = StorageCounter()
        self.tensors = 0  # saved tensors counted (before deduplication), parameters not included
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def bytes(self) -> int:
        """Distinct activation storage bytes saved so far."""
        return self._counter.bytes

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not is_parameter(t) and storage_key(t) not in self._exclude:
            self.tensors += 1
            self._counter.add(t)
        return t

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def saved_activation_bytes(fn, *args, exclude: Iterable[torch.Tensor] = (), **kwargs) -> tuple[object, int]:
    """(`fn(*args, **kwargs)`, bytes autograd saved for its backward): SavedActivations around one call."""
    with SavedActivations(exclude) as saved:
        out = fn(*args, **kwargs)
    return out, saved.bytes


@dataclass
class PeakMemory:
    """Filled in when a `peak_allocated` block ends: `start` allocated at entry, `peak` the most allocated
    at any moment inside, `bytes` = peak - start (what the block added at its worst)."""

    start: int = 0
    peak: int = 0

    @property
    def bytes(self) -> int:
        return self.peak - self.start


@contextmanager
def peak_allocated(device: torch.device | str = "cuda"):
    """The CUDA caching allocator's peak of allocated bytes during the block (`torch.cuda.max_memory_allocated`
    after `reset_peak_memory_stats`, through `llmlab.runtime`). This sees everything — activations, gradients,
    temporaries of backward, the optimizer's update — not only saved tensors. CPU has no such counter: a non-CUDA
    device is refused, except under smoke mode (`llmlab.runtime`), where the process's resident set stands in."""
    device = torch.device(device)
    if device.type != "cuda" and not runtime.tier().smoke:
        raise ValueError(f"device={str(device)!r}: the allocator's peak is tracked only on CUDA devices; "
                         "on CPU use SavedActivations and model_state_bytes")
    result = PeakMemory()
    runtime.synchronize(device)
    runtime.reset_peak_memory_stats(device)
    result.start = runtime.memory_allocated(device)
    try:
        yield result
    finally:
        runtime.synchronize(device)
        result.peak = runtime.max_memory_allocated(device)
