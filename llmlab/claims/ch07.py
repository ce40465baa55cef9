"""Chapter 7's claim (§7, troubleshooting), measured: the material's four OOM remedies and the ones ranked beside
them (memory-efficient attention, ZeRO-1/2/3, CPU offload), each one's saving predicted by the memory planner and,
where it runs on a CPU, measured under an enforced budget (C18)."""

from __future__ import annotations

import math

from llmlab.claims import Measurement, here, register
from llmlab.diagnose import oom
from llmlab.memory import planner
from llmlab.model import GPTConfig

__all__ = ["remedies_predicted"]

# fp32 AdamW on the CPU, no dropout: the setting both the planner and the measurement use.
_FP32 = {"precision": "fp32", "optimizer": "adamw", "dtype_bytes": 4}
# The measured state includes AdamW's step counters (4 bytes per parameter tensor), which the planner leaves out:
# 4 × 28 tensors = 112 bytes for the tiny GPT, under 0.01% of what it holds; a ZeRO rank keeps none, and its shard
# adds at most N - 1 padding elements. 0.5% of a saving bounds these with room; a wrong term in the planner would be
# off by far more.
REL_TOLERANCE = 0.005


@register("C18", chapter=7)
def remedies_predicted() -> Measurement:
    config, B = GPTConfig.preset("tiny"), 16
    base = planner.plan(config, B, **_FP32)
    budget = math.floor(0.8 * oom.forward_bytes(base))  # 20% short: an OOM the planner must predict
    ranked = oom.remedies(config, B, budget, zero_ranks=2, **_FP32)
    oom_seen = not oom.measure_config(config, B, budget).ok
    full = oom.measure_config(config, B)  # unbudgeted: what the step holds in full
    measured = oom.measure_remedies(ranked, budget)  # ZeRO on 2 real ranks; offload has no CPU counterpart
    # per remedy: the saving measured (the full step's bytes less the remedy's) against the saving planned, - 1; a
    # ZeRO rank holds exactly its plan, so its +0.0x% is the full step's AdamW step counters, in the measured saving
    predicted_oom = not base.fits(budget)
    rows, agree = {}, True
    for r in ranked:
        if r.name in measured:
            held, under = measured[r.name]
            rows[r.name] = (full.total - held.total) / (oom.forward_bytes(base) - oom.forward_bytes(r.plan)) - 1
            agree &= under.ok == r.fits and abs(rows[r.name]) < REL_TOLERANCE

    def verdict(r: oom.Remedy) -> str:
        if r.name not in measured:
            return "predicted only: a CPU has no GPU memory to offload from"
        return (f"measured saving vs planned {rows[r.name]:+.2%}, "
                f"{'fits' if measured[r.name][1].ok else 'OOM'} under the budget")

    holds = predicted_oom and oom_seen and agree
    return Measurement(
        value={f"{k} saving measured/predicted - 1": v for k, v in rows.items()}, unit="fraction",
        text=(f"tiny GPT ({config.n_layer} blocks) B={B}, fp32 AdamW, budget {oom.binary_size(budget)}: planner "
              f"{'predicts' if predicted_oom else 'does not predict'} the OOM, the enforced budget "
              f"{'raises it' if oom_seen else 'does not'}; remedies cheapest first (planned saving, fits?): "
              + "; ".join(f"{r.name} saves {oom.binary_size(r.saving)} planned ({'fits' if r.fits else 'OOM'}; "
                          f"{verdict(r)})"
                          for r in ranked)),
        device=here(), verdict="holds" if holds else "wrong")
