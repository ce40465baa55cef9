"""ZeRO from scratch: data parallelism that shards the model state over the N ranks instead of copying it.

Plain data parallelism keeps a full copy of the parameters, gradients and Adam moments on every rank: N copies
of the same numbers. ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", §5 and Figure 1) cuts each of them into N shards, one per rank, in three stages:

    what one rank holds         stage 0 (DP)    stage 1          stage 2          stage 3
    parameters, at rest         full Ψ          full Ψ           full Ψ           its shard Ψ/N
    gradients, after backward   full Ψ          full Ψ (local)   its shard Ψ/N    its shard Ψ/N
    Adam moments m, v           full 2Ψ         its shard 2Ψ/N   its shard 2Ψ/N   its shard 2Ψ/N
    bytes, fp32 AdamW (K = 8)   16Ψ             8Ψ + 8Ψ/N        4Ψ + 12Ψ/N       16Ψ/N
    sent per step (ring)        all-reduce 2Ψ   RS Ψ + AG Ψ      RS Ψ + AG Ψ      AG Ψ + AG Ψ + RS Ψ

(RS = reduce-scatter, AG = all-gather, both counted as data volume like the paper's §7; a ring sends (N−1)/N of
it per rank.) Training here is in **one precision**, the model's own dtype: fp32 gives the planner's
precision="fp32" column (parameters 4Ψ, gradients 4Ψ, moments 8Ψ; no master copy, since the parameters already
are fp32). A float64 model (what the tests use) holds exactly twice those bytes. `ZeRO(model, stage)` computes
the same update as `torch.optim.AdamW` on the full batch, whatever the stage.

**Units and shards.** The trainable parameters are grouped into *units* and each unit is flattened into one
buffer of Ψ_u elements, zero-padded to P_u = N·⌈Ψ_u/N⌉, so that rank r owns the contiguous slice
[r·S_u, (r+1)·S_u) with S_u = P_u/N; the last rank's slice holds the padding, which stays zero (its gradient
is zero, so AdamW leaves it at zero). Stages 1–2 have units of about `bucket_mb` MB (one unit for a small
model: a single flat buffer); stage 3 has one unit per layer (by default every module in an nn.ModuleList,
the GPT's blocks) plus one for the rest (embeddings — tied with lm_head: one Parameter, so one unit —, ln_f).
Collectives are torch.distributed's reduce-scatter and all-gather on whole units (CommLog counts them as
ring bytes, (N−1)/N of the unit each), so the bytes sent per step are 2(N−1)/N·P (3(N−1)/N·P at stage 3)
elements, P = ΣP_u = Ψ + padding.

One step at each stage:
- stage 1: forward and backward as plain PyTorch, each rank on its own rows, leaving its *local* full gradient
  in p.grad. step(): reduce-scatter the gradient (rank r receives the average of its slice), AdamW on the
  slice of the parameters it owns (in place: in fp32 the parameters are the master weights), all-gather the
  updated slices into every rank's full parameters.
- stage 2: as soon as every gradient of a unit has been accumulated (a post-accumulate-grad hook), that unit is
  reduce-scattered and its full gradients are freed (p.grad = None): only the shard stays. A unit's full
  gradient lives only until its last parameter's gradient arrives (for a one-unit model, the whole backward).
- stage 3: the full parameters exist only around their use. For a unit (module) u:

      forward pre-hook      all-gather u into its flat buffer, point u's parameters at it   (Ψ_u alive)
      forward hook          free the buffer (storage resized to 0, parameters emptied)      (shard only)
      hook on u's outputs   when backward reaches u: all-gather again                        (Ψ_u alive)
      last grad of u        reduce-scatter u's gradients into the shard, free both           (shard only)

  so during the forward a rank holds its shards, the root unit (the model's own, open for the whole forward)
  and the one layer running. Autograd's saved views of the weights point into the flat buffer's storage,
  which the backward all-gather refills before they are read. step() updates the shards; nothing is
  gathered until the next forward.

    def train():                                            # on each rank: dist.spawn(train, 4)
        zero = ZeRO(GPT(GPTConfig.preset("tiny")), stage=3, lr=1e-3)
        x, y = batch[rank::world]
        zero(x, y)[1].backward()                            # gradients now reduce-scattered into shards
        zero.step(); zero.zero_grad()
        zero.state_bytes()                                  # measured: .params .grads .optimizer_state .total
        saved = zero.state_dict()                           # this rank's shards; later, on any number of ranks:
        zero.load_state_dict(every_ranks_saved)             # joined per unit and cut for this world (re-sharded)

`measure_zero(stage, world_size)` runs this on fresh ranks and compares the bytes per rank with
`planner.model_state_bytes` and the CommLog bytes per step with 2Ψ/3Ψ; `llmlab bench zero` prints the table.

(Over 400 lines, on purpose: the stages share one set of units, hooks and shard-wise save/resume, read best in one
place; the measurement at the end is the ~80 lines that check it against the paper.)
"""

