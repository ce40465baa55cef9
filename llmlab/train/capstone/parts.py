"""The parts the capstone's flags compose into the Trainer: model surgery (MoE MLPs, LoRA, fake quantization,
Megatron blocks), ZeRO driven through the optimizer face the Trainer expects, and which gradients are shards.

    model = compose_model(GPT(config), run, tp_group, cp_group)  # --moe, --lora, --quant, --tp or --cp, in order
    optimizer = ZeROOptimizer(zero)                        # --zero: the Trainer sets its LR, steps, saves it
    sharded, replicated = split_gradients(module, params)  # --tp: the Megatron weights are shards
"""

from __future__ import annotations

import torch
import torch.distributed as td

from llmlab.lora import apply_lora
from llmlab.memory.zero import ZeRO
from llmlab.moe import MoELayer
from llmlab.parallel.context import ContextParallelAttention, positions
from llmlab.parallel.sequence import gather_sequence, scatter_sequence
from llmlab.parallel.tensor import ColumnParallelLinear, ParallelBlock, RowParallelLinear
from llmlab.quant import LSQQuantizer, MinMaxQuantizer, QConfig, quantize_model
from llmlab.train.capstone.config import RunConfig

__all__ = ["MoEMLP", "compose_model", "cp_positions", "ZeROOptimizer", "split_gradients"]


class MoEMLP(torch.nn.Module):
    """A block's MLP slot holding an MoELayer (dropless, top-2); keeps the last forward's aux loss in `aux`."""

    def __init__(self, dim: int, num_experts: int):
        super().__init__()
        # dropless: a token's routing does not depend on the other tokens, so data parallel (each rank routing
        # its own rows) computes what one process computes on the whole batch
        self.moe = MoELayer(dim, 4 * dim, num_experts, k=2, capacity_factor=None)
        self.aux = None

    def forward(self, x):
        y, self.aux = self.moe(x)
        return y


def compose_model(model: torch.nn.Module, run: RunConfig, tp_group=None, cp_group=None) -> torch.nn.Module:
    """The GPT `model` (the same full model on every rank: same seed) with `run`'s parts swapped in, in place:
    --moe MLPs, --lora on the attention, --quant's fake-quantized linears, then --tp: every block sharded over
    `tp_group` (its size is `run.tp`); with --sp the first block cuts its input to this rank's tokens and the last
    gathers its output whole again (forward hooks), so the embeddings and the head see the whole sequence.
    --cp: every block's attention is the ring over `cp_group` and the first block cuts its input to this rank's
    zig-zag positions; the rest of the model then runs on those tokens only, the head included (logits
    (B, T/cp, V): `Capstone.loss` takes the targets at the same positions)."""
    blocks = model.transformer.h
    if run.moe:
        for block in blocks:
            block.mlp = MoEMLP(model.config.n_embd, run.moe)
    if run.lora:
        apply_lora(model, r=run.lora, alpha=float(run.lora))
    if run.quant:
        weight = MinMaxQuantizer(bits=8) if run.quant == "w8a8" else LSQQuantizer(bits=4)
        quantize_model(model, QConfig(activation=MinMaxQuantizer(bits=8), weight=weight))
    if run.tp > 1:
        for i, block in enumerate(blocks):
            blocks[i] = ParallelBlock(block, tp_group, sequence_parallel=run.sp)
    if run.sp:
        blocks[0].register_forward_pre_hook(lambda _, args: (scatter_sequence(args[0], tp_group),))
        blocks[-1].register_forward_hook(lambda _, args, out: gather_sequence(out, tp_group))
    if run.cp > 1:
        for block in blocks:
            block.attn = ContextParallelAttention(block.attn, cp_group)
        blocks[0].register_forward_pre_hook(lambda _, args: (args[0][:, cp_positions(args[0].shape[1], cp_group)],))
    return model


def cp_positions(T: int, cp_group) -> torch.Tensor:
    """The positions of a T-token sequence this rank holds under --cp (zig-zag over `cp_group`): (T/cp,)."""
    return positions(T, td.get_rank(cp_group), td.get_world_size(cp_group), "zigzag")


class ZeROOptimizer:
    """The optimizer face the Trainer drives (param_groups' lr, step, zero_grad, state_dict) of a ZeRO wrapper:
    ZeRO is its own AdamW on this rank's shards."""

    def __init__(self, zero: ZeRO):
        if not isinstance(zero, ZeRO):
            raise ValueError(f"zero must be a llmlab.memory.zero.ZeRO, got {type(zero).__name__}")
        self.zero, self.param_groups = zero, [{"lr": zero.lr}]

    def step(self) -> None:
        self.zero.lr = self.param_groups[0]["lr"]
        self.zero.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero.zero_grad()

    def state_dict(self) -> dict:
        return self.zero.state_dict()

    def load_state_dict(self, state) -> None:
        """ZeRO.load_state_dict: this rank's own state, or every saved rank's (a list) to re-shard."""
        self.zero.load_state_dict(state)
        self.param_groups[0]["lr"] = self.zero.lr


def split_gradients(module: torch.nn.Module, params: list[torch.nn.Parameter]):
    """(sharded, replicated): the gradients of `params` that are tensor-parallel shards (the Megatron linears'
    weights, a column-parallel bias), disjoint across the tensor-parallel group, and those every rank holds whole."""
    sharded = set()
    for m in module.modules():
        if isinstance(m, ColumnParallelLinear | RowParallelLinear):
            sharded.add(m.weight)
        if isinstance(m, ColumnParallelLinear) and m.bias is not None:
            sharded.add(m.bias)  # RowParallelLinear's bias is added once, after the sum: replicated
    grads = [(p in sharded, p.grad) for p in params if p.grad is not None]
    return [g for s, g in grads if s], [g for s, g in grads if not s]
