"""The memory model of a training configuration: how many bytes each GPU holds, and why.

Two parts, both per GPU:

**Model state** (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", §3.1 and §5). For Ψ parameters trained with Adam in mixed precision: fp16/bf16 parameters 2Ψ,
fp16/bf16 gradients 2Ψ, and the optimizer's K·Ψ = 12Ψ (an fp32 master copy 4Ψ, momentum 4Ψ, variance 4Ψ):
16Ψ in all. In fp32: parameters 4Ψ, gradients 4Ψ, moments 8Ψ (no master copy). ZeRO shards these over the
N data-parallel ranks:

    stage 0 (plain data parallel)   2Ψ + 2Ψ + 12Ψ         = 16Ψ
    stage 1 (optimizer state)       2Ψ + 2Ψ + 12Ψ/N       = 4Ψ + 12Ψ/N
    stage 2 (+ gradients)           2Ψ + (2Ψ + 12Ψ)/N     = 2Ψ + 14Ψ/N
    stage 3 (+ parameters)          (2Ψ + 2Ψ + 12Ψ)/N     = 16Ψ/N

(The paper's Figure 1: Ψ = 7.5B, N = 64 gives 120 / 31.4 / 16.6 / 1.9 GB.) Tensor and pipeline parallelism
split the parameters first: each GPU holds about Ψ/(t·p) of them (embeddings are not split evenly; ignored).

**Activations**: what autograd saves for backward, counted op by op from llmlab.model's GPT (the same count
as Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §4: 34·sbh +
5·as²b bytes per layer in 16 bits, here for any dtype). `block_terms` lists each term of one block, `model_terms`
the embedding and head; `activation_bytes` sums them. Three ways to recompute (`checkpointing`, CHECKPOINTING):

    "none"        every block keeps block_terms: 34·sbh + 5·as²b (paper, §4)
    "selective"   the attention core is recomputed (`GPTConfig(recompute="selective")`): its as² terms,
                  `attention_core_terms`, are not kept: 34·sbh (paper, §5); one layer's core is rebuilt at a time
    "full"        every block is checkpointed (llmlab.memory.checkpoint): it keeps its input, 2·sbh (paper, §5),
                  and one block's activations are rebuilt at a time

`layer_activation_bytes` gives (kept, rebuilt) bytes per layer for each; `recompute_flops` the forward FLOPs the
recompute adds to a step.

    from llmlab.memory import planner
    planner.model_state_bytes(7.5e9, stage=1, world_size=64) / 1e9       # 31.4 (GB per GPU)
    p = planner.plan(GPTConfig.preset("gpt2"), batch_size=8, stage=2, data=8, checkpointing=True)
    p.breakdown(), p.total, p.fits(80e9)
    planner.plan(GPTConfig.preset("gpt2"), batch_size=8, checkpointing="selective").activations

Not modelled: temporaries of the backward pass (activation gradients live one layer at a time), the
allocator's fragmentation and caching, communication buffers, and the CUDA context (≈ 0.5 GB).

Claim C10 (the ZeRO paper's figures) is checked against this planner in `llmlab.claims.ch03`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from llmlab import flops, validation
from llmlab.model import GPTConfig

__all__ = ["OPTIMIZER_STATES", "PRECISIONS", "CHECKPOINTING", "ZERO_PAPER_EXAMPLE", "state_bytes_per_param",
           "model_state_bytes", "num_params", "attention_core_terms", "block_terms", "model_terms",
           "checkpointing_mode", "layer_activation_bytes", "activation_bytes", "recompute_flops", "Plan", "plan"]

# fp32 buffers an optimizer keeps per parameter: Adam(W) two moments, SGD with momentum one, plain SGD none.
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "momentum": 1, "sgd": 0}
PRECISIONS = ("mixed", "fp32")
# What is recomputed in backward: nothing, the attention core of every block, or every block (False/True: none/full)
CHECKPOINTING = ("none", "selective", "full")

# The ZeRO paper's Figure 1: a 7.5B-parameter model on 64 GPUs, per-GPU model state in GB for stages 0–3.
ZERO_PAPER_EXAMPLE = {"num_params": 7.5e9, "world_size": 64, "gb": (120.0, 31.4, 16.6, 1.9)}


def state_bytes_per_param(optimizer: str = "adam", precision: str = "mixed") -> dict[str, int]:
    """Bytes per parameter of {"params", "grads", "optimizer_state"} before any sharding."""
    validation.one_of("optimizer", optimizer, OPTIMIZER_STATES)
    validation.one_of("precision", precision, PRECISIONS)
    moments = 4 * OPTIMIZER_STATES[optimizer]
    if precision == "mixed":  # 16-bit weights and gradients; the optimizer holds fp32 masters + moments
        return {"params": 2, "grads": 2, "optimizer_state": 4 + moments}
    return {"params": 4, "grads": 4, "optimizer_state": moments}


def _sharded(num_params: float, stage: int, world_size: int, optimizer: str, precision: str) -> dict[str, float]:
    validation.number("num_params", num_params, low=0)
    validation.integer("stage", stage, 0, 3, hint="(the ZeRO stage; 0 is plain data parallel)")
    validation.integer("world_size", world_size, low=1)
    per = state_bytes_per_param(optimizer, precision)
    sharded = {"optimizer_state": stage >= 1, "grads": stage >= 2, "params": stage >= 3}
    return {k: num_params * b / (world_size if sharded[k] else 1) for k, b in per.items()}


def model_state_bytes(num_params: float, stage: int, world_size: int, optimizer: str = "adam",
                      precision: str = "mixed") -> float:
    """Bytes per GPU of parameters + gradients + optimizer state for `num_params` parameters under ZeRO
    `stage` (0 = plain data parallel) over `world_size` data-parallel ranks. Adam's step counters (one per
    parameter tensor, not per parameter) are left out."""
    return sum(_sharded(num_params, stage, world_size, optimizer, precision).values())


def num_params(config: GPTConfig) -> int:
    """Parameters of llmlab.model's GPT, all of them (position embeddings in; lm_head tied to wte).
    Per block: ln_1, ln_2 2C each (C without bias), c_attn 3C² + 3C, c_proj C² + C, c_fc 4C² + 4C,
    mlp.c_proj 4C² + C: 12C² + 13C with biases, 12C² + 2C without."""
    C, b = config.n_embd, config.bias
    block = 12 * C * C + (13 * C if b else 2 * C)
    return config.vocab_size * C + config.block_size * C + config.n_layer * block + (2 * C if b else C)


def _check_activation_args(config, batch_size, seq_len, dtype_bytes, tensor, mask_bytes) -> int:
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config={config!r} must be a GPTConfig (e.g. GPTConfig.preset('tiny'))")
    validation.integer("batch_size", batch_size, low=1)
    T = validation.integer("seq_len", config.block_size if seq_len is None else seq_len, low=1)
    if T > config.block_size:
        raise ValueError(f"seq_len={T} > block_size={config.block_size}")
    for name, v in (("dtype_bytes", dtype_bytes), ("mask_bytes", mask_bytes), ("tensor", tensor)):
        validation.integer(name, v, low=1)
    if config.n_head % tensor:
        raise ValueError(f"tensor={tensor} does not divide n_head={config.n_head}")
    return T


def attention_core_terms(config: GPTConfig, batch_size: int, seq_len: int | None = None, dtype_bytes: int = 4,
                         tensor: int = 1, mask_bytes: int = 1) -> dict[str, int]:
    """What the attention core (q·kᵀ, causal mask, softmax, dropout, ·v) saves beyond its inputs q, k, v and its
    output, on one of `tensor` ranks: what selective recompute does not keep (arguments as in `block_terms`).

    Written out, the B·h·T² terms: Korthikanti et al.'s 5·as²b bytes in 16 bits with 1-byte masks (softmax output
    2, dropout mask 1, dropped weights 2), plus the T×T causal mask. With `flash`, only the kernel's logsumexp
    (fp32, B·h·T): the fused kernels keep no T² tensor (Dao et al. 2022, "FlashAttention", §3.1: the backward
    recomputes the attention matrix from q, k, v and the logsumexp; a dropout mask is regenerated from the RNG
    state). On the CPU PyTorch's fused kernel takes no dropout (aten/src/ATen/native/transformers/
    sdp_utils_cpp.cpp, use_flash_attention_cpp: check_for_dropout), so with dropout > 0 scaled_dot_product_attention
    runs its math path there, which saves the T² terms: the count here is the GPU's.
    """
    T = _check_activation_args(config, batch_size, seq_len, dtype_bytes, tensor, mask_bytes)
    B, h, d, t = batch_size, config.n_head, dtype_bytes, tensor
    if config.flash:
        return {"logsumexp (fp32)": B * h * T * 4 // t}
    terms = {"causal mask (bool)": T * T, "softmax output": B * h * T * T * d // t}
    if config.dropout > 0:
        terms["attention dropout mask + dropped weights"] = B * h * T * T * (mask_bytes + d) // t
    return terms


def block_terms(config: GPTConfig, batch_size: int, seq_len: int | None = None, dtype_bytes: int = 4,
                tensor: int = 1, mask_bytes: int = 1) -> dict[str, int]:
    """Bytes one transformer block saves for backward, term by term, on one of `tensor` ranks.

    B = batch_size, T = seq_len (default block_size), C = n_embd, h = n_head, d = dtype_bytes. Terms split by
    Megatron tensor parallelism (heads and the 4C hidden units are spread over the t ranks) are divided by t;
    LayerNorms, the inputs of c_attn and c_fc, and the residual dropout masks are replicated. `mask_bytes` is
    a dropout mask's bytes per element: 1 on CUDA (a bool mask), d on CPU (PyTorch saves a float mask there).
    The LayerNorms' mean and 1/std (B·T each) are in d here; CUDA keeps them in fp32 for half inputs.
    The attention core's own terms are `attention_core_terms`, left out under `config.recompute == "selective"`.
    """
    T = _check_activation_args(config, batch_size, seq_len, dtype_bytes, tensor, mask_bytes)
    B, C, d, t, m = batch_size, config.n_embd, dtype_bytes, tensor, mask_bytes
    BTC, drop = B * T * C, config.dropout > 0
    terms = {
        "ln_1 input + mean, 1/std": BTC * d + 2 * B * T * d,
        "c_attn input": BTC * d,
        # q·kᵀ saves q and k, ·v saves v, the fused kernel and selective recompute's checkpoint all three: views
        # of c_attn's output, one storage
        "q, k, v (c_attn output)": 3 * BTC * d // t,
    }
    if config.recompute != "selective":
        terms.update(attention_core_terms(config, B, T, d, t, m))
    # The fused kernel writes its output laid out as (B, T, h, hs): transpose + contiguous is free, and the
    # tensor c_proj saves is the kernel's output. The written-out core's output is copied by contiguous().
    terms["attention output = attn c_proj input" if config.flash else "attn c_proj input"] = BTC * d // t
    if drop:
        terms["attn residual dropout mask"] = BTC * m
    terms["ln_2 input + mean, 1/std"] = BTC * d + 2 * B * T * d
    terms["c_fc input"] = BTC * d
    terms["GELU input (B·T·4C)"] = 4 * BTC * d // t
    terms["mlp c_proj input (B·T·4C)"] = 4 * BTC * d // t
    if drop:
        terms["mlp residual dropout mask"] = BTC * m
    return terms


def model_terms(config: GPTConfig, batch_size: int, seq_len: int | None = None, dtype_bytes: int = 4,
                mask_bytes: int = 1) -> dict[str, dict[str, int]]:
    """What the GPT saves outside its blocks: {"embedding": {...}, "head": {...}} (pipeline stage 0 holds the
    first, the last stage the second). Token ids are int64 (8 bytes); the loss's log-softmax is B·T·V."""
    T = _check_activation_args(config, batch_size, seq_len, dtype_bytes, 1, mask_bytes)
    B, C, V, d = batch_size, config.n_embd, config.vocab_size, dtype_bytes
    embedding = {"token and position ids": B * T * 8 + T * 8}
    if config.dropout > 0:
        embedding["embedding dropout mask"] = B * T * C * mask_bytes
    head = {"ln_f input + mean, 1/std": B * T * C * d + 2 * B * T * d, "lm_head input": B * T * C * d,
            "log-softmax (B·T·V) + targets + weight sum": B * T * V * d + B * T * 8 + d}
    return {"embedding": embedding, "head": head}


