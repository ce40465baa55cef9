"""The capstone's run configuration and its composition rules, as data.

`RunConfig` is every flag of `llmlab train`: each field's default, type and help (in its metadata) are the one
source the command line is generated from (`add_flags`). `check` validates each flag on its own (the `low` and
`choices` of its metadata), then the combinations: `RULES` is the table of what does not compose, each row a
`Rule`: when it is refused (a predicate over the run's `Setup`) and the message, checked in order before any rank
starts.
"""

from __future__ import annotations

import argparse
import math
import types
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import NamedTuple, get_type_hints

from llmlab import validation
from llmlab.model import GPTConfig
from llmlab.precision import PRECISIONS
from llmlab.train.trainer import TRAIN_PRESETS, TrainConfig

__all__ = ["RunConfig", "Setup", "Rule", "RULES", "QUANTS", "check", "add_flags"]

QUANTS = ("w8a8", "w4a8")


def _flag(default, help: str, *, low: int | None = None, choices=None, metavar: str | None = None,
          training: bool = True):
    """A RunConfig field: `help` for --help, `low` (ints) and `choices` checked by `check`, `metavar` for --help;
    `training=False`: the flag does not change what is trained (a resumed run may differ in it)."""
    return field(default=default, metadata=dict(help=help, low=low, choices=choices, metavar=metavar,
                                                training=training))


@dataclass(frozen=True)
class RunConfig:
    """The command's flags (see llmlab.train.capstone); None picks the preset's value."""

    preset: str = _flag("tiny", "TrainConfig preset (model, batch, LR)", choices=tuple(TRAIN_PRESETS))
    steps: int | None = _flag(None, "optimizer updates (default: the preset's)", low=1)
    seed: int = _flag(0, "seed of the model's initialisation and of the data", low=0)
    nproc: int = _flag(1, "local gloo/NCCL ranks to spawn (not under torchrun)", low=1, training=False)
    zero: int = _flag(0, "ZeRO stage over the data-parallel ranks", choices=(0, 1, 2, 3))
    tp: int = _flag(1, "tensor-parallel degree (world = dp × cp × tp)", low=1)
    cp: int = _flag(1, "context-parallel degree: each sequence cut over CP ranks (zig-zag), attention by the ring",
                    low=1)
    sp: bool = _flag(False, "sequence parallelism with --tp (Megatron-SP: norms, dropouts, residuals on T/tp tokens)")
    checkpoint: bool = _flag(False, "activation checkpointing of every block")
    compress8: bool = _flag(False, "8-bit compression of saved activations")
    precision: str | None = _flag(None, "default: the preset's", choices=PRECISIONS)
    accum: int = _flag(1, "micro-batches per update", low=1)
    lora: int = _flag(0, "LoRA of rank R on the attention (base frozen)", low=0, metavar="R")
    moe: int = _flag(0, "MoE MLPs with E experts (top-2, dropless)", low=0, metavar="E")
    quant: str | None = _flag(None, "fake-quantized training", choices=QUANTS)
    batch_size: int | None = _flag(None, "global micro-batch rows (default: the preset's)", low=1)
    block_size: int | None = _flag(None, "tokens per row (default: the preset's)", low=1)
    save: str | None = _flag(None, "save checkpoints in DIR (DIR/step-N/, one per save; always at the end)",
                             metavar="DIR", training=False)
    save_every: int | None = _flag(None, "also save every N updates", low=1, metavar="N", training=False)
    keep: int = _flag(2, "keep the K newest checkpoints in DIR", low=1, metavar="K", training=False)
    overwrite: bool = _flag(False, "--save into a DIR holding another run, or this run further on: replace it",
                            training=False)
    resume: str | None = _flag(None, "continue from the newest complete checkpoint in DIR (or from DIR/step-N)",
                               metavar="DIR", training=False)
    stop_at: int | None = _flag(None, "stop (and --save) after update K", low=1, metavar="K", training=False)
    timeout: float = _flag(600.0, "hang detector: fail, with every rank's stack, when no update finished for T "
                                  "seconds", metavar="T", training=False)

    def train_config(self) -> TrainConfig:
        base = TRAIN_PRESETS[self.preset]
        steps = base.steps if self.steps is None else self.steps
        return replace(base, steps=steps, warmup=min(base.warmup, steps), seed=self.seed, accumulation=self.accum,
                       precision=self.precision or base.precision, batch_size=self.batch_size or base.batch_size,
                       block_size=self.block_size or base.block_size)

    def flags(self) -> dict:
        """The flags that change the training (what a resumed run must repeat)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata["training"]}

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunConfig:
        """The RunConfig of `add_flags`' parsed command line."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def _flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """One --flag per RunConfig field: its default, its type (a bool is a switch), help, choices and metavar."""
    hints = get_type_hints(RunConfig)
    for f in fields(RunConfig):
        kind = hints[f.name]
        if isinstance(kind, types.UnionType):  # X | None: the flag takes an X
            kind = next(t for t in kind.__args__ if t is not type(None))
        meta = f.metadata
        if kind is bool:
            parser.add_argument(_flag_name(f.name), action="store_true", help=meta["help"])
            continue
        extra = {k: meta[k] for k in ("choices", "metavar") if meta[k] is not None}
        parser.add_argument(_flag_name(f.name), type=kind, default=f.default, help=meta["help"], **extra)
    return parser


