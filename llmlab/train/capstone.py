"""The capstone: `llmlab train`, one command composing the workbook's parts by flags, on 1 to many ranks.

    llmlab train --preset tiny --steps 50                        # one CPU (or GPU) process
    llmlab train --nproc 4 --zero 2 --accum 2                    # 4 local gloo ranks (llmlab.dist.spawn)
    llmlab train --nproc 4 --tp 2 --checkpoint                   # 2 data-parallel × 2 tensor-parallel ranks
    torchrun --nnodes 2 --nproc-per-node 8 -m llmlab.train --zero 1 --preset small   # NCCL; the env decides

(`python -m llmlab.train …` is the same command.) The world is dp × tp ranks; rank g is tensor-parallel rank
g % tp of data-parallel replica g // tp. What each flag composes, all from the library:

    (world size)   Trainer(data_parallel=True): llmlab.parallel.data.DataParallel over the dp ranks
    --zero S       llmlab.memory.zero.ZeRO stage S over the dp ranks (its own AdamW on shards)
    --tp N         llmlab.parallel.tensor.ParallelBlock for every block (Megatron attention + MLP)
    --checkpoint   llmlab.memory.checkpoint.checkpointed(blocks)      --compress8   compressed_activations(8)
    --precision    Trainer's autocast (+ dynamic loss scaling for fp16)  --accum N  Trainer's accumulation
    --lora R       llmlab.lora.apply_lora (attention, rank R)         --moe E   llmlab.moe.MoELayer MLPs (top-2)
    --quant        llmlab.quant.quantize_model: w8a8 (MinMax 8/8) or w4a8 (LSQ 4-bit weights, MinMax 8-bit inputs)

Combinations that do not compose are refused before any rank starts (`check`). Gradient clipping is global
over shards (`Capstone.clip`). `--save DIR` writes DIR/rank{r}.pt per rank and DIR/manifest.pt (layout, step,
flags), atomically (llmlab.train.state); `--resume DIR` continues bit-exactly on the same layout, and re-shards
data-parallel and ZeRO states onto another data-parallel size. `--stop-at K` stops (and saves) after update K.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
import torch.distributed as td

from llmlab.train import state as state_file
from llmlab.train.clip import _EPS
from llmlab.train.trainer import TRAIN_PRESETS, TrainConfig, Trainer

__all__ = ["RunConfig", "Capstone", "check", "run_rank", "launch", "main"]

QUANTS = ("w8a8", "w4a8")
_NOT_TRAINING = ("nproc", "save", "resume", "stop_at", "timeout")  # flags that do not change the training


@dataclass(frozen=True)
class RunConfig:
    """The command's flags (see the module docstring); None picks the preset's value."""

    preset: str = "tiny"
    steps: int | None = None
    seed: int = 0
    nproc: int = 1
    zero: int = 0
    tp: int = 1
    checkpoint: bool = False
    compress8: bool = False
    precision: str | None = None
    accum: int = 1
    lora: int = 0
    moe: int = 0
    quant: str | None = None
    batch_size: int | None = None
    block_size: int | None = None
    save: str | None = None
    resume: str | None = None
    stop_at: int | None = None
    timeout: float = 600.0

    def train_config(self) -> TrainConfig:
        base = TRAIN_PRESETS[self.preset]
        steps = base.steps if self.steps is None else self.steps
        return replace(base, steps=steps, warmup=min(base.warmup, steps), seed=self.seed, accumulation=self.accum,
                       precision=self.precision or base.precision, batch_size=self.batch_size or base.batch_size,
                       block_size=self.block_size or base.block_size)

    def flags(self) -> dict:
        """The flags that change the training (what a resumed run must repeat)."""
        return {k: v for k, v in asdict(self).items() if k not in _NOT_TRAINING}


def check(config: RunConfig, world_size: int) -> TrainConfig:
    """Refuse (ValueError naming the flags) what does not compose; return the TrainConfig. Runs before any rank."""
    from llmlab.model import GPTConfig

    if config.preset not in TRAIN_PRESETS:
        raise ValueError(f"--preset {config.preset!r}: choose from {list(TRAIN_PRESETS)}")
    for name, low in (("steps", 1), ("nproc", 1), ("tp", 1), ("accum", 1), ("lora", 0), ("moe", 0),
                      ("batch_size", 1), ("block_size", 1), ("stop_at", 1)):
        v = getattr(config, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
            raise ValueError(f"--{name.replace('_', '-')} {v!r} must be an int >= {low}")
    if config.zero not in (0, 1, 2, 3):
        raise ValueError(f"--zero {config.zero!r} must be 0, 1, 2 or 3")
    if config.quant not in (None, *QUANTS):
        raise ValueError(f"--quant {config.quant!r}: choose from {QUANTS}")
    tc = config.train_config()  # TrainConfig checks steps, precision, batch and block sizes itself
    model = GPTConfig.preset(tc.model, block_size=tc.block_size)
    tp = config.tp
    if world_size % tp:
        raise ValueError(f"--tp {tp} does not divide the world size {world_size} (world = dp × tp)")
    dp = world_size // tp
    if tp > 1 and (model.n_head % tp or model.n_embd % tp):
        raise ValueError(f"--tp {tp} does not divide the {config.preset} model's n_head={model.n_head} "
                         f"(or n_embd={model.n_embd}): each tensor-parallel rank takes n_head/tp whole heads")
    if tc.batch_size % dp:
        raise ValueError(f"the data-parallel size {dp} (world {world_size} / --tp {tp}) does not divide the batch "
                         f"size {tc.batch_size} (--batch-size)")
    if config.stop_at is not None and config.stop_at > tc.steps:
        raise ValueError(f"--stop-at {config.stop_at} is past --steps {tc.steps}")
    refusals = [
        (config.zero and dp < 2, f"--zero {config.zero} shards over data-parallel ranks: it needs a data-parallel "
                                 f"size >= 2, here {dp} (use --nproc, or torchrun)"),
        (config.zero and tp > 1, f"--zero {config.zero} with --tp {tp}: ZeRO here shards a data-parallel group of "
                                 "whole replicas; combining it with tensor parallelism is not supported"),
        (config.zero and tc.precision == "fp16", f"--zero {config.zero} with --precision fp16: ZeRO keeps its "
                                                 "gradients as shards, which the fp16 loss scaler does not unscale"),
        (tp > 1 and tc.precision == "fp16", f"--tp {tp} with --precision fp16: each rank would detect overflow "
                                            "in its own shard and the ranks could disagree on skipping a step"),
        (tp > 1 and config.lora, f"--tp {tp} with --lora: LoRA wraps nn.Linear layers, tensor parallelism "
                                 "replaces them with sharded ones"),
        (tp > 1 and config.moe, f"--tp {tp} with --moe: the Megatron block splits a dense MLP, not experts"),
        (tp > 1 and config.quant, f"--tp {tp} with --quant: fake quantization wraps nn.Linear layers, tensor "
                                  "parallelism replaces them with sharded ones"),
        (config.lora and config.quant, "--lora with --quant: LoRA and fake quantization both replace the "
                                       "attention's nn.Linear layers; not supported together"),
        (config.moe and config.checkpoint, "--moe with --checkpoint: the MoE balance loss is a side output that "
                                           "checkpointing (which keeps only the block's output) would detach"),
        (config.moe == 1, "--moe 1: top-2 routing needs at least 2 experts"),
    ]
    for refused, message in refusals:
        if refused:
            raise ValueError(message)
    return tc


class MoEMLP(torch.nn.Module):
    """A block's MLP slot holding an MoELayer (dropless, top-2); keeps the last forward's aux loss in `aux`."""

    def __init__(self, dim: int, num_experts: int):
        from llmlab.moe import MoELayer

        super().__init__()
        # dropless: a token's routing does not depend on the other tokens, so data parallel (each rank routing
        # its own rows) computes what one process computes on the whole batch
        self.moe = MoELayer(dim, 4 * dim, num_experts, k=2, capacity_factor=None)
        self.aux = None

    def forward(self, x):
        y, self.aux = self.moe(x)
        return y


class _ZeROOptimizer:
    """The optimizer face the Trainer drives (param_groups' lr, step, zero_grad, state) of a ZeRO wrapper."""

    def __init__(self, zero):
        self.zero, self.param_groups = zero, [{"lr": zero.lr}]

    def step(self):
        self.zero.lr = self.param_groups[0]["lr"]
        self.zero.step()

    def zero_grad(self, set_to_none: bool = True):
        self.zero.zero_grad()

    def state_dict(self) -> dict:
        return dict(step=self.zero._step, lr=self.param_groups[0]["lr"],
                    units=[dict(shard=u.shard.clone(), exp_avg=u.exp_avg.clone(), exp_avg_sq=u.exp_avg_sq.clone())
                           for u in self.zero.units])

    def load_state_dict(self, state: dict) -> None:
        """This rank's own saved shards (the same layout: bit-exact)."""
        self.load_resharded([state], whole=False)

    def load_resharded(self, states: list[dict], whole: bool = True) -> None:
        """`whole`: `states` are every saved rank's (in rank order), joined and cut into this world's slice of
        each unit, so any data-parallel size resumes; else `states[0]` holds exactly this rank's shards."""
        from llmlab.memory.zero import _all_gather

        z = self.zero
        if len(states[0]["units"]) != len(z.units):
            raise ValueError(f"the saved ZeRO state has {len(states[0]['units'])} units, this run {len(z.units)}")
        with torch.no_grad():
            for i, u in enumerate(z.units):
                for key in ("shard", "exp_avg", "exp_avg_sq"):
                    mine = states[0]["units"][i][key]
                    if whole:
                        full = torch.cat([s["units"][i][key] for s in states])[:u.numel]  # (Ψ_u,)
                        full = torch.cat([full, full.new_zeros(u.padding)])  # (P_u,) for this world size
                        mine = full[z.rank * u.shard_numel:(z.rank + 1) * u.shard_numel]
                    if mine.shape != getattr(u, key).shape:
                        raise ValueError(f"the saved ZeRO shard of unit {i} has shape {tuple(mine.shape)}, this "
                                         f"rank's is {tuple(getattr(u, key).shape)}")
                    getattr(u, key).copy_(mine)
                if z.stage < 3:
                    _all_gather(u.full, u.shard.clone(), z.group)  # the parameters are views of u.full
        z._step, self.param_groups[0]["lr"] = states[0]["step"], states[0]["lr"]


class Capstone(Trainer):
    """The Trainer with the flags' parts composed in through its override points. Build it on every rank
    (`run_rank` does); `tp_group`/`dp_group` are this rank's groups (None: the whole world, or no TP)."""

    def __init__(self, run: RunConfig, tp_group=None, dp_group=None, monitor=None):
        self.run, self.tp_group = run, tp_group
        self.tp = td.get_world_size(tp_group) if tp_group is not None else 1
        dp = (td.get_world_size() // self.tp) if td.is_initialized() else 1
        self.global_rank = td.get_rank() if td.is_initialized() else 0
        super().__init__(config=check(run, dp * self.tp), monitor=monitor, data_parallel=dp > 1, group=dp_group,
                         progress=False)
        self.zero = self.model if run.zero else None

    def build_model(self) -> torch.nn.Module:
        model = super().build_model()
        blocks = model.transformer.h
        if self.run.moe:
            for block in blocks:
                block.mlp = MoEMLP(model.config.n_embd, self.run.moe)
        if self.run.lora:
            from llmlab.lora import apply_lora

            apply_lora(model, r=self.run.lora, alpha=float(self.run.lora))
        if self.run.quant:
            from llmlab.quant import LSQQuantizer, MinMaxQuantizer, QConfig, quantize_model

            weight = MinMaxQuantizer(bits=8) if self.run.quant == "w8a8" else LSQQuantizer(bits=4)
            quantize_model(model, QConfig(activation=MinMaxQuantizer(bits=8), weight=weight))
        if self.tp > 1:
            from llmlab.parallel.tensor import ParallelBlock

            for i, block in enumerate(blocks):  # every rank built the same full model (same seed): shard it
                blocks[i] = ParallelBlock(block, self.tp_group)
        return model

    def wrap_model(self) -> torch.nn.Module:
        if not self.run.zero:
            return super().wrap_model()
        from llmlab.memory.zero import ZeRO

        c = self.config
        return ZeRO(self.module, self.run.zero, lr=c.lr, betas=(0.9, 0.95), weight_decay=c.weight_decay,
                    group=self.group, units=list(self.module.transformer.h) if self.run.zero == 3 else None)

    def build_optimizer(self, params):
        if self.run.zero:
            return _ZeROOptimizer(self.model)
        return super().build_optimizer(params)

    def loss(self, x, y):
        import contextlib

        from llmlab.memory.checkpoint import checkpointed
        from llmlab.memory.compress import compressed_activations

        with contextlib.ExitStack() as stack:
            if self.run.checkpoint:
                stack.enter_context(checkpointed(self.module.transformer.h))
            if self.run.compress8:
                stack.enter_context(compressed_activations(bits=8))
            loss = self.model(x, y)[1]
        if self.run.moe:
            loss = loss + sum(b.mlp.aux for b in self.module.transformer.h)
        return loss

    def grad_parts(self) -> tuple[list[torch.Tensor], list[torch.Tensor], object]:
        """(sharded, replicated, group): the gradient tensors split into disjoint shards across `group`'s
        ranks and those every rank of it holds whole — so the global norm counts each element once."""
        if self.zero is not None:
            return self.zero.grad_shards(), [], self.group
        from llmlab.parallel.tensor import ColumnParallelLinear, RowParallelLinear

        sharded = set()
        if self.tp > 1:
            for m in self.module.modules():
                if isinstance(m, ColumnParallelLinear | RowParallelLinear):
                    sharded.add(m.weight)
                if isinstance(m, ColumnParallelLinear) and m.bias is not None:
                    sharded.add(m.bias)  # RowParallelLinear's bias is added once, after the sum: replicated
        grads = [(p in sharded, p.grad) for p in self.params if p.grad is not None]
        return [g for s, g in grads if s], [g for s, g in grads if not s], self.tp_group

    def clip(self) -> torch.Tensor:
        """Global 2-norm over every rank's gradients (sharded ones all-reduced as squares, replicated ones once);
        clip to grad_clip as `llmlab.train.clip.clip_grad_norm` does; return the norm before clipping."""
        sharded, replicated, group = self.grad_parts()
        square = lambda ts: sum((t.float().pow(2).sum() for t in ts), torch.zeros((), device=self.device))  # noqa: E731
        shard_sq = square(sharded)
        if self.zero is not None or self.tp > 1:  # shards disjoint across the group: sum their squares
            td.all_reduce(shard_sq, group=group)
        total = (shard_sq + square(replicated)).sqrt()
        if self.config.grad_clip is not None:
            coefficient = (self.config.grad_clip / (total + _EPS)).clamp(max=1.0)
            for g in sharded + replicated:
                g.mul_(coefficient.to(g.dtype))
        return total

    # --- sharded save / resume ---------------------------------------------------------------------------------

    def layout(self) -> dict:
        return dict(world_size=td.get_world_size() if td.is_initialized() else 1, dp=self.world_size, tp=self.tp,
                    zero=self.run.zero)

    def _own_state(self) -> dict:
        managed = {id(p) for p in self.zero.params} if self.zero is not None else set()
        model = {k: v.detach().clone() for k, v in self.module.state_dict(keep_vars=True).items()
                 if id(v) not in managed}  # ZeRO's parameters live in its shards
        return dict(identity=self._identity(), layout=self.layout(), step=self.step_count, model=model,
                    optimizer=self.optimizer.state_dict(), scaler=self.scaler.state_dict() if self.scaler else None,
                    rng=state_file.rng_state(), data=self.dataset.state_dict(), history=self.history)

    def save(self, path) -> None:
        """Write DIR/rank{r}.pt on every rank, then (rank 0, once all are written) DIR/manifest.pt."""
        path = Path(path)
        state_file.write_state(path / f"rank{self.global_rank}.pt", self._own_state())
        if td.is_initialized():
            td.barrier()
        if self.global_rank == 0:
            state_file.write_state(path / "manifest.pt", dict(layout=self.layout(), step=self.step_count,
                                                              flags=self.run.flags()))
        if td.is_initialized():
            td.barrier()

    def load_state(self, path) -> None:
        """Continue from `save(path)`: the same layout bit-exactly; another data-parallel size re-shards
        (data parallel and ZeRO); anything else, or a truncated/mismatched file, is refused (ValueError)."""
        path = Path(path)
        manifest = read_manifest(path)
        theirs, mine = manifest["layout"], self.layout()
        check_resume(manifest, self.run, mine["world_size"], path)
        same = theirs == mine
        ranks = [self.global_rank] if same else range(theirs["world_size"])
        if not same and self.zero is None:
            ranks = [self.global_rank % theirs["world_size"]]  # data parallel: every replica holds the whole state
        states = [state_file.read_state(path / f"rank{r}.pt") for r in ranks]
        for r, s in zip(ranks, states, strict=True):
            if s.get("layout") != theirs or s.get("step") != manifest["step"]:
                raise ValueError(f"{path}/rank{r}.pt (layout {s.get('layout')}, step {s.get('step')}) does not "
                                 f"belong to the manifest's save (layout {theirs}, step {manifest['step']})")
        own = states[ranks.index(self.global_rank)] if self.global_rank in ranks else states[0]
        self._check_identity(own, path)
        missing, unexpected = self.module.load_state_dict(own["model"], strict=self.zero is None)
        if unexpected:
            raise ValueError(f"{path}: unexpected entries {unexpected[:4]} in the saved model state")
        if self.zero is not None and not same:
            self.optimizer.load_resharded([s["optimizer"] for s in states])
        else:
            self.optimizer.load_state_dict(own["optimizer"])
        if self.scaler:
            self.scaler.load_state_dict(own["scaler"])
        self.dataset.load_state_dict(own["data"])
        state_file.set_rng_state(own["rng"])
        self.step_count, self.history = own["step"], list(own["history"])

    def _check_identity(self, saved: dict, path) -> None:
        mine = self._identity()
        for key in ("config", "model_config", "parameters", "schedule"):
            if saved["identity"][key] != mine[key]:
                raise ValueError(f"{path} was saved by a run with a different {key.replace('_', ' ')}; resume it "
                                 "with the saved run's flags")


def _describe(layout: dict) -> str:
    return f"world {layout['world_size']} = dp {layout['dp']} × tp {layout['tp']}, zero {layout['zero']}"


def read_manifest(path) -> dict:
    """DIR/manifest.pt, checked (ValueError when missing, truncated or not a capstone save)."""
    file = Path(path) / "manifest.pt"
    if not file.is_file():
        raise ValueError(f"--resume {path}: no manifest.pt there (not a finished `llmlab train --save` folder)")
    manifest = state_file.read_state(file)
    if not {"layout", "step", "flags"} <= set(manifest):
        raise ValueError(f"{file} is not a capstone manifest (keys {sorted(manifest)})")
    return manifest


def check_resume(manifest: dict, config: RunConfig, world_size: int, path) -> None:
    """Refuse (ValueError) resuming `manifest`'s save with other --tp/--zero (naming both layouts) or flags."""
    saved = manifest["layout"]
    here = dict(world_size=world_size, dp=world_size // config.tp, tp=config.tp, zero=config.zero)
    if (saved["tp"], saved["zero"]) != (here["tp"], here["zero"]):
        raise ValueError(f"--resume {path} holds layout {_describe(saved)}; this run is {_describe(here)}: only "
                         "the data-parallel size may change on resume (same --tp and --zero)")
    flags = config.flags()
    if manifest["flags"] != flags:
        diff = ", ".join(f"--{k.replace('_', '-')}: saved {v!r}, here {flags.get(k)!r}"
                         for k, v in manifest["flags"].items() if flags.get(k) != v)
        raise ValueError(f"--resume {path} was saved with other flags ({diff}); resume with the saved run's flags")


class _PrintLoss:
    """Monitor: one line per update on global rank 0."""

    def __init__(self, rank: int):
        self.rank = rank

    def log(self, step, metrics):
        if self.rank == 0:
            print(f"step {step:5d}  loss {metrics['loss']:.4f}  lr {metrics['lr']:.2e}  "
                  f"grad_norm {metrics['grad_norm']:.3f}  {metrics['tokens_per_s']:.0f} tok/s", flush=True)


def _groups(tp: int):
    """(tp_group, dp_group) of this rank; every rank creates every group (new_group is collective)."""
    if not td.is_initialized():
        return None, None
    world, rank = td.get_world_size(), td.get_rank()
    dp = world // tp
    if tp == 1:
        return None, None
    tp_group = dp_group = None
    for d in range(dp):
        g = td.new_group([d * tp + t for t in range(tp)])
        tp_group = g if rank // tp == d else tp_group
    for t in range(tp):
        g = td.new_group([d * tp + t for d in range(dp)])
        dp_group = g if rank % tp == t else dp_group
    return tp_group, dp_group


def run_rank(config: RunConfig, quiet: bool = False) -> dict:
    """Train per `config` on this rank (alone, or inside an initialised process group); return a summary."""
    tp_group, dp_group = _groups(config.tp)
    rank = td.get_rank() if td.is_initialized() else 0
    start = time.perf_counter()
    trainer = Capstone(config, tp_group, dp_group, monitor=None if quiet else _PrintLoss(rank))
    if config.resume:
        trainer.load_state(config.resume)
    end = config.stop_at if config.stop_at is not None else trainer.config.steps
    trainer.fit(max(end - trainer.step_count, 0))
    if config.save:
        trainer.save(config.save)
    summary = dict(rank=rank, layout=trainer.layout(), steps=trainer.step_count,
                   losses=[h["loss"] for h in trainer.history], grad_norms=[h["grad_norm"] for h in trainer.history],
                   params_here=sum(p.numel() for p in trainer.params), seconds=time.perf_counter() - start)
    if rank == 0 and not quiet:
        final = summary["losses"][-1] if summary["losses"] else float("nan")
        parts = [_describe(summary["layout"]), f"precision {trainer.config.precision}", f"accum {config.accum}"]
        parts += [f"{name} {getattr(config, name)}" for name in ("lora", "moe", "quant") if getattr(config, name)]
        parts += [name for name in ("checkpoint", "compress8") if getattr(config, name)]
        print(f"final loss {final:.4f} after {trainer.step_count} updates | {', '.join(parts)} | "
              f"{summary['params_here']} trainable parameters on rank 0 | {summary['seconds']:.1f} s"
              + (f" | saved to {config.save}" if config.save else ""), flush=True)
    return summary


def launch(config: RunConfig, quiet: bool = False) -> list[dict]:
    """Check, then run: under torchrun (RANK set) join its group; else `nproc` local ranks (spawn) or this process."""
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_torchrun and config.nproc != 1:
        raise ValueError(f"--nproc {config.nproc} under torchrun: torchrun already decides the ranks")
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else config.nproc
    check(config, world)
    if config.resume:  # a missing, truncated or foreign save is refused before any rank starts
        check_resume(read_manifest(config.resume), config, world, config.resume)
    if under_torchrun:
        from llmlab.dist import init_from_env

        init_from_env()
        return [run_rank(config, quiet)]
    if config.nproc == 1:
        return [run_rank(config, quiet)]
    from llmlab import dist

    return dist.spawn(run_rank, config.nproc, config, quiet, timeout=config.timeout)


def build_parser(prog: str = "python -m llmlab.train") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    a = p.add_argument
    a("--preset", default="tiny", choices=list(TRAIN_PRESETS), help="TrainConfig preset (model, batch, LR)")
    a("--steps", type=int, default=None, help="optimizer updates (default: the preset's)")
    a("--seed", type=int, default=0)
    a("--nproc", type=int, default=1, help="local gloo/NCCL ranks to spawn (not under torchrun)")
    a("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage over the data-parallel ranks")
    a("--tp", type=int, default=1, help="tensor-parallel degree (world = dp × tp)")
    a("--checkpoint", action="store_true", help="activation checkpointing of every block")
    a("--compress8", action="store_true", help="8-bit compression of saved activations")
    a("--precision", default=None, choices=["fp32", "bf16", "fp16"], help="default: the preset's")
    a("--accum", type=int, default=1, help="micro-batches per update")
    a("--lora", type=int, default=0, metavar="R", help="LoRA of rank R on the attention (base frozen)")
    a("--moe", type=int, default=0, metavar="E", help="MoE MLPs with E experts (top-2, dropless)")
    a("--quant", default=None, choices=list(QUANTS), help="fake-quantized training")
    a("--batch-size", type=int, default=None, help="global micro-batch rows (default: the preset's)")
    a("--block-size", type=int, default=None, help="tokens per row (default: the preset's)")
    a("--save", default=None, metavar="DIR", help="write the sharded state to DIR at the end")
    a("--resume", default=None, metavar="DIR", help="continue from DIR (a --save folder)")
    a("--stop-at", type=int, default=None, metavar="K", help="stop (and --save) after update K")
    a("--timeout", type=float, default=600.0, help="seconds the spawned ranks may take (--nproc)")
    return p


def main(argv: list[str] | None = None, prog: str = "python -m llmlab.train") -> int:
    args = build_parser(prog).parse_args(argv)
    config = RunConfig(**{f.name: getattr(args, f.name) for f in fields(RunConfig)})
    from llmlab.dist import RankError

    try:
        launch(config)
    except (ValueError, FileNotFoundError, RankError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return 0
