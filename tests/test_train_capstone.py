"""The capstone `llmlab train`: multi-rank flag combinations equal the single-process run, global clipping,
sharded save/resume (same layout bit-exactly, another data-parallel size re-sharded), refusals, the commands.

The multi-rank runs call `run_rank` on every rank of one `dist.spawn` per world size — the function
`--nproc N` spawns — for many configs in a row, so process start-up is paid twice for the whole file.
"""

import shutil
import subprocess
import sys
from dataclasses import fields, replace

import pytest
import torch

from llmlab import dist
from llmlab.model import GPTConfig
from llmlab.train import state as state_file
from llmlab.train.capstone import RULES, RunConfig, build_parser, check, checkpoints, launch, main, run_rank
from llmlab.train.capstone.config import Setup

BASE = RunConfig(steps=4, batch_size=8, block_size=32)  # the tiny GPT on 8×32 tokens: ~0.1 s an update
STOP = 2  # where the save/resume runs stop and save

# Tolerances on |loss − single-process loss| over the 4 updates, from the worst measured (in brackets):
# - same arithmetic, summed in another order (DP's averaged all-reduce, TP's partial sums, checkpoint's
#   recompute): fp32 rounding, a few ulp of a loss ≈ 4 per update [4.8e-7];
EXACT = 1e-5
TOL = dict(
    # ZeRO's own AdamW decays every parameter; the Trainer's AdamW spares biases and LayerNorm gains. With
    # lr·wd = 1e-4 per update that moves the loss by ~1e-5 per update [3.0e-5; with weight_decay=0: 4.8e-7]
    zero=2e-4,
    # MoE: each rank's balance loss (coef 1e-2) is of its own tokens' routing fractions, not the batch's
    # [5.9e-5]; the task loss is routed dropless, so each token goes where it goes in one process
    moe=3e-4,
    # fake quantization: each rank's MinMax observers see only its rows, so the activation grid differs by
    # a fraction of a step (8 bits: 1/255 of the range), and LSQ's 4-bit weights amplify it [w4a8 5.3e-4]
    quant=3e-3,
    # bf16 autocast: rounding to 8 mantissa bits (4e-3 relative) of matmuls of other shapes [6.8e-5]
    bf16=5e-4,
    fp16=5e-5,  # fp16 autocast: 11 mantissa bits [3.3e-6]
)

TWO = {  # name -> (config on 2 ranks, tolerance)
    "dp": (BASE, EXACT),
    "zero1": (replace(BASE, zero=1), TOL["zero"]),
    "zero2": (replace(BASE, zero=2), TOL["zero"]),
    "zero3": (replace(BASE, zero=3), TOL["zero"]),
    "tp2": (replace(BASE, tp=2), EXACT),
    "tp2+checkpoint": (replace(BASE, tp=2, checkpoint=True), EXACT),
    "tp2+sp": (replace(BASE, tp=2, sp=True), EXACT),
    "cp2": (replace(BASE, cp=2), EXACT),
    "cp2+lora": (replace(BASE, cp=2, lora=4), EXACT),
    "checkpoint+compress8": (replace(BASE, checkpoint=True, compress8=True), EXACT),
    "lora": (replace(BASE, lora=4), EXACT),
    "lora+zero2": (replace(BASE, lora=4, zero=2), EXACT),  # only LoRA's matrices: no decayed bias/LN gain
    "moe": (replace(BASE, moe=4), TOL["moe"]),
    "moe+zero3": (replace(BASE, moe=4, zero=3), TOL["moe"] + TOL["zero"]),
    "w8a8": (replace(BASE, quant="w8a8"), TOL["quant"]),
    "w4a8": (replace(BASE, quant="w4a8"), TOL["quant"]),
    "accum2+zero2": (replace(BASE, accum=2, zero=2), TOL["zero"]),
    "accum2": (replace(BASE, accum=2), EXACT),
    "bf16": (replace(BASE, precision="bf16"), TOL["bf16"]),
    "fp16": (replace(BASE, precision="fp16"), TOL["fp16"]),
}
FOUR = {
    "dp4": (BASE, EXACT),
    "dp2×tp2": (replace(BASE, tp=2), EXACT),
    "dp2×tp2+sp+checkpoint": (replace(BASE, tp=2, sp=True, checkpoint=True), EXACT),
    "dp2×cp2": (replace(BASE, cp=2), EXACT),
    "cp4+checkpoint": (replace(BASE, cp=4, checkpoint=True), EXACT),
    "zero2": (replace(BASE, zero=2), TOL["zero"]),
    "zero3+checkpoint": (replace(BASE, zero=3, checkpoint=True), TOL["zero"]),
}