def checkpointing_mode(checkpointing: bool | str) -> str:
    """The CHECKPOINTING name of `checkpointing`: False is "none", True is "full" (every block checkpointed)."""
    if isinstance(checkpointing, bool):
        return "full" if checkpointing else "none"
    return validation.one_of("checkpointing", checkpointing, CHECKPOINTING, hint="(or False / True)")


def layer_activation_bytes(config: GPTConfig, batch_size: int, seq_len: int | None = None,
                           checkpointing: bool | str = False, dtype_bytes: int = 4, tensor: int = 1,
                           mask_bytes: int = 1) -> tuple[int, int]:
    """(kept, rebuilt): bytes one block keeps from its forward until its backward, and the bytes its recompute
    rebuilds for a moment during that backward, on one of `tensor` ranks (arguments as in `block_terms`).

    "none": (block_terms, 0). "selective" (or a config with recompute="selective"): (block_terms without the
    attention core, the core's terms). "full": (the block's input B·T·C·d, replicated across tensor ranks;
    the block's terms, plus the core's when the block also recomputes its core selectively).
    """
    mode = checkpointing_mode(checkpointing)
    if mode == "selective":
        config = replace(config, recompute="selective")
    block = sum(block_terms(config, batch_size, seq_len, dtype_bytes, tensor, mask_bytes).values())
    core = sum(attention_core_terms(config, batch_size, seq_len, dtype_bytes, tensor, mask_bytes).values())
    core = core if config.recompute == "selective" else 0
    if mode == "full":
        T = config.block_size if seq_len is None else seq_len
        return batch_size * T * config.n_embd * dtype_bytes, block + core
    return block, core