from __future__ import annotations

import torch
import torch.distributed as td

from llmlab import dist, validation
from llmlab.data import MarkovSource, SyntheticDataset
from llmlab.dist.commlog import CommLog
from llmlab.dist.grid import Grid
from llmlab.memory import measure, planner
from llmlab.model import GPT, GPTConfig
from llmlab.parallel.ddp import DataParallel, buckets

__all__ = ["ZeRO", "measure_zero", "bench"]


def _reduce_scatter(out, flat, group):
    # torch >= 2.8 names it reduce_scatter_single (reduce_scatter_tensor is deprecated); CommLog counts both
    getattr(td, "reduce_scatter_single", td.reduce_scatter_tensor)(out, flat, group=group)


def _all_gather(out, shard, group):
    getattr(td, "all_gather_single", td.all_gather_into_tensor)(out, shard, group=group)


class _Unit:
    """Parameters flattened into one padded buffer `full` (P_u,), of which this rank owns `shard` (S_u,)."""

    def __init__(self, params: list[torch.nn.Parameter], rank: int, n: int, module=None):
        self.params, self.module = params, module
        self.numel = sum(p.numel() for p in params)  # Ψ_u
        self.shard_numel = -(-self.numel // n)  # S_u = ⌈Ψ_u / N⌉
        self.padding = n * self.shard_numel - self.numel
        self.full = params[0].new_zeros(n * self.shard_numel)  # (P_u,): Ψ_u values, then the padding
        self.views, offset = [], 0
        with torch.no_grad():
            for p in params:
                self.views.append(self.full[offset:offset + p.numel()].view_as(p))
                self.views[-1].copy_(p)
                p.data = self.views[-1]  # p's storage is now the unit's buffer
                offset += p.numel()
        self.empty = self.full.new_empty(0)  # what a parameter points to while its unit is freed (stage 3)
        lo = rank * self.shard_numel
        self.shard = self.full[lo:lo + self.shard_numel]  # (S_u,): a view of mine; stage 3 gives it its own copy
        self.grad_shard = None  # (S_u,) the averaged gradient of the shard, stages 2–3
        self.ready = 0  # parameters of the unit whose gradient is complete in this backward
        self.gathered = True


class ZeRO(torch.nn.Module):
    """Train `model` with AdamW (torch.optim.AdamW's update) on the ranks of `group`, model state sharded by
    ZeRO `stage` 0–3 (see the module docstring). Call it like the model; `backward()`, then `step()` and
    `zero_grad()`. Rank 0's parameters are broadcast at construction, so every replica starts equal.

    `bucket_mb`: size of the units of stages 1–2 (and of DataParallel's buckets at stage 0). `units`: stage 3's
    layers, modules of `model` that share no parameter (default: the items of every nn.ModuleList); the
    parameters of no unit form the model's own unit, gathered for its whole forward.
    """

    def __init__(self, model: torch.nn.Module, stage: int, *, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, group=None, bucket_mb: float = 25.0, units=None):
        super().__init__()
        validation.integer("stage", stage, 0, 3, hint="(the ZeRO stage; 0 is plain data parallel)")
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not (isinstance(lr, int | float) and lr >= 0):
            raise ValueError(f"lr={lr!r} must be a number >= 0")
        if not (isinstance(betas, tuple | list) and len(betas) == 2
                and all(isinstance(b, int | float) and 0 <= b < 1 for b in betas)):
            raise ValueError(f"betas={betas!r} must be two numbers in [0, 1)")
        if not (isinstance(eps, int | float) and eps > 0):
            raise ValueError(f"eps={eps!r} must be a number > 0")
        if not (isinstance(weight_decay, int | float) and weight_decay >= 0):
            raise ValueError(f"weight_decay={weight_decay!r} must be a number >= 0")
        if not td.is_initialized():
            raise RuntimeError("ZeRO needs torch.distributed initialised (dist.spawn, a dist.Cluster, or "
                               "dist.init_from_env() under torchrun)")
        params = [p for p in model.parameters() if p.requires_grad]
        if not params or len({(p.dtype, p.device) for p in params}) > 1:
            raise ValueError("model must have trainable parameters, all of one dtype and on one device; got "
                             f"{sorted({(str(p.dtype), str(p.device)) for p in params})}")
        self.stage, self.group, self.params = stage, group, params
        self.rank, self.world_size = td.get_rank(group), td.get_world_size(group)
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.num_params = sum(p.numel() for p in params)  # Ψ
        if stage == 0:  # plain data parallel: full replicas, gradients all-reduced, torch's AdamW
            self.module = DataParallel(model, bucket_mb=bucket_mb, group=group)
            self.optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
            self.units, self.padding = [], 0
            return
        self.module = model
        groups = [(b, None) for b in buckets(params, bucket_mb)] if stage < 3 else _layers(model, params, units)
        self.units = [_Unit(ps, self.rank, self.world_size, m) for ps, m in groups]
        self.padding = sum(u.padding for u in self.units)  # P − Ψ: zeros at the end of each unit (last rank)
        self._unit_of = {p: u for u in self.units for p in u.params}
        src = td.get_global_rank(group, 0) if group is not None else 0
        for u in self.units:
            td.broadcast(u.full, src, group=group)
            u.exp_avg, u.exp_avg_sq = torch.zeros_like(u.shard), torch.zeros_like(u.shard)  # (S_u,) each
            if stage == 3:
                u.shard = u.shard.clone()  # its own storage: the full buffer is freed now
                self._free(u)
                u.module.register_forward_pre_hook(lambda module, args, u=u: self._gather(u))
                u.module.register_forward_hook(lambda module, args, out, u=u: self._after_forward(u, out))
        if stage >= 2:
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_grad)
        self._step = 0

    @property
    def model(self) -> torch.nn.Module:
        return self.module.module if self.stage == 0 else self.module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # -- stage 3: full parameters only around their use --------------------------------------------------------
    def _gather(self, u: _Unit) -> None:
        if u.gathered:
            return
        u.full.untyped_storage().resize_(u.full.numel() * u.full.element_size())  # allocate P_u again
        with torch.no_grad():
            _all_gather(u.full, u.shard, self.group)  # (P_u,) ← every rank's (S_u,)
        for p, view in zip(u.params, u.views, strict=True):
            p.data = view
        u.gathered = True

    def _free(self, u: _Unit) -> None:
        for p in u.params:
            p.data = u.empty
        u.full.untyped_storage().resize_(0)  # the memory is released; saved views keep a 0-byte storage
        u.gathered = False

    def _after_forward(self, u: _Unit, out) -> None:
        self._free(u)
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.requires_grad:  # fires when backward reaches u's output
                t.register_hook(lambda grad, u=u: self._gather(u))

    # -- gradients ------------------------------------------------------------------------------------------
    def _reduce(self, u: _Unit) -> torch.Tensor:
        """The average over ranks of this rank's slice of u's gradient, from every rank's full local one."""
        missing = [i for i, p in enumerate(u.params) if p.grad is None]
        if missing:
            names = {p: n for n, p in self.model.named_parameters()}
            raise RuntimeError(f"parameters {[names[u.params[i]] for i in missing][:5]} have no gradient; every "
                               "trainable parameter must take part in the loss before step()")
        pad = u.full.new_zeros(u.padding)
        flat = torch.cat([p.grad.reshape(-1) for p in u.params] + [pad])  # (P_u,) this rank's local gradient
        out = flat.new_empty(u.shard_numel)  # (S_u,)
        _reduce_scatter(out, flat, self.group)  # sum over ranks of slice `rank`
        return out.div_(self.world_size)

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        u = self._unit_of[p]
        u.ready += 1
        if u.ready < len(u.params):
            return
        out = self._reduce(u)
        u.grad_shard = out if u.grad_shard is None else u.grad_shard.add_(out)  # a 2nd backward accumulates
        for q in u.params:
            q.grad = None  # the full gradient is freed: only the shard stays
        u.ready = 0
        if self.stage == 3:
            self._free(u)

    # -- the optimizer ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """AdamW on this rank's shard of every unit (then, stages 1–2, all-gather the updated parameters)."""
        if self.stage == 0:
            self.optimizer.step()
            return
        self._step += 1
        for u in self.units:
            if self.stage == 1:
                grad = u.grad_shard if u.grad_shard is not None else self._reduce(u)
            elif u.grad_shard is None or u.ready:
                raise RuntimeError(f"step() before every gradient of unit {self.units.index(u)} was computed: "
                                   "call backward() first; every trainable parameter must take part in the loss")
            else:
                grad = u.grad_shard
            self._adamw(u.shard, grad, u.exp_avg, u.exp_avg_sq)
            if self.stage < 3:
                _all_gather(u.full, u.shard.clone(), self.group)  # (P_u,); the parameters are views of it

    def grad_shards(self) -> list[torch.Tensor]:
        """This rank's averaged gradient shard (S_u,) of every unit, disjoint across ranks (so the global squared
        norm is the all-reduced sum of theirs). Stage 1 reduce-scatters now (all ranks call) and step() reuses it."""
        if self.stage == 0:
            raise ValueError("stage 0 keeps full gradients in p.grad: it has no gradient shards")
        for u in self.units:
            if self.stage == 1 and u.grad_shard is None:
                u.grad_shard = self._reduce(u)
            if u.grad_shard is None or u.ready:
                raise RuntimeError("grad_shards() before every gradient was computed: call backward() first")
        return [u.grad_shard for u in self.units]

    def _adamw(self, param, grad, m, v) -> None:
        """torch.optim.AdamW's update (decoupled weight decay, bias-corrected moments), on (S_u,) tensors."""
        (b1, b2), t = self.betas, self._step
        param.mul_(1 - self.lr * self.weight_decay)
        m.lerp_(grad, 1 - b1)
        v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        denom = (v.sqrt() / (1 - b2 ** t) ** 0.5).add_(self.eps)
        param.addcdiv_(m, denom, value=-self.lr / (1 - b1 ** t))

    def zero_grad(self) -> None:
        """Free every gradient: the full ones (p.grad) and the shards."""
        for p in self.params:
            p.grad = None
        for u in self.units:
            u.grad_shard = None

    # -- what a rank holds --------------------------------------------------------------------------------------
    def state_bytes(self) -> measure.StateBytes:
        """Bytes of model state on this rank now, each storage once (measure.tensor_bytes): parameters (full or
        freed) and shards, gradients (full and shards), AdamW's moments (and, stage 0, torch's step counters)."""
        if self.stage == 0:
            return measure.model_state_bytes(self.model, self.optimizer)
        grads = [p.grad for p in self.params if p.grad is not None]
        grads += [u.grad_shard for u in self.units if u.grad_shard is not None]
        return measure.StateBytes(
            params=measure.tensor_bytes(self.params + [u.shard for u in self.units]),
            grads=measure.tensor_bytes(grads),
            optimizer_state=measure.tensor_bytes([t for u in self.units for t in (u.exp_avg, u.exp_avg_sq)]))

    # -- save and resume ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's training state (not nn.Module's state_dict: stage 3 holds no full parameters): the update
        count `step`, `lr`, and per unit `numel` Ψ_u and this rank's (S_u,) slices of the parameters (`shard`) and
        of AdamW's moments; stage 0 instead its full `params` and torch AdamW's state. Copies, with the `stage`,
        `world_size` and `rank` they were cut for. Parameters outside ZeRO (frozen ones) are the model's to save."""
        out = dict(stage=self.stage, world_size=self.world_size, rank=self.rank, lr=self.lr)
        if self.stage == 0:
            return dict(out, params=[p.detach().clone() for p in self.params], optimizer=self.optimizer.state_dict())
        return dict(out, step=self._step, units=[dict(numel=u.numel, shard=u.shard.clone(), exp_avg=u.exp_avg.clone(),
                                                      exp_avg_sq=u.exp_avg_sq.clone()) for u in self.units])

    @torch.no_grad()
    def load_state_dict(self, state) -> None:
        """Continue from `state_dict()`: this rank's own (the same world size and rank: bit-exact), or a list of
        every saved rank's in rank order, from any data-parallel size: each unit joined whole (Ψ_u) and cut into
        this world's shards. All ranks call it (stages 1–2 all-gather the parameters). ValueError if the states
        do not fit this ZeRO (another stage, other units, missing or misordered ranks)."""
        own = not isinstance(state, list | tuple)
        states = self._check_states([state] if own else list(state), own)
        self.lr = states[0]["lr"]
        if self.stage == 0:  # full replicas: any rank's state is every rank's
            for p, saved in zip(self.params, states[0]["params"], strict=True):
                p.copy_(saved)
            self.optimizer.load_state_dict(states[0]["optimizer"])
            return
        for i, u in enumerate(self.units):
            for key in ("shard", "exp_avg", "exp_avg_sq"):
                if own:  # this rank's slice, cut for this world already
                    mine = state["units"][i][key]
                else:
                    whole = torch.cat([s["units"][i][key] for s in states])[:u.numel]  # (Ψ_u,) every saved slice
                    whole = torch.cat([whole, whole.new_zeros(u.padding)])  # (P_u,) padded for this world size
                    mine = whole[self.rank * u.shard_numel:(self.rank + 1) * u.shard_numel]  # (S_u,)
                if mine.shape != u.shard.shape:
                    raise ValueError(f"the saved {key} of unit {i} has shape {tuple(mine.shape)}, this rank's is "
                                     f"{tuple(u.shard.shape)}")
                getattr(u, key).copy_(mine)
            if self.stage < 3:
                _all_gather(u.full, u.shard.clone(), self.group)  # (P_u,); the parameters are views of it
        self._step = states[0]["step"]

    def _check_states(self, states: list, own: bool) -> list[dict]:
        keys = {"stage", "world_size", "rank", "lr"}
        keys |= {"params", "optimizer"} if self.stage == 0 else {"step", "units"}
        for i, s in enumerate(states):
            if not isinstance(s, dict) or not keys <= set(s):
                got = sorted(s) if isinstance(s, dict) else type(s).__name__
                raise ValueError(f"state[{i}] is not a ZeRO state_dict() (it has {got})")
            if s["stage"] != self.stage:
                raise ValueError(f"state[{i}] was saved at ZeRO stage {s['stage']}, this ZeRO is stage {self.stage}")
        n, ranks = states[0]["world_size"], [s["rank"] for s in states]
        if not own and ranks != list(range(n)):
            raise ValueError(f"state must list every saved rank's state_dict in rank order: saved on {n} ranks, "
                             f"given ranks {ranks}")
        if own and (n, ranks[0]) != (self.world_size, self.rank):
            raise ValueError(f"state was saved by rank {ranks[0]} of {n}, this is rank {self.rank} of "
                             f"{self.world_size}: give every saved rank's state_dict (a list) to re-shard")
        if self.stage > 0 and [u["numel"] for u in states[0]["units"]] != [u.numel for u in self.units]:
            raise ValueError(f"the saved units hold {[u['numel'] for u in states[0]['units']]} parameters, this "
                             f"ZeRO's {[u.numel for u in self.units]}: another model or other units")
        return states

    def full_parameters(self) -> list[torch.Tensor]:
        """Copies of the full parameters, in the order of model.parameters() (stage 3 gathers: all ranks call)."""
        for u in self.units:
            self._gather(u)
        out = [p.detach().clone() for p in self.params]
        if self.stage == 3:
            for u in self.units:
                self._free(u)
        return out