def _single(config: RunConfig) -> RunConfig:
    return replace(config, zero=0, tp=1, sp=False, cp=1, nproc=1)


def _run_all(configs):
    """On every rank: the configs one after the other (rank 0's summaries come back)."""
    torch.set_num_threads(1)  # 2 ranks on 2 shared cores: see tests/conftest.py one_thread
    return [run_rank(c, quiet=True) for c in configs]


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    root = tmp_path_factory.mktemp("capstone")
    return {name: str(root / name) for name in ("single", "zero2", "zero3", "tp2", "dp", "cp2")}


@pytest.fixture(scope="module")
def singles(saves):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for config, _ in [*TWO.values(), *FOUR.values()]:
            if _single(config) not in out:
                out[_single(config)] = run_rank(_single(config), quiet=True)
        stopped = run_rank(replace(BASE, stop_at=STOP, save=saves["single"]), quiet=True)
        resumed = run_rank(replace(BASE, resume=saves["single"]), quiet=True)
        return out, stopped, resumed
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def two_ranks(saves):
    resumable = {"zero2": TWO["zero2"][0], "zero3": TWO["zero3"][0], "tp2": TWO["tp2"][0], "dp": BASE,
                 "cp2": TWO["cp2"][0]}
    configs = [c for c, _ in TWO.values()]
    configs += [replace(c, stop_at=STOP, save=saves[n]) for n, c in resumable.items()]
    configs += [replace(resumable[n], resume=saves[n]) for n in ("zero2", "zero3")]  # the same layout
    results = dist.spawn(_run_all, 2, configs, timeout=240)[0]
    return dict(zip(TWO, results, strict=False)), results[len(TWO) + len(resumable):]


@pytest.fixture(scope="module")
def four_ranks(two_ranks, saves):
    configs = [c for c, _ in FOUR.values()]
    # 2-rank saves resumed on 4 ranks: ZeRO-2 and ZeRO-3 re-sharded, data parallel, dp1×tp2 → dp2×tp2 and
    # dp1×cp2 → dp2×cp2
    resumed = [replace(TWO["zero2"][0], resume=saves["zero2"]), replace(TWO["zero3"][0], resume=saves["zero3"]),
               replace(BASE, tp=2, resume=saves["tp2"]), replace(BASE, resume=saves["dp"]),
               replace(BASE, cp=2, resume=saves["cp2"])]
    results = dist.spawn(_run_all, 4, configs + resumed, timeout=240)[0]
    return dict(zip(FOUR, results, strict=False)), results[len(FOUR):]


def _max_diff(a, b):
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("world", [2, 4])
def test_multi_rank_runs_reach_the_single_process_loss(world, singles, two_ranks, four_ranks):
    table, results = (TWO, two_ranks[0]) if world == 2 else (FOUR, four_ranks[0])
    reference = singles[0]
    for name, (config, tol) in table.items():
        mine, one = results[name], reference[_single(config)]
        assert mine["layout"]["world_size"] == world and mine["steps"] == config.steps
        assert _max_diff(mine["losses"], one["losses"]) <= tol, name
        if not config.lora:  # LoRA adapts a frozen *random* base here: 4 small updates need not lower it
            assert mine["losses"][-1] < mine["losses"][0], name  # it trains


@pytest.mark.parametrize("world", [2, 4])
def test_clipping_norm_is_global_over_shards(world, singles, two_ranks, four_ranks):
    """The first update's norm (same weights, same global batch) equals the unsharded model's: ZeRO's
    shards and TP's sharded weights all-reduced as squares, replicated tensors (LayerNorms, embeddings, the
    averaged DP gradients) counted once. A local norm would be 0 under ZeRO-2/3 (p.grad is freed) and too
    small or too large under TP. fp32 sums in another order: 1e-6 relative."""
    table, results = (TWO, two_ranks[0]) if world == 2 else (FOUR, four_ranks[0])
    for name, (config, _) in table.items():
        if config.quant or config.moe or config.precision:  # their first gradients differ within TOL already
            continue
        one = singles[0][_single(config)]["grad_norms"][0]
        if not config.lora:  # grad_clip = 1.0: the coefficient is applied, so the losses above check it too
            assert one > 1.0
        assert results[name]["grad_norms"][0] == pytest.approx(one, rel=1e-6), name