def activation_bytes(config: GPTConfig, batch_size: int, seq_len: int | None = None,
                     checkpointing: bool | str = False, dtype_bytes: int = 4, tensor: int = 1,
                     mask_bytes: int = 1) -> int:
    """Bytes autograd holds after the forward pass of the whole GPT on one batch (one of `tensor` ranks):
    n_layer × what a block keeps (`layer_activation_bytes` under `checkpointing`, one of CHECKPOINTING or
    False / True) + the embedding and head terms."""
    kept, _ = layer_activation_bytes(config, batch_size, seq_len, checkpointing, dtype_bytes, tensor, mask_bytes)
    outside = model_terms(config, batch_size, seq_len, dtype_bytes, mask_bytes)
    return config.n_layer * kept + sum(v for part in outside.values() for v in part.values())


# The matmuls of flops.forward_matmuls that selective recompute runs again: the attention core's two
_CORE_MATMULS = ("attn scores q·kᵀ", "attn weighted sum p·v")


def recompute_flops(config: GPTConfig, batch_size: int, seq_len: int | None = None,
                    checkpointing: bool | str = False) -> int:
    """Matmul FLOPs the recompute adds to a training step (counted by llmlab.flops.forward_matmuls): "selective"
    runs every layer's q·kᵀ and p·v again (4·B·T²·C per layer); "full" every layer's forward (24·B·T·C² +
    4·B·T²·C; the head is not recomputed); "none" nothing. A config with recompute="selective" recomputes its
    core whatever `checkpointing` says: once more on top of "full", whose rebuilt forward runs the checkpointed core
    again in its own backward. A step without recompute is 3 forwards (flops.training_step_flops)."""
    mode = checkpointing_mode(checkpointing)
    core_again = mode == "selective" or config.recompute == "selective"
    return sum(m.flops * ((mode == "full") + (core_again and m.name in _CORE_MATMULS))
               for m in flops.forward_matmuls(config, batch_size, seq_len) if m.name != "lm head")


