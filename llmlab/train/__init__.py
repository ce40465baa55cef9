"""Training: LR schedules (`schedule`), gradient clipping (`clip`), the Trainer (`trainer`) and its state files
(`state`), a sweep of warmup length × peak LR on the tiny GPT (`sweep`: chapter 6, claim C16), and the capstone
command `llmlab train` (`capstone`, a package composing the workbook's parts on the
Trainer). See each module's docstring; the Trainer's is the place to start.

    from llmlab.train import Trainer, TrainConfig
    Trainer(config=TrainConfig.preset("tiny", steps=50)).fit()
"""

from llmlab.train.clip import clip_grad_norm, grad_norm
from llmlab.train.schedule import LRSchedule, material_warmup_lr, warmup_cosine_lr
from llmlab.train.trainer import TRAIN_PRESETS, TrainConfig, Trainer

__all__ = ["Trainer", "TrainConfig", "TRAIN_PRESETS", "LRSchedule", "warmup_cosine_lr", "material_warmup_lr",
           "clip_grad_norm", "grad_norm"]