def test_resume_continues_bit_exactly_on_the_same_layout(singles, two_ranks, saves):
    _, stopped, resumed = singles
    straight = singles[0][_single(BASE)]
    assert stopped["steps"] == STOP and resumed["losses"] == straight["losses"]
    zero2_resumed, zero3_resumed = two_ranks[1][-2:]
    assert zero2_resumed["losses"] == two_ranks[0]["zero2"]["losses"]
    assert zero3_resumed["losses"] == two_ranks[0]["zero3"]["losses"]
    manifest = state_file.read_state(checkpoints.resolve(saves["zero2"]) / "manifest.pt")
    assert manifest["step"] == STOP and manifest["layout"] == dict(world_size=2, dp=2, cp=1, tp=1, zero=2)


def test_resume_onto_another_data_parallel_size(two_ranks, four_ranks):
    """2-rank saves continue on 4 ranks: the same updates, summed in another order (EXACT)."""
    zero2, zero3, tp, dp, cp = four_ranks[1]
    assert zero2["layout"]["dp"] == 4 and tp["layout"] == dict(world_size=4, dp=2, cp=1, tp=2, zero=0)
    assert cp["layout"] == dict(world_size=4, dp=2, cp=2, tp=1, zero=0)
    for name, resumed in (("zero2", zero2), ("zero3", zero3), ("tp2", tp), ("dp", dp), ("cp2", cp)):
        straight = two_ranks[0][name]["losses"]
        assert resumed["losses"][:STOP] == straight[:STOP], name  # the saved history
        assert _max_diff(resumed["losses"], straight) <= EXACT, name


def test_resume_refusals_happen_before_any_rank_starts(two_ranks, saves, tmp_path):
    with pytest.raises(ValueError, match=r"layout world 2 = dp 2 × tp 1, zero 2.*this run is world 4 = dp 4 × tp 1, "
                                         r"zero 1"):
        launch(replace(TWO["zero2"][0], zero=1, nproc=4, resume=saves["zero2"]))
    with pytest.raises(ValueError, match=r"layout world 2 = dp 1 × cp 2 × tp 1, zero 0.*this run is world 2 = dp 2 × "
                                         r"tp 1, zero 0: only the data-parallel size may change"):
        launch(replace(BASE, nproc=2, resume=saves["cp2"]))
    with pytest.raises(ValueError, match=r"other flags \(--lora: saved 0, here 4\)"):
        launch(replace(TWO["zero2"][0], lora=4, nproc=2, resume=saves["zero2"]))
    with pytest.raises(ValueError, match="no complete checkpoint there"):
        launch(replace(BASE, resume=str(tmp_path)))
    cut = tmp_path / "cut"
    shutil.copytree(saves["zero2"], cut)
    file = checkpoints.resolve(cut) / "manifest.pt"
    file.write_bytes(file.read_bytes()[:-10])
    with pytest.raises(ValueError, match="truncated"):
        launch(replace(TWO["zero2"][0], nproc=2, resume=str(cut)))


def test_truncated_rank_file_is_refused(singles, saves, tmp_path, one_thread):
    cut = tmp_path / "cut"
    shutil.copytree(saves["single"], cut)
    file = checkpoints.resolve(cut) / "rank0.pt"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="rank0.pt is truncated"):
        launch(replace(BASE, resume=str(cut)))