@dataclass(frozen=True)
class Plan:
    """Bytes on the busiest GPU of a configuration, by category (see `plan`)."""

    params: float
    grads: float
    optimizer_state: float
    activations: float  # saved for backward, for all micro-batches in flight
    recompute: float  # with recompute: one block's (or attention core's) activations, rebuilt during backward
    logits: float  # the (B, T, V) output the training loop holds until backward

    def breakdown(self) -> dict[str, float]:
        return asdict(self)

    @property
    def total(self) -> float:
        return sum(self.breakdown().values())

    def fits(self, budget_bytes: float) -> bool:
        """Does the plan fit in `budget_bytes` (e.g. a GPU's memory, minus what the CUDA context takes)?"""
        if not budget_bytes > 0:
            raise ValueError(f"budget_bytes={budget_bytes!r} must be > 0")
        return self.total <= budget_bytes


def plan(config: GPTConfig, batch_size: int, seq_len: int | None = None, *, stage: int = 0, data: int = 1,
         tensor: int = 1, pipeline: int = 1, micro_batches: int | None = None, checkpointing: bool | str = False,
         optimizer: str = "adam", precision: str = "mixed", dtype_bytes: int | None = None,
         mask_bytes: int = 1) -> Plan:
    """The memory of training `config` with micro-batches of `batch_size`, on the GPU that holds the most.

    data = N ranks for ZeRO `stage`; tensor = t (Megatron), pipeline = p stages run 1F1B over `micro_batches`
    (default p): stage 0 holds min(p, micro_batches) micro-batches' activations, the last stage one, plus the
    head and the logits. Activations are in `dtype_bytes` (default 2 for mixed precision, 4 for fp32).
    `checkpointing` is one of CHECKPOINTING ("none", "selective", "full"; False / True are "none" / "full"), see
    `layer_activation_bytes`.
    """
    d = dtype_bytes if dtype_bytes is not None else (2 if precision == "mixed" else 4)
    T = _check_activation_args(config, batch_size, seq_len, d, tensor, mask_bytes)
    validation.integer("data", data, low=1)
    validation.integer("pipeline", pipeline, low=1)
    if pipeline > config.n_layer:
        raise ValueError(f"pipeline={pipeline} > n_layer={config.n_layer}: a stage needs at least one block")
    m = validation.integer("micro_batches", pipeline if micro_batches is None else micro_batches, low=1)
    state = _sharded(num_params(config) / (tensor * pipeline), stage, data, optimizer, precision)
    kept, rebuilt = layer_activation_bytes(config, batch_size, T, checkpointing, d, tensor, mask_bytes)
    outside = {k: sum(v.values()) for k, v in model_terms(config, batch_size, T, d, mask_bytes).items()}
    layers = math.ceil(config.n_layer / pipeline)
    logits = batch_size * T * config.vocab_size * d
    if pipeline == 1:
        activations, with_logits = layers * kept + outside["embedding"] + outside["head"], True
    else:
        first = min(pipeline, m) * (layers * kept + outside["embedding"])
        last = layers * kept + outside["head"]
        activations, with_logits = (first, False) if first >= last + logits else (last, True)
    return Plan(params=state["params"], grads=state["grads"], optimizer_state=state["optimizer_state"],
                activations=activations, recompute=rebuilt,
                logits=logits if with_logits else 0)
