"""Chapter 7's claim (§7, troubleshooting), measured: the material's four OOM remedies, each one's saving predicted
by the memory planner and measured under an enforced budget (C18)."""

from __future__ import annotations

import math
from dataclasses import replace

from llmlab.claims import Measurement, here, register
from llmlab.diagnose import oom
from llmlab.memory import planner, zero
from llmlab.model import GPTConfig

__all__ = ["remedies_predicted"]

# fp32 AdamW on the CPU, no dropout: the setting both the planner and the measurement use.
_FP32 = {"precision": "fp32", "optimizer": "adamw", "dtype_bytes": 4}
# The measured state includes AdamW's step counters (4 bytes per parameter tensor), which the planner leaves out:
# 4 × 28 tensors = 112 bytes for the tiny GPT, under 0.01% of what it holds; a ZeRO rank's shard adds at most
# N - 1 padding elements. 0.5% bounds both with room; a wrong term in the planner would be off by far more.
REL_TOLERANCE = 0.005


@register("C18", chapter=7)
def remedies_predicted() -> Measurement:
    config, B = GPTConfig.preset("tiny"), 16  # measure_zero's preset, so its ZeRO ranks train this very GPT
    base = planner.plan(config, B, **_FP32)
    budget = math.floor(0.8 * oom.forward_bytes(base))  # 20% short: an OOM the planner must predict
    ranked = oom.remedies(config, B, budget, zero_ranks=2, **_FP32)
    oom_seen = not oom.measure_config(config, B, budget).ok
    measured = {"none": oom.measure_config(config, B)}  # unbudgeted: what the step holds in full
    predicted_oom = not base.fits(budget)
    rows, agree = {}, True
    for r in ranked:
        if r.name == "ZeRO":  # model state on 2 real ranks (activations unchanged: same micro-batch per rank)
            z = zero.measure_zero(1, 2, preset="tiny", batch_size=2)
            got = measured["none"].state_bytes - z["bytes"].total
            rows[r.name] = got / (base.total - r.plan.total) - 1
        else:
            kw = {"checkpointing": True} if r.name == "gradient checkpointing" else {}
            cfg = replace(config, n_layer=config.n_layer // 2) if r.name == "smaller model" else config
            batch = B // 2 if r.name in ("smaller batch", "gradient accumulation") else B
            m = measured.setdefault(r.name, oom.measure_config(cfg, batch, budget, **kw))
            saving = measured["none"].total - m.total
            rows[r.name] = saving / (oom.forward_bytes(base) - oom.forward_bytes(r.plan)) - 1
            agree &= m.ok == r.fits
        agree &= abs(rows[r.name]) < REL_TOLERANCE
    holds = predicted_oom and oom_seen and agree
    return Measurement(
        value={f"{k} saving measured/predicted - 1": v for k, v in rows.items()}, unit="fraction",
        text=(f"tiny GPT ({config.n_layer} blocks) B={B}, fp32 AdamW, budget {budget / 1e6:.2f} MB: planner "
              f"{'predicts' if predicted_oom else 'does not predict'} the OOM, the enforced budget "
              f"{'raises it' if oom_seen else 'does not'}; remedies by predicted saving: "
              + ", ".join(f"{r.name} {r.saving / 1e6:.2f} MB ({'fits' if r.fits else 'OOM'}, measured "
                          f"{rows[r.name]:+.2%})" for r in ranked)),
        device=here(), verdict="holds" if holds else "wrong")