def _layers(model, params, units) -> list[tuple[list, torch.nn.Module]]:
    """Stage 3's units: (parameters, module) for each layer, then the model's own for the rest."""
    if units is None:
        units = [m for ml in model.modules() if isinstance(ml, torch.nn.ModuleList) for m in ml]
    trainable, owner, out = set(params), {}, []
    inside = {id(m) for m in model.modules()}
    for i, m in enumerate(units):
        if not isinstance(m, torch.nn.Module) or id(m) not in inside or m is model:
            raise ValueError(f"units[{i}] must be a submodule of model, got {type(m).__name__}")
        mine = [p for p in m.parameters() if p in trainable]
        shared = [p for p in mine if p in owner]
        if shared:
            raise ValueError(f"units[{i}] shares parameters with units[{owner[shared[0]]}]; stage 3 gathers a "
                             "unit at a time, so a shared parameter belongs to their common parent")
        owner.update({p: i for p in mine})
        if mine:
            out.append((mine, m))
    rest = [p for p in params if p not in owner]
    return out + ([(rest, model)] if rest else [])


# --- measured: bytes per rank and bytes sent per step, against the paper's formulas ----------------------------

def _measure_rank(stage: int, world: int, preset: str, steps: int, batch_size: int,
                  n_layer: int | None) -> dict | None:
    grid = Grid(dp=world, ranks=range(world))  # every rank of the cluster takes part in creating the groups
    if not grid.member:
        return None
    torch.manual_seed(0)
    config = GPTConfig.preset(preset, **({} if n_layer is None else {"n_layer": n_layer}))
    zero = ZeRO(GPT(config), stage, group=grid.dp_group)  # fp32: the planner's precision="fp32"
    materialised = []  # stage 3: bytes of parameter storage alive when each unit's forward starts

    def record(*_):
        materialised.append(measure.tensor_bytes(zero.params + [u.shard for u in zero.units]))

    for u in zero.units if stage == 3 else ():
        u.module.register_forward_pre_hook(record)  # runs after ZeRO's own pre-hook: the unit is gathered
    data = SyntheticDataset(MarkovSource(config.vocab_size), batch_size=batch_size, block_size=config.block_size,
                            rank=grid.dp_rank, world_size=world)
    for s in range(steps):
        zero.zero_grad()
        with CommLog() as log:
            zero(*data.get_batch(s))[1].backward()
            zero.step()
    e = zero.params[0].element_size()
    return {"num_params": zero.num_params, "padding": zero.padding, "itemsize": e, "state": zero.state_bytes(),
            "comm_bytes": log.bytes_sent, "peak_param_bytes": max(materialised, default=None),
            "full_param_bytes": e * zero.num_params, "unit_param_bytes": [e * u.numel for u in zero.units]}