# One case per row of the composition table config.RULES, in its order: (config, world size, the message).
RULE_CASES = [
    (replace(BASE, tp=2), 3, "--tp 2 does not divide the world size 3"),
    (replace(BASE, cp=2), 3, r"--cp 2 × --tp 1 does not divide the world size 3 \(world = dp × cp × tp\)"),
    (replace(BASE, tp=8), 8, "--tp 8 does not divide the tiny model's n_head=4"),
    (replace(BASE, sp=True), 2, "--sp cuts the tokens over the tensor-parallel ranks: it needs --tp >= 2"),
    (replace(BASE, tp=2, sp=True, block_size=31), 2, "--sp with --tp 2: each tensor-parallel rank takes "
                                                     "block_size/tp tokens, and --block-size 31 is not divisible"),
    (replace(BASE, cp=2, tp=2), 4, "--cp 2 with --tp 2: ring attention runs whole heads"),
    (replace(BASE, cp=2, block_size=30), 2, "--cp 2: the zig-zag layout cuts each sequence into 2·cp chunks, and "
                                            "--block-size 30 is not divisible by 2·2"),
    (BASE, 3, "data-parallel size 3 .* does not divide the batch size 8"),
    (replace(BASE, stop_at=5), 1, "--stop-at 5 is past --steps 4"),
    (replace(BASE, zero=3), 1, "--zero 3 shards over data-parallel ranks: it needs a data-parallel size >= 2"),
    (replace(BASE, zero=1, tp=2), 4, "--zero 1 with --tp 2"),
    (replace(BASE, zero=2, precision="fp16"), 2, "--zero 2 with --precision fp16"),
    (replace(BASE, tp=2, precision="fp16"), 2, "--tp 2 with --precision fp16"),
    (replace(BASE, cp=2, zero=1), 4, "--cp 2 with --zero 1"),
    (replace(BASE, cp=2, precision="fp16"), 2, "--cp 2 with --precision fp16"),
    (replace(BASE, cp=2, moe=4), 2, "--cp 2 with --moe"),
    (replace(BASE, cp=2, compress8=True), 2, "--cp 2 with --compress8"),
    (replace(BASE, tp=2, lora=4), 2, "--tp 2 with --lora"),
    (replace(BASE, tp=2, moe=4), 2, "--tp 2 with --moe"),
    (replace(BASE, tp=2, quant="w8a8"), 2, "--tp 2 with --quant"),
    (replace(BASE, lora=4, quant="w4a8"), 1, "--lora with --quant"),
    (replace(BASE, moe=4, checkpoint=True), 1, "--moe with --checkpoint"),
    (replace(BASE, moe=1), 1, "--moe 1"),
    (replace(BASE, save_every=2), 1, "--save-every 2 without --save DIR"),
    (replace(BASE, overwrite=True), 1, "--overwrite without --save DIR"),
    (replace(BASE, timeout=0.0), 1, r"--timeout 0.0 must be a finite number of seconds > 0"),
]
FLAG_CASES = [  # one flag alone, from its field's metadata (low, choices)
    (replace(BASE, accum=0), 1, "--accum 0 must be an int >= 1"),
    (replace(BASE, seed=-1), 1, "--seed -1 must be an int >= 0"),
    (replace(BASE, quant="int3"), 1, "--quant 'int3': choose from"),
    (replace(BASE, zero=4), 1, r"--zero 4: choose from \(0, 1, 2, 3\)"),
    (replace(BASE, steps=True), 1, "--steps True must be an int >= 1"),
]


@pytest.mark.parametrize("config, world, message", RULE_CASES + FLAG_CASES)
def test_bad_combinations_fail_fast(config, world, message):
    with pytest.raises(ValueError, match=message):
        check(config, world)
    with pytest.raises(ValueError, match=message):  # launch checks before spawning: no rank starts
        launch(replace(config, nproc=world))


def test_each_row_of_the_rule_table_refuses_with_its_own_message():
    assert len(RULE_CASES) == len(RULES)
    for row, (config, world, _) in enumerate(RULE_CASES):
        train = config.train_config()
        setup = Setup(config, train, GPTConfig.preset(train.model, block_size=train.block_size), world)
        holding = [i for i, rule in enumerate(RULES) if rule.refused(setup)]
        assert holding[0] == row, (row, holding)  # the row this case is for is the first that refuses it
        with pytest.raises(ValueError) as refused:
            check(config, world)
        assert str(refused.value) == RULES[row].message.format(**setup.names())


def test_every_flag_comes_from_a_runconfig_field():
    actions = {a.dest: a for a in build_parser()._actions if a.dest != "help"}
    assert list(actions) == [f.name for f in fields(RunConfig)]
    for f in fields(RunConfig):
        action = actions[f.name]
        assert action.option_strings == ["--" + f.name.replace("_", "-")]
        assert action.default == f.default and action.help == f.metadata["help"]
    assert RunConfig.from_args(build_parser().parse_args([])) == RunConfig()
    assert set(RunConfig().flags()) == {f.name for f in fields(RunConfig)} - {
        "nproc", "save", "save_every", "keep", "overwrite", "resume", "stop_at", "timeout"}


def test_nproc_under_torchrun_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["--nproc", "2", "--steps", "2"]) == 2
    assert "--nproc 2 under torchrun" in capsys.readouterr().err


def test_commands():
    helped = subprocess.run([sys.executable, "-m", "llmlab.train", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert helped.returncode == 0 and "--zero" in helped.stdout and "torchrun" in helped.stdout
    ran = subprocess.run([sys.executable, "-m", "llmlab.cli", "train", "--steps", "2", "--preset", "tiny"],
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert [line.split()[:2] for line in lines[:2]] == [["step", "1"], ["step", "2"]]
    assert lines[-1].startswith("final loss ") and "world 1 = dp 1 × tp 1" in lines[-1]
    bad = subprocess.run([sys.executable, "-m", "llmlab.cli", "train", "--nproc", "3", "--tp", "2"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--tp 2 does not divide the world size 3" in bad.stderr
