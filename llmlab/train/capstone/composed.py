"""`Capstone`: the Trainer with the flags' parts composed in through its override points, on one rank of a
`llmlab.dist.Grid` (or alone): the model surgery and ZeRO of `parts`, checkpointing and activation compression
around the loss, the MoE balance loss, clipping by the global norm over shards, the sharded checkpoints of `saves`
(every --save-every updates), and a heartbeat after each update for the hang detector. Build it on every rank
(`run_rank` does)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as td
import torch.nn.functional as F

from llmlab import dist
from llmlab.memory.checkpoint import checkpointed
from llmlab.memory.compress import compressed_activations
from llmlab.memory.zero import ZeRO
from llmlab.train.capstone import saves
from llmlab.train.capstone.config import RunConfig, check
from llmlab.train.capstone.parts import ZeROOptimizer, compose_model, cp_positions, split_gradients
from llmlab.train.clip import scale_to_norm
from llmlab.train.trainer import Trainer

__all__ = ["Capstone"]


class Capstone(Trainer):
    """Train per `run` on this rank of `grid` (a llmlab.dist.Grid of dp × cp × tp ranks; None: one process
    alone)."""

    def __init__(self, run: RunConfig, grid=None, monitor=None, heartbeat=dist.heartbeat):
        self.run, self.grid, self.heartbeat = run, grid, heartbeat
        self.start_step, self.saved_step = 0, None  # the update this run started from; the last one saved
        self.replacing = None  # the checkpoints in --save DIR this run replaces (saves.save decides at its first)
        self.tp = grid.tp if grid is not None else 1
        self.tp_group = grid.tp_group if self.tp > 1 else None
        self.cp = grid.cp if grid is not None else 1
        self.cp_group = grid.cp_group if self.cp > 1 else None
        self.global_rank = td.get_rank() if grid is not None else 0
        world = grid.dp * grid.cp * grid.tp if grid is not None else 1
        super().__init__(config=check(run, world), monitor=monitor, data_parallel=grid is not None and grid.dp > 1,
                         group=grid.dp_group if grid is not None else None, progress=False)
        self.zero = self.model if run.zero else None

    def build_model(self) -> torch.nn.Module:
        return compose_model(super().build_model(), self.run, self.tp_group, self.cp_group)

    def wrap_model(self) -> torch.nn.Module:
        if not self.run.zero:
            return super().wrap_model()
        c = self.config
        return ZeRO(self.module, self.run.zero, lr=c.lr, betas=(0.9, 0.95), weight_decay=c.weight_decay,
                    group=self.group, units=list(self.module.transformer.h) if self.run.zero == 3 else None)

    def build_optimizer(self, params):
        if self.run.zero:
            return ZeROOptimizer(self.model)
        return super().build_optimizer(params)

    def step(self) -> dict:
        """The Trainer's update; then the checkpoint every --save-every updates, and a heartbeat."""
        metrics = super().step()
        if self.run.save_every and self.step_count % self.run.save_every == 0:
            self.save(self.run.save)
        self.heartbeat()
        return metrics

    def loss(self, x, y):
        with contextlib.ExitStack() as stack:
            if self.run.checkpoint:
                stack.enter_context(checkpointed(self.module.transformer.h))
            if self.run.compress8:
                stack.enter_context(compressed_activations(bits=8))
            loss = self.model(x, y)[1] if self.cp == 1 else self._context_parallel_loss(x, y)
        if self.run.moe:
            loss = loss + sum(b.mlp.aux for b in self.module.transformer.h)
        return loss

    def _context_parallel_loss(self, x, y) -> torch.Tensor:
        """--cp: the mean cross-entropy of this rank's tokens, whose gradient `clip` averages over the cp group
        (every rank holds the same number of tokens, so the mean of the ranks' means is the sequence's mean). Its
        value is that mean over the group already (the Trainer logs it; the gradient stays this rank's own)."""
        logits = self.model(x)[0]  # (B, T/cp, V): the blocks and the head ran on this rank's tokens
        y = y[:, cp_positions(y.shape[1], self.cp_group)]  # (B, T/cp)
        mine = F.cross_entropy(logits.flatten(0, 1), y.flatten().long(), ignore_index=-1)  # ()
        mean = mine.detach().clone()
        td.all_reduce(mean, group=self.cp_group)
        return mine + (mean / self.cp - mine.detach())

    def clip(self) -> torch.Tensor:
        """Global 2-norm over every rank's gradients: shards disjoint across a group (ZeRO's over the
        data-parallel ranks, the Megatron weights over the tensor-parallel ones) all-reduced as squares,
        replicated tensors counted once. Clip to grad_clip as `llmlab.train.clip.clip_grad_norm` does; return the
        norm before clipping."""
        for block in self.module.transformer.h if self.run.sp else ():
            block.all_reduce_replicated_grads()  # --sp: the norms' and row biases' gradients are per-token partial
        for p in self.params if self.cp > 1 else ():  # --cp: each rank's gradient is of its own tokens' mean
            if p.grad is not None:
                td.all_reduce(p.grad, group=self.cp_group)
                p.grad.div_(self.cp)
        if self.zero is not None:
            sharded, replicated, group = self.zero.grad_shards(), [], self.group
        elif self.tp > 1:
            (sharded, replicated), group = split_gradients(self.module, self.params), self.tp_group
        else:
            sharded, replicated, group = [], [p.grad for p in self.params if p.grad is not None], None
        square = lambda ts: sum((t.float().pow(2).sum() for t in ts), torch.zeros((), device=self.device))  # noqa: E731
        shard_sq = square(sharded)
        if self.zero is not None or self.tp > 1:
            td.all_reduce(shard_sq, group=group)
        total = (shard_sq + square(replicated)).sqrt()
        if self.config.grad_clip is not None:
            scale_to_norm(sharded + replicated, total, self.config.grad_clip)
        return total

    # --- sharded save / resume (llmlab.train.capstone.saves) ------------------------------------------------

    def layout(self) -> dict:
        return dict(world_size=td.get_world_size() if self.grid is not None else 1, dp=self.world_size, cp=self.cp,
                    tp=self.tp, zero=self.run.zero)

    def model_state(self) -> dict:
        """The model's state without ZeRO's parameters (their values live in its shards, saved as optimizer)."""
        managed = {id(p) for p in self.zero.params} if self.zero is not None else set()
        return {k: v.detach() for k, v in self.module.state_dict(keep_vars=True).items() if id(v) not in managed}

    def load_model_state(self, state: dict) -> None:
        _, unexpected = self.module.load_state_dict(state, strict=self.zero is None)
        if unexpected:
            raise ValueError(f"unexpected entries {unexpected[:4]} in the saved model state")

    def save(self, path) -> None:
        """Save the checkpoint DIR/step-N (every rank's file, then the manifest; see llmlab.train.capstone.saves
        and .checkpoints)."""
        saves.save(self, path)
        self.saved_step = self.step_count

    def load_state(self, path) -> None:
        """Continue from the newest complete checkpoint in DIR (or DIR/step-N): the same layout bit-exactly;
        another data-parallel size re-shards (data parallel and ZeRO); anything else, or a truncated, forged or
        mismatched file, is refused (ValueError)."""
        saves.load(self, path)