def measure_zero(stage: int, world_size: int, *, preset: str = "tiny", n_layer: int | None = None, steps: int = 2,
                 batch_size: int = 8, cluster=None, timeout: float = 120.0) -> dict:
    """Train the `preset` GPT (with `n_layer` blocks, if given) in fp32 for `steps` steps with ZeRO `stage` on
    `world_size` ranks (fresh ones, or the first ranks of `cluster`, a dist.Cluster), and measure on the busiest
    rank:

    - `bytes`: its model state after the last step (StateBytes), vs `formula_bytes` =
      planner.model_state_bytes(Ψ, stage, N, "adamw", "fp32"): 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N;
    - `comm_bytes`: what it sent during the last step (CommLog), vs `comm_formula` = 2Ψ·4·(N−1)/N bytes
      (stages 0–2; 3Ψ at stage 3), the paper's data volume sent by a ring;
    - `peak_param_bytes` (stage 3): parameter storage alive at the start of a layer's forward, the shards
      included, vs `full_param_bytes` = 4Ψ; `unit_param_bytes`: the full parameter bytes of each unit stage 3
      gathers at a time (the blocks, then the model's own: embeddings and final LayerNorm).
    """
    validation.integer("world_size", world_size, low=1)
    validation.integer("stage", stage, 0, 3, hint="(the ZeRO stage; 0 is plain data parallel)")
    if n_layer is not None:
        validation.integer("n_layer", n_layer, low=1)
    if batch_size % world_size:
        raise ValueError(f"world_size={world_size} does not divide batch_size={batch_size}")
    if cluster is not None and cluster.world_size < world_size:
        raise ValueError(f"cluster has {cluster.world_size} ranks, fewer than world_size={world_size}")
    args = (stage, world_size, preset, steps, batch_size, n_layer)
    ranks = cluster.run(_measure_rank, *args, timeout=timeout) if cluster else dist.spawn(
        _measure_rank, world_size, *args, timeout=timeout)
    ranks = [r for r in ranks if r is not None]
    busiest = max(ranks, key=lambda r: r["state"].total)
    psi, e, n = busiest["num_params"], busiest["itemsize"], world_size
    return {"stage": stage, "world_size": n, "num_params": psi, "padding": busiest["padding"],
            "bytes": busiest["state"], "formula_bytes": planner.model_state_bytes(psi, stage, n, "adamw", "fp32"),
            "comm_bytes": max(r["comm_bytes"] for r in ranks),
            "comm_formula": (3 if stage == 3 else 2) * psi * e * (n - 1) / n,
            "peak_param_bytes": busiest["peak_param_bytes"], "full_param_bytes": busiest["full_param_bytes"],
            "unit_param_bytes": busiest["unit_param_bytes"]}


def bench(world_sizes=(2, 4)) -> list[dict]:
    """`llmlab bench zero`: bytes per rank and bytes sent per step, measured vs the ZeRO paper's formulas."""
    rows = []
    with dist.Cluster(max(world_sizes)) as cluster:
        for n in world_sizes:
            for stage in range(4):
                r = measure_zero(stage, n, cluster=cluster)
                rows.append({"impl": f"ZeRO-{stage}" if stage else "DP (stage 0)", "peer": "paper formula",
                             "size": f"tiny GPT Ψ={r['num_params']} fp32, N={n}",
                             "MB_per_rank": r["bytes"].total / 1e6, "formula_MB": r["formula_bytes"] / 1e6,
                             "ratio": r["bytes"].total / r["formula_bytes"],
                             "sent_MB_per_step": r["comm_bytes"] / 1e6, "formula_sent_MB": r["comm_formula"] / 1e6,
                             "sent_ratio": r["comm_bytes"] / r["comm_formula"]})
    return rows
