"""The training loop every later chapter and the capstone use: schedule, accumulation, mixed precision,
clipping, optional data parallel, metrics, and save/resume that continues bit-exactly.

One update (`Trainer.step`):
  1. set the LR of update s from the schedule (`llmlab.train.schedule.LRSchedule`);
  2. for each of `accumulation` micro-batches: forward under autocast (fp32 / bf16 / fp16), backward of
     loss / accumulation (× the loss scale for fp16); under data parallel the inner micro-batches run under
     `no_sync()`, so only the last one all-reduces;
  3. fp16: unscale the gradients and check them for inf/NaN (Micikevicius et al. 2018) — *before* clipping;
  4. clip to `grad_clip` by global norm (`llmlab.train.clip`), or just measure the norm;
  5. the optimizer steps (skipped, and the scale backed off, when fp16 gradients overflowed).

    from llmlab.train import Trainer, TrainConfig
    trainer = Trainer(config=TrainConfig.preset("tiny", steps=100))   # builds the tiny GPT and Markov data
    trainer.fit(50); trainer.save("run.pt")                           # ... later, or in another process:
    trainer = Trainer.resume("run.pt"); trainer.fit()                 # the same 50 updates as straight on

The monitor protocol: any object with `log(step: int, metrics: dict[str, float]) -> None`, called every
`log_interval` updates with `step` = the number of updates done and the metrics below. Under data parallel
every rank calls its own monitor (the metrics are the same on all ranks): give one that writes files on
rank 0 only. Metrics: loss (mean over micro-batches and ranks), lr, grad_norm (before clipping), tokens_per_s,
step_time_s, loss_scale (fp16 only), skipped (1.0 when an fp16 overflow skipped the update). A monitor that also
has `watch(model, precision=, devices=)` (`llmlab.monitor.Monitor`) is handed the model when the trainer is built
and again after a saved state is loaded, so that it can add MFU and the update/weight ratio.

What to override to compose other parts (the capstone): `build_model`, `build_dataset`, `wrap_model`,
`build_optimizer`, `build_schedule`, `loss` (e.g. add an MoE balance loss), `clip` (e.g. a norm over sharded
gradients) and `model_state` / `load_model_state` (when a wrapper holds some parameters); or pass `model`,
`dataset` and `optimizer` (an optimizer, or a function params -> optimizer) in. `state_dict()` /
`load_state_dict()` are the one save/resume path: `save`/`load_state` write and read them as one file, the
capstone as one file per rank.

Run the tests: `.venv/bin/pytest tests/test_train_trainer.py`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as td
from tqdm.auto import tqdm

from llmlab import runtime, validation
from llmlab.data import MarkovSource, SyntheticDataset
from llmlab.model import GPT, PRESETS, GPTConfig
from llmlab.parallel.ddp import DataParallel
from llmlab.precision import PRECISIONS, DynamicLossScaler, autocast
from llmlab.presets import from_preset
from llmlab.train import state as state_file
from llmlab.train.clip import clip_grad_norm, grad_norm
from llmlab.train.schedule import DECAYS, WARMUP_FORMULAS, LRSchedule

__all__ = ["TrainConfig", "TRAIN_PRESETS", "Trainer"]


@dataclass(frozen=True)
class TrainConfig:
    """What a run does. `batch_size` is the rows of one micro-batch over all ranks; an update sees
    `batch_size × accumulation` sequences of `block_size` tokens. `grad_clip=None` does not clip."""

    model: str = "tiny"  # the llmlab.model.GPTConfig preset `build_model` uses
    steps: int = 200  # optimizer updates in the run (the schedule's length)
    batch_size: int = 16
    block_size: int = 64
    lr: float = 1e-3  # peak LR
    warmup: int = 20
    min_lr: float = 1e-4
    decay: str = "cosine"  # or "constant"
    warmup_formula: str = "shifted"  # or "material": base_lr·min(step/warmup, 1), LR 0 at update 0
    weight_decay: float = 0.1
    grad_clip: float | None = 1.0
    accumulation: int = 1
    precision: str = "fp32"  # "bf16" (autocast) or "fp16" (autocast + dynamic loss scaling)
    seed: int = 0
    log_interval: int = 1

    def __post_init__(self):
        if self.model not in PRESETS:
            raise ValueError(f"model={self.model!r} is not a GPTConfig preset; choose from {list(PRESETS)}")
        for name, minimum in (("steps", 1), ("batch_size", 1), ("block_size", 1), ("warmup", 0),
                              ("accumulation", 1), ("seed", 0), ("log_interval", 1)):
            value = getattr(self, name)
            validation.integer(name, value, low=minimum)
        for name in ("lr", "min_lr", "weight_decay") + (("grad_clip",) if self.grad_clip is not None else ()):
            value = getattr(self, name)
            validation.number(name, value, low=0)
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r} must be > 0")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"grad_clip={self.grad_clip!r} must be > 0 (or None: no clipping)")
        if self.warmup > self.steps:
            raise ValueError(f"warmup={self.warmup} must be <= steps={self.steps}")
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr={self.min_lr} must be <= lr={self.lr}")
        for name, choices in (("decay", DECAYS), ("warmup_formula", WARMUP_FORMULAS), ("precision", PRECISIONS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r}; choose from {choices}")

    @classmethod
    def preset(cls, name: str, **overrides) -> TrainConfig:
        """A named preset (see `TRAIN_PRESETS`) with fields overridden, e.g. `preset("tiny", steps=50)`."""
        return from_preset(cls, TRAIN_PRESETS, name, **overrides)


# "tiny": seconds on a 2-core CPU (the tiny GPT reaches the bigram source's floor in ~150 updates);
# "small": the GPU tier's model (runtime.preset("gpu")), minutes on one GPU, bf16 autocast.
TRAIN_PRESETS = {
    "tiny": TrainConfig(),
    "small": TrainConfig(model="small", steps=2000, batch_size=32, block_size=256, lr=6e-4, warmup=100,
                         min_lr=6e-5, precision="bf16"),
}

# fields that may differ when resuming, as they do not change training: how often to log, and what the model
# recomputes in backward instead of keeping (same gradients; a state saved before the field existed lacks it)
_RESUME_EXEMPT = {"config": ("log_interval",), "model_config": ("recompute",)}
_STATE_KEYS = {"identity", "step", "model", "optimizer", "scaler", "rng", "data", "history"}  # state_dict()'s


class Trainer:
    """Train `model` (default: `build_model()`) on `dataset` (default: `build_dataset()`) per `config`.

    `data_parallel=True` (needs torch.distributed initialised: `llmlab.dist.spawn`, `Cluster`, or
    `dist.init_from_env()` under torchrun) wraps the model in `llmlab.parallel.ddp.DataParallel` over `group`
    (default: all ranks); the dataset must then give each rank its rows (`SyntheticDataset(rank=, world_size=)`,
    which `build_dataset` does). `history` holds every update's metrics, with "step".
    """

    def __init__(self, model: torch.nn.Module | None = None, dataset=None, config: TrainConfig | None = None,
                 optimizer=None, monitor=None, data_parallel: bool = False, group=None, progress: bool = True):
        self.config = config if config is not None else TrainConfig()
        if not isinstance(self.config, TrainConfig):
            raise ValueError(f"config={config!r} must be a TrainConfig (e.g. TrainConfig.preset('tiny'))")
        if monitor is not None and not callable(getattr(monitor, "log", None)):
            raise ValueError(f"monitor={monitor!r} must have a log(step, metrics) method")
        if data_parallel and not td.is_initialized():
            raise ValueError("data_parallel=True needs torch.distributed initialised (llmlab.dist.spawn, "
                             "Cluster, or dist.init_from_env() under torchrun)")
        self.group, self.data_parallel = group, data_parallel
        self.rank = td.get_rank(group) if data_parallel else 0
        self.world_size = td.get_world_size(group) if data_parallel else 1
        self.device = runtime.device()
        runtime.seed_everything(self.config.seed)  # the model's init and every later random draw
        self.module = (model if model is not None else self.build_model()).to(self.device)
        self.dataset = dataset if dataset is not None else self.build_dataset()
        self._check_dataset()
        self.model = self.wrap_model()
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        if isinstance(optimizer, torch.optim.Optimizer):
            self.optimizer = optimizer
        else:
            self.optimizer = optimizer(self.params) if optimizer is not None else self.build_optimizer(self.params)
        self.schedule = self.build_schedule()
        self.scaler = DynamicLossScaler() if self.config.precision == "fp16" else None
        self.monitor, self.progress = monitor, progress
        self.step_count = 0
        self.history: list[dict] = []
        self._watch()

    def _watch(self) -> None:
        """Hand the model, as it is now, to a monitor that follows it (see the module docstring)."""
        if self.monitor is not None and callable(getattr(self.monitor, "watch", None)):
            self.monitor.watch(self.module, precision=self.config.precision, devices=self.world_size)

    # --- factories: override to compose other parts ------------------------------------------------------

    def build_model(self) -> torch.nn.Module:
        return GPT(GPTConfig.preset(self.config.model, block_size=self.config.block_size))

    def wrap_model(self) -> torch.nn.Module:
        """What forward runs through: `self.module`, wrapped in DataParallel under `data_parallel` (override to
        wrap it otherwise, e.g. in ZeRO; a wrapper without `no_sync` then communicates every micro-batch)."""
        if not self.data_parallel:
            return self.module
        return DataParallel(self.module, group=self.group)

    def build_dataset(self):
        vocab = self.module.config.vocab_size
        return SyntheticDataset(MarkovSource(vocab, seed=self.config.seed), self.config.batch_size,
                                self.config.block_size, seed=self.config.seed, rank=self.rank,
                                world_size=self.world_size)

    def build_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """AdamW (Loshchilov & Hutter 2019) with betas (0.9, 0.95) as GPT-3 used; weight decay on matrices
        only (not on biases and LayerNorm gains), as nanoGPT does."""
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": self.config.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=self.config.lr, betas=(0.9, 0.95))

    def build_schedule(self) -> LRSchedule:
        c = self.config
        return LRSchedule(c.lr, c.steps, c.warmup, c.decay, c.min_lr, c.warmup_formula)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The scalar loss of one micro-batch x, y (B/N, T); override to add terms."""
        return self.model(x, y)[1]

    def clip(self) -> torch.Tensor:
        """Clip the (unscaled) gradients to `grad_clip`; return their global norm before clipping."""
        if self.config.grad_clip is None:
            return grad_norm(self.params)
        return clip_grad_norm(self.params, self.config.grad_clip)

    def _check_dataset(self) -> None:
        for name in ("batch_size", "block_size"):
            have, want = getattr(self.dataset, name, None), getattr(self.config, name)
            if have != want:
                raise ValueError(f"dataset.{name}={have!r} does not match config.{name}={want}")
        if getattr(self.dataset, "world_size", 1) != self.world_size:
            raise ValueError(f"dataset.world_size={self.dataset.world_size} but the trainer runs on "
                             f"{self.world_size} rank(s): build the dataset with rank= and world_size=")

    # --- training ------------------------------------------------------------------------------------------

    def step(self) -> dict:
        """One optimizer update (see the module docstring); returns its metrics."""
        c, start = self.config, time.perf_counter()
        lr = self.schedule.lr(self.step_count)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=self.device)  # (): sum of micro-batch losses
        for micro in range(c.accumulation):
            x, y = (t.to(self.device) for t in self.dataset.next_batch())  # (B/N, T) each
            last = micro == c.accumulation - 1
            sync = (self.model.no_sync() if self.data_parallel and not last and hasattr(self.model, "no_sync")
                    else contextlib.nullcontext())
            with sync:
                with autocast(c.precision, self.device):
                    loss = self.loss(x, y)
                scaled = loss.float() / c.accumulation
                (self.scaler.scale_loss(scaled) if self.scaler else scaled).backward()
            total += loss.detach().float()
        found_inf = False
        if self.scaler:  # unscale before clipping: clip_grad_norm must see the true gradients
            found_inf = self.scaler.unscale_([p.grad for p in self.params if p.grad is not None])
        norm = self.clip()
        if self.scaler:
            self.scaler.update(found_inf)
        if not found_inf:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.data_parallel:
            td.all_reduce(total, group=self.group)  # ranks' losses summed: divided by world below
        self.step_count += 1
        seconds = time.perf_counter() - start
        tokens = c.accumulation * c.batch_size * c.block_size  # over all ranks
        metrics = dict(loss=total.item() / (c.accumulation * self.world_size), lr=lr, grad_norm=float(norm),
                       tokens_per_s=tokens / seconds, step_time_s=seconds)
        if self.scaler:
            metrics.update(loss_scale=self.scaler.scale, skipped=float(found_inf))
        self.history.append(dict(step=self.step_count, **metrics))
        if self.monitor is not None and self.step_count % c.log_interval == 0:
            self.monitor.log(self.step_count, metrics)
        return metrics

    def fit(self, steps: int | None = None) -> list[dict]:
        """Run `steps` more updates (default: until `config.steps`), with a progress bar; return `history`."""
        remaining = self.config.steps - self.step_count
        steps = remaining if steps is None else steps
        validation.integer("steps", steps, 0, remaining,
                           hint=f"(config.steps={self.config.steps}, {self.step_count} done)")
        # no disable= when the bar is wanted: an explicit one would override TQDM_DISABLE (`llmlab site` sets it)
        off = {} if self.progress and self.rank == 0 else {"disable": True}
        bar = tqdm(total=self.config.steps, initial=self.step_count, desc="train", unit="step", **off)
        with bar:
            for _ in range(steps):
                metrics = self.step()
                bar.update(1)
                if self.step_count % self.config.log_interval == 0:
                    bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}")
        return self.history

    # --- save / resume -------------------------------------------------------------------------------------

    def _identity(self) -> dict:
        model_config = getattr(self.module, "config", None)
        return dict(config=asdict(self.config),
                    model_config=asdict(model_config) if model_config is not None else None,
                    parameters={n: list(p.shape) for n, p in self.module.named_parameters()},
                    schedule=self.schedule.state_dict())

    def state_dict(self) -> dict:
        """Everything a resumed run needs: identity (config, model shape, schedule), update count, model,
        optimizer, loss scaler, RNG and data positions, history. What `save` writes."""
        return dict(identity=self._identity(), step=self.step_count, model=self.model_state(),
                    optimizer=self.optimizer.state_dict(), scaler=self.scaler.state_dict() if self.scaler else None,
                    rng=state_file.rng_state(), data=self.dataset.state_dict(), history=self.history)

    def model_state(self) -> dict:
        """The model's part of `state_dict()` (override when another part, e.g. ZeRO's shards, holds some)."""
        return self.module.state_dict()

    def load_model_state(self, state: dict) -> None:
        """Load `model_state()`'s dict into the model."""
        self.module.load_state_dict(state)

    def save(self, path) -> None:
        """Write the whole training state to `path` atomically (on rank 0; every rank waits for it)."""
        if self.rank == 0:
            state_file.write_state(path, self.state_dict())
        if self.data_parallel:
            td.barrier(group=self.group)

    def load_state(self, path) -> None:
        """Continue from `save(path)`: refuses (ValueError) a truncated or corrupt file, or one saved by a run
        with another config, model shape or schedule."""
        self.load_state_dict(state_file.read_state(path), source=path)

    def load_state_dict(self, saved: dict, source="the saved state") -> None:
        """Continue from `state_dict()`'s `saved` (read from `source`, named in errors): refuses (ValueError) one
        saved by a run with another config, model shape or schedule, or one whose parts are malformed (forged or
        from another program), then restores every part of it."""
        mine = self._identity()
        if not (isinstance(saved, dict) and _STATE_KEYS <= set(saved) and isinstance(saved["identity"], dict)
                and set(mine) <= set(saved["identity"])):
            found = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            raise ValueError(f"{source} is not a Trainer state (it holds {found}; expected {sorted(_STATE_KEYS)}, "
                             f"identity with {sorted(mine)})")
        if type(saved["step"]) is not int or not 0 <= saved["step"] <= self.config.steps \
                or not isinstance(saved["history"], list):
            raise ValueError(f"{source} holds step {saved['step']!r} (an update count 0..{self.config.steps} "
                             f"expected) or a history of type {type(saved['history']).__name__} (a list expected)")
        for key, label in (("config", "TrainConfig"), ("model_config", "model config"),
                           ("parameters", "parameter names/shapes"), ("schedule", "LR schedule")):
            theirs, ours = saved["identity"][key], mine[key]
            if key in _RESUME_EXEMPT and isinstance(theirs, dict):
                theirs = {k: v for k, v in theirs.items() if k not in _RESUME_EXEMPT[key]}
                ours = {k: v for k, v in ours.items() if k not in _RESUME_EXEMPT[key]}
            if theirs != ours and not isinstance(theirs, dict | type(None)):
                raise ValueError(f"{source} holds a {label} of type {type(theirs).__name__}, not a dict")
            if theirs != ours:
                diff = sorted(k for k in set(theirs or {}) | set(ours or {})
                              if (theirs or {}).get(k) != (ours or {}).get(k))
                shown = ", ".join(f"{k}: saved {(theirs or {}).get(k)!r}, here {(ours or {}).get(k)!r}"
                                  for k in diff[:4])
                raise ValueError(f"{source} was saved by a run with a different {label} ({shown}); "
                                 "build the trainer with the saved run's settings to resume it")
        parts = {"model": self.load_model_state, "optimizer": self.optimizer.load_state_dict,
                 **({"scaler": self.scaler.load_state_dict} if self.scaler else {}),
                 "data": self.dataset.load_state_dict, "rng": state_file.set_rng_state}
        for part, restore in parts.items():
            try:
                restore(saved[part])
            except (KeyError, IndexError, TypeError, AttributeError, RuntimeError) as e:  # a malformed part's errors
                raise ValueError(f"{source} holds a malformed {part} state ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''})") from e
        self.step_count, self.history = saved["step"], list(saved["history"])
        self._watch()

    @classmethod
    def resume(cls, path, **kwargs) -> Trainer:
        """A new Trainer continuing `save(path)`; the config comes from the file unless `config=` is given
        (the other arguments are as for `Trainer(...)`, e.g. `model=` when the run used a custom model)."""
        if kwargs.get("config") is None:
            kwargs["config"] = TrainConfig(**state_file.read_state(path)["identity"]["config"])
        trainer = cls(**kwargs)
        trainer.load_state(path)
        return trainer