@dataclass(frozen=True)
class Setup:
    """What the rules look at: the flags, the TrainConfig they give, the model, and the world = dp × cp × tp."""

    run: RunConfig
    train: TrainConfig
    model: GPTConfig
    world: int

    @property
    def tp(self) -> int:
        return self.run.tp

    @property
    def cp(self) -> int:
        return self.run.cp

    @property
    def dp(self) -> int:
        return self.world // (self.run.tp * self.run.cp)

    def names(self) -> dict:
        """What a rule's message may name: every flag, the resolved precision, steps and batch size, the model's
        n_head and n_embd, dp and the world size (and the resolved block size)."""
        return {**asdict(self.run), "precision": self.train.precision, "steps": self.train.steps,
                "batch_size": self.train.batch_size, "block_size": self.train.block_size,
                "n_head": self.model.n_head, "n_embd": self.model.n_embd,
                "dp": self.dp, "world": self.world}


class Rule(NamedTuple):
    """A combination that does not compose: refused when `refused(setup)` is true, with `message` formatted by
    `setup.names()`."""

    refused: Callable[[Setup], object]
    message: str


# What does not compose, checked in this order: the first rule that holds is raised.
RULES: tuple[Rule, ...] = tuple(Rule(*row) for row in (
    (lambda s: s.world % s.tp, "--tp {tp} does not divide the world size {world} (world = dp × cp × tp)"),
    (lambda s: s.world % (s.tp * s.cp), "--cp {cp} × --tp {tp} does not divide the world size {world} "
                                        "(world = dp × cp × tp)"),
    (lambda s: s.tp > 1 and (s.model.n_head % s.tp or s.model.n_embd % s.tp),
     "--tp {tp} does not divide the {preset} model's n_head={n_head} (or n_embd={n_embd}): each tensor-parallel "
     "rank takes n_head/tp whole heads"),
    (lambda s: s.run.sp and s.tp < 2, "--sp cuts the tokens over the tensor-parallel ranks: it needs --tp >= 2"),
    (lambda s: s.run.sp and s.train.block_size % s.tp, "--sp with --tp {tp}: each tensor-parallel rank takes "
                                                       "block_size/tp tokens, and --block-size {block_size} is not "
                                                       "divisible by {tp}"),
    (lambda s: s.cp > 1 and s.tp > 1, "--cp {cp} with --tp {tp}: ring attention runs whole heads of a plain block; "
                                      "inside the tensor-parallel block it is not supported"),
    (lambda s: s.cp > 1 and s.train.block_size % (2 * s.cp), "--cp {cp}: the zig-zag layout cuts each sequence into "
                                                             "2·cp chunks, and --block-size {block_size} is not "
                                                             "divisible by 2·{cp}"),
    (lambda s: s.train.batch_size % s.dp, "the data-parallel size {dp} (world {world} / (--cp {cp} × --tp {tp})) "
                                          "does not divide the batch size {batch_size} (--batch-size)"),
    (lambda s: s.run.stop_at is not None and s.run.stop_at > s.train.steps, "--stop-at {stop_at} is past --steps "
                                                                            "{steps}"),
    (lambda s: s.run.zero and s.dp < 2, "--zero {zero} shards over data-parallel ranks: it needs a data-parallel "
                                        "size >= 2, here {dp} (use --nproc, or torchrun)"),
    (lambda s: s.run.zero and s.tp > 1, "--zero {zero} with --tp {tp}: ZeRO here shards a data-parallel group of "
                                        "whole replicas; combining it with tensor parallelism is not supported"),
    (lambda s: s.run.zero and s.train.precision == "fp16", "--zero {zero} with --precision fp16: ZeRO keeps its "
                                                           "gradients as shards, which the fp16 loss scaler does not "
                                                           "unscale"),
    (lambda s: s.tp > 1 and s.train.precision == "fp16", "--tp {tp} with --precision fp16: each rank would detect "
                                                         "overflow in its own shard and the ranks could disagree on "
                                                         "skipping a step"),
    (lambda s: s.cp > 1 and s.run.zero, "--cp {cp} with --zero {zero}: ZeRO shards over the data-parallel ranks "
                                        "only, and the context-parallel ranks' gradients are averaged after it; not "
                                        "supported together"),
    (lambda s: s.cp > 1 and s.train.precision == "fp16", "--cp {cp} with --precision fp16: each rank would detect "
                                                         "overflow in its own tokens' gradients and the ranks could "
                                                         "disagree on skipping a step"),
    (lambda s: s.cp > 1 and s.run.moe, "--cp {cp} with --moe: the balance loss is over a rank's own tokens; not "
                                       "supported together"),
    (lambda s: s.cp > 1 and s.run.compress8, "--cp {cp} with --compress8: the 8-bit compression would round the "
                                             "logsumexp ring attention saves, which its backward rescales by"),
    (lambda s: s.tp > 1 and s.run.lora, "--tp {tp} with --lora: LoRA wraps nn.Linear layers, tensor parallelism "
                                        "replaces them with sharded ones"),
    (lambda s: s.tp > 1 and s.run.moe, "--tp {tp} with --moe: the Megatron block splits a dense MLP, not experts"),
    (lambda s: s.tp > 1 and s.run.quant, "--tp {tp} with --quant: fake quantization wraps nn.Linear layers, tensor "
                                         "parallelism replaces them with sharded ones"),
    (lambda s: s.run.lora and s.run.quant, "--lora with --quant: LoRA and fake quantization both replace the "
                                           "attention's nn.Linear layers; not supported together"),
    (lambda s: s.run.moe and s.run.checkpoint, "--moe with --checkpoint: the MoE balance loss is a side output that "
                                               "checkpointing (which keeps only the block's output) would detach"),
    (lambda s: s.run.moe == 1, "--moe 1: top-2 routing needs at least 2 experts"),
    (lambda s: s.run.save_every and not s.run.save, "--save-every {save_every} without --save DIR: nowhere to save"),
    (lambda s: s.run.overwrite and not s.run.save, "--overwrite without --save DIR: nothing to overwrite"),
    (lambda s: not (s.run.timeout > 0 and math.isfinite(s.run.timeout)),
     "--timeout {timeout} must be a finite number of seconds > 0 (the longest an update may take)"),
))


def _check_flag(f, value) -> None:
    low, choices, flag = f.metadata["low"], f.metadata["choices"], _flag_name(f.name)
    if choices is not None and value not in choices and not (value is None and f.default is None):
        raise ValueError(f"{flag} {value!r}: choose from {choices}")
    if low is not None and value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                                  or value < low):  # a flag's wording: "--steps 0", not "steps=0"
        raise ValueError(f"{flag} {value!r} must be an int >= {low}")


def check(config: RunConfig, world_size: int) -> TrainConfig:
    """Refuse (ValueError naming the flags) what does not compose on `world_size` ranks; return the TrainConfig.
    Runs before any rank starts."""
    if not isinstance(config, RunConfig):
        raise ValueError(f"config={config!r} must be a RunConfig")
    validation.positive_int("world_size", world_size)
    for f in fields(config):
        _check_flag(f, getattr(config, f.name))
    train = config.train_config()  # TrainConfig checks the values it holds itself
    setup = Setup(config, train, GPTConfig.preset(train.model, block_size=train.block_size), world_size)
    for rule in RULES:
        if rule.refused(setup):
            raise ValueError(rule.message.format(**setup.names()))
    return train
