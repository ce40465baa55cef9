"""Chapter 7's exercise checks (llmlab.checks.ch07).

7.1: the fixed training script passes, the starter fails naming all five planted faults, each fault left alone is
named precisely, an unwritten script reads not attempted, and a script that breaks the contract (wrong reported
losses, too many steps, too slow, too little training) fails saying so. `script(...)` is the exercise's training
script with each fault switchable, written the way the starter and the solution notebook write it; `script()` is
the solution, `script(**STARTER)` the starter.

7.2–7.4: each answer is the solution notebook's, with switches for the mistakes a learner makes (`fix_oom`,
`find_hang`, `first_nonfinite` with no arguments are the solutions); each mistake is named with its hint.
"""

import re
import time
from dataclasses import replace
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from check_answers import Mistake, Reference
from grading import fails, not_attempted

from llmlab import dist
from llmlab.checks import ch07, ch07_oom
from llmlab.diagnose import hang, oom
from llmlab.diagnose.oom import COSTS
from llmlab.memory import planner
from llmlab.model import GPTConfig

HINTS = {  # a fragment of the hint each fault, or other mistake, is given (in one of its stages, not the message)
    "data": "rows[:, 1:]", "loss": "with no softmax before", "accumulation": "(loss / accum_steps).backward()",
    "zero_grad": "once at the start of every step", "learning rate": "a tenth of the lr at the curve's minimum",
    "reported loss": "undivided, append", "too slow": "with every fault fixed", "loop": "then optimizer.step() once",
}


def script(lr=3e-3, shift=True, softmax=False, divide=True, zero="step", report_divided=False, extra_steps=0):
    def train(model, batches, steps, accum_steps=2):
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        losses = []
        for step in range(steps + extra_steps):
            if zero == "step":
                optimizer.zero_grad()
            total = 0.0
            for micro in range(accum_steps):
                if zero == "micro":
                    optimizer.zero_grad()
                rows = batches(step * accum_steps + micro)  # (B, T+1)
                x, y = rows[:, :-1], (rows[:, 1:] if shift else rows[:, :-1])  # (B, T) each
                logits, _ = model(x)  # (B, T, V)
                scores = F.softmax(logits, dim=-1) if softmax else logits  # (B, T, V)
                loss = F.cross_entropy(scores.flatten(0, 1), y.flatten())
                (loss / accum_steps if divide else loss).backward()
                total += loss.item() / (accum_steps if report_divided else 1)
            optimizer.step()
            losses.append(total / accum_steps)
        return losses

    return train


STARTER = dict(lr=1.0, shift=False, softmax=True, divide=False, zero=None)
MESSAGES = {  # each planted fault, as the check names it
    "data": r"data: targets equal the inputs: not shifted, so the model learns to copy .*check_targets",
    "loss": r"loss: the loss is cross_entropy of softmax\(logits\).* perfect prediction costs 3\.19.*check_loss",
    "accumulation": r"accumulation: the accumulated gradient is [234]× the gradient of the mean loss: each "
                    r"micro-batch's loss is not divided by accum_steps=[234]",
    "zero_grad": r"zero_grad: at the second optimizer step the gradient still holds the first step's: "
                 r"optimizer.zero_grad\(\) is never called",
    "learning rate": r"learning rate: lr=1 is past the minimum of the LR range test's curve .*lr_range_test",
}
ONE_FAULT = {"data": dict(shift=False), "loss": dict(softmax=True), "accumulation": dict(divide=False),
             "zero_grad": dict(zero=None), "learning rate": dict(lr=1.0)}


def never_steps(model, batches, steps, accum_steps=2):
    with torch.no_grad():
        return [float(model(batches(0)[:, :-1])[0].sum()) for _ in range(steps)]


def only(fault: str) -> str:
    """The message of a script with `fault` alone left: that fault named, the others fixed."""
    others = ", ".join(f for f in ch07.FAULTS if f != fault)
    return (rf"^❌ Exercise 7.1 \(find the bugs\): failed — 1 of 5 faults remain — {MESSAGES[fault]}.*; "
            rf"fixed: {others}\. Hint 1 of 3:")


# --- 7.2 ---------------------------------------------------------------------------------------------------------

def fix_oom(plan, config, batch_size, budget_bytes, data, *, zero3="all", offload="state", rank="cost",
            strict=False, dominant_of="all", report="after"):
    """The solution's fix_oom. zero3="no params": ZeRO-3 keeps the parameters whole; offload="keeps grads": CPU
    offload moves only the optimizer state; rank="saving" (most saving first) or "list" (the table's order);
    strict: fits is < budget; dominant_of="state": the largest of the model state only; report="saving"."""
    parts = plan.breakdown()
    if dominant_of == "state":
        parts = {k: parts[k] for k in ("params", "grads", "optimizer_state")}
    dominant = max(parts, key=parts.get)
    rest = plan.activations + plan.recompute + plan.logits  # what ZeRO and offload leave on the GPU
    state = plan.params + plan.grads + plan.optimizer_state

    def planned(c=config, b=batch_size, **kw):
        return planner.plan(c, b, data=data, **kw).total

    options = []  # (name, cost, FLOPs rank within 'compute', bytes after)
    if not config.flash:
        options.append(("memory-efficient attention", "nothing", 0, planned(replace(config, flash=True))))
    options += [
        ("ZeRO-1", "communication, same volume", 0, plan.params + plan.grads + plan.optimizer_state / data + rest),
        ("ZeRO-2", "communication, same volume", 0, plan.params + (plan.grads + plan.optimizer_state) / data + rest),
        ("ZeRO-3", "communication, more", 0, (state if zero3 == "all" else state - plan.params) / data + rest
         + (plan.params if zero3 != "all" else 0)),
        ("CPU offload", "communication, more", 0, plan.params + rest + (plan.grads if offload == "keeps grads" else 0)),
    ]
    if not config.flash:
        options.append(("selective recompute", "compute", 1, planned(replace(config, recompute="selective"))))
    options.append(("gradient checkpointing", "compute", 2, planned(checkpointing=True)))
    if batch_size > 1:
        if batch_size % 2 == 0:
            options.append(("gradient accumulation", "compute", 0, planned(b=batch_size // 2)))
        options.append(("smaller batch", "the training itself", 0, planned(b=batch_size // 2)))
    if config.n_layer > 1:
        smaller = replace(config, n_layer=config.n_layer // 2)
        options.append(("smaller model", "the training itself", 0, planned(smaller)))
    options = [o for o in options if o[3] < plan.total]
    if rank == "cost":
        options.sort(key=lambda o: (COSTS.index(o[1]), o[2], o[3]))
    elif rank == "saving":
        options.sort(key=lambda o: o[3])
    for name, _, _, after in options:
        if (after < budget_bytes) if strict else (after <= budget_bytes):
            return dominant, name, (after if report == "after" else plan.total - after)
    return dominant, None, None


def test_the_remedies_named_are_ooms():
    """REMEDIES are every remedy oom offers, and the answerable ones are those the cases cover."""
    config = GPTConfig.preset("tiny", block_size=63)
    names = {r.name for r in oom.remedies(config, 4, 1.0, data=2)}
    assert names == set(ch07.REMEDIES) and set(ch07_oom.ANSWERABLE) <= names
    assert ch07.COMPONENTS == tuple(planner.plan(config, 4).breakdown())


# --- 7.3 ---------------------------------------------------------------------------------------------------------

HELPERS = ("wrapper", "counted", "wait", "exchange", "post", "scope")


def find_hang(message, *, thread="function", name="outermost named", comm="exact", header=True):
    """The solution's find_hang. thread="first": the first thread of a section (the watcher); name="innermost" or
    "outermost": that communication frame's function; comm="torch": any torch file is communication code;
    header=False: only the ranks with a section are read."""
    head = re.search(r"ranks? ([\d, ]+) of (\d+) had not finished", message)
    unfinished, world_size = {int(r) for r in head[1].split(",")}, int(head[2])
    parts = re.split(r"^--- rank (\d+) ---$", message, flags=re.M)[1:]
    stacks = dict(zip(map(int, parts[::2]), parts[1::2], strict=True))
    waiting, culprits = {}, []
    for rank in range(world_size) if header else sorted(stacks):
        if rank not in unfinished:
            culprits.append(rank)  # it returned without calling the collective
            continue
        threads = stacks[rank].strip().split("\n\n")
        runs_fn = [t for t in threads if re.search(r'_worker.py", line \d+ in main', t)]
        mine = threads[0] if thread == "first" else runs_fn[0]
        frames = re.findall(r'File "(.+)", line \d+ in (\S+)', mine)  # innermost first
        top = []
        for file, function in frames:
            if comm == "torch":
                is_comm = "torch" in file or "llmlab/dist/c" in file
            else:
                is_comm = "/torch/distributed/" in file or file.endswith(("llmlab/dist/commlog.py",
                                                                          "llmlab/dist/collectives.py"))
            if not is_comm:
                break
            top.append(function)
        if not top:
            culprits.append(rank)  # in no collective: elsewhere in the program
        elif name == "innermost":
            waiting[rank] = top[0]
        elif name == "outermost":
            waiting[rank] = top[-1]
        else:
            named = [f for f in top if f not in HELPERS and not f.startswith("_")]
            waiting[rank] = named[-1] if named else top[0]  # (a data loader's frames, under comm="torch")
    return waiting, culprits


def skips_a_collective():
    import torch.distributed as td

    if td.get_rank() == 1:
        time.sleep(60)  # the planted bug: rank 1 never reaches the all_reduce
    elif td.get_rank() == 2:
        return "returned"
    td.all_reduce(torch.ones(3))  # (3,)


def test_the_solution_reads_a_real_hang_as_diagnose_hang_does():
    """The messages the check makes are the launcher's: the solution, right on them, is right on a real one."""
    with pytest.raises(TimeoutError) as info:
        dist.spawn(skips_a_collective, 4, timeout=4, backend="gloo")
    message = str(info.value)
    report = hang.diagnose_hang(message)
    assert find_hang(message) == ({0: "all_reduce", 3: "all_reduce"}, [1, 2])
    assert [p.state for p in report.places] == ["waiting", "elsewhere", "finished", "waiting"]
    made = ch07.example_hang(seed=0)
    for text in (message, made):  # the same layout: a watcher thread, then the function's, down to main
        section = text.split("--- rank 0 ---\n")[1]
        assert section.startswith("Thread 0x") and "\n\nCurrent thread 0x" in section
        assert re.search(r'_worker.py", line \d+ in main', section)


# --- 7.4 ---------------------------------------------------------------------------------------------------------

def first_nonfinite(model, x, *, keep="first", check_inputs=True, test="isfinite", modules="all", remove=True):
    """The solution's first_nonfinite. keep="last": every culprit overwrites the one before; check_inputs=False;
    test="isnan": inf passes; modules="leaves": only modules without children are watched; remove=False."""

    def finite(values):
        bad = torch.isnan if test == "isnan" else (lambda t: ~torch.isfinite(t))
        return all(not bool(bad(v).any()) for v in values if isinstance(v, torch.Tensor) and v.is_floating_point())

    first = []  # the name of each module blamed, in the order they finished

    def watch(name):
        def hook(module, inputs, output):
            outputs = output if isinstance(output, tuple | list) else (output,)
            if (keep == "last" or not first) and (finite(inputs) or not check_inputs) and not finite(outputs):
                first.append(name)
        return hook

    handles = [m.register_forward_hook(watch(name)) for name, m in model.named_modules()
               if modules == "all" or not list(m.children())]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for handle in handles if remove else ():
            handle.remove()
    return first[-1] if first else None


# --- the table: tests/test_checks_answers.py runs each once, tools/flake.py N times -------------------------------

ANSWERS = [
    Reference(ch07.find_the_bugs, script()),
    Mistake(ch07.find_the_bugs, script(**STARTER), hint=HINTS["data"],
            match="5 of 5 faults remain — " + ".*".join(MESSAGES[f] for f in ch07.FAULTS)
                  + ".*fixed: none yet; fix one at a time: the hint is about the first, data"),
    *[Mistake(ch07.find_the_bugs, script(**ONE_FAULT[fault]), match=only(fault), hint=HINTS[fault])
      for fault in ch07.FAULTS],
    Mistake(ch07.find_the_bugs, script(zero="micro"), hint=HINTS["zero_grad"],
            match=r"1 of 5 faults remain — zero_grad: the gradient at each optimizer step is the last micro-batch's "
                  r"alone.*fixed: data, loss, learning rate; checked once the others are fixed: accumulation"),
    Mistake(ch07.find_the_bugs, script(report_divided=True), hint=HINTS["reported loss"],
            match=r"all 5 faults are fixed, but train returned .* as step 0's loss, where its micro-batches' mean "
                  r"cross-entropy is .*: report loss.item\(\) before dividing it by accum_steps"),
    # below the LR range test's minimum, but 3× too slow
    Mistake(ch07.find_the_bugs, script(lr=1e-3), hint=HINTS["too slow"],
            match=rf"all 5 faults are fixed, but after {ch07.TRAIN_STEPS} steps the tiny GPT's held-out loss is .* "
                  r"above the data's best possible .*lr 0.001"),
    Mistake(ch07.find_the_bugs, script(extra_steps=3), match=r"train made more than steps=2 optimizer steps",
            hint=HINTS["loop"]),
    Mistake(ch07.find_the_bugs, never_steps, match=r"made 0 optimizer steps, with \[0, 0\] backward passes",
            hint=HINTS["loop"]),

    Reference(ch07.fix_oom, fix_oom),
    Mistake(ch07.fix_oom, partial(fix_oom, zero3="no params"), hint="each of the N = data ranks holds 1/N",
            match=r"ZeRO-3 fits: the plan after it holds .* bytes \(costs 'communication, more'\), and it ranks before "
                  r"your .* Hint 1 of 3: look at ZeRO-3"),
    Mistake(ch07.fix_oom, partial(fix_oom, offload="keeps grads"), hint="oom.offloaded(plan).total",
            match=r"CPU offload (is the answer, but the plan after it holds .* bytes, not|fits: the plan after it "
                  r"holds .* ranks before your) .* Hint 1 of 3: look at CPU offload"),
    Mistake(ch07.fix_oom, partial(fix_oom, rank="saving"), hint="not the one that saves the most",
            match=r"every remedy fits, and the first in the ranking is .*: it costs .* — yours is the one that saves "
                  r"the most"),
    Mistake(ch07.fix_oom, partial(fix_oom, rank="list"), hint="within one cost the saving",
            match=r"every remedy fits, and the first in the ranking is ZeRO-2, not ZeRO-1: both cost 'communication, "
                  r"same volume', and ZeRO-2 saves more"),
    Mistake(ch07.fix_oom, partial(fix_oom, strict=True), hint="bytes_after <= budget_bytes",
            match=r"fits exactly: the plan after it holds .* bytes, the budget itself, and it ranks before your"),
    Mistake(ch07.fix_oom, partial(fix_oom, dominant_of="state"), hint="max(parts, key=parts.get)",
            match=r"the plan's largest component is (activations|logits) .*, not optimizer_state"),
    Mistake(ch07.fix_oom, partial(fix_oom, report="saving"), hint="not what the remedy saves",
            match=r"is the answer, but bytes_after=.* is what it saves; the plan after it holds"),
    Mistake(ch07.fix_oom, lambda *args: {"remedy": "ZeRO-3"}, hint="price every remedy",
            match=r"your function returned dict .*, expected a tuple \(dominant, remedy, bytes_after\)"),

    Reference(ch07.find_hang, find_hang),
    Mistake(ch07.find_hang, partial(find_hang, thread="first"), hint="_worker.py\", line N in main",
            match=r"rank \d waits in \w+ \(called from .*\), and you said it is a culprit: the thread that runs the "
                  r"function starts inside torch.distributed; the first thread of its section is the launcher's "
                  r"watcher \(print\(check.last_hang\(\)\)"),
    Mistake(ch07.find_hang, partial(find_hang, name="innermost"), hint="the outermost of them that is no helper",
            match=r"rank \d waits in (all_gather_object, not all_gather|ring_all_reduce, not wait): its stack runs "
                  r"from the top through"),
    Mistake(ch07.find_hang, partial(find_hang, name="outermost"), hint="not in check.HELPERS",
            match=r"rank \d waits in \w+, not wrapper: its stack runs from the top through \w+ \(distributed_c10d.py"),
    Mistake(ch07.find_hang, partial(find_hang, comm="torch"), hint="'/torch/distributed/' in file",
            match=r"rank \d is in no collective: the innermost frame of the thread that runs the function is \S+ "
                  r"\((dataloader|linear).py:\d+\), not torch.distributed's"),
    Mistake(ch07.find_hang, partial(find_hang, header=False), hint="not in it is a culprit",
            match=r"rank \d returned without calling the collective \(the first line does not name it among the "
                  r"ranks that had not finished\), and you said it is neither waiting nor a culprit"),
    Mistake(ch07.find_hang, lambda message: [0, 1, 2], hint="culprits = sorted(every other rank)",
            match=r"your function returned list \[0, 1, 2\], expected a tuple \(waiting, culprits\)"),

    Reference(ch07.first_nonfinite, first_nonfinite),
    Mistake(ch07.first_nonfinite, partial(first_nonfinite, keep="last"), hint="keep the first name only",
            match=r"with an inf in \S+ \(float32\), the culprit is '\S+' \(\w+\), and you said the model itself "
                  r"\(''\), which contains it: it finished later"),
    Mistake(ch07.first_nonfinite, partial(first_nonfinite, check_inputs=False), hint="finite(inputs) and not",
            match=r"with a NaN in the input itself, the culprit is None: the input already holds a NaN, so no module "
                  r"made one, and you said 'inp'"),
    Mistake(ch07.first_nonfinite, partial(first_nonfinite, test="isnan"), hint="torch.isfinite(t)",
            match=r"with an (inf in \S+ \(float32\)|fp16 input up to \d+ .*), the culprit is '\S+' \(\w+\), and "
                  r"you said .*: its output holds inf, and no NaN"),
    Mistake(ch07.first_nonfinite, partial(first_nonfinite, modules="leaves"), hint="the model itself (name '')",
            match=r"with a NaN in blocks.\d.gain \(float32\), the culprit is 'blocks.\d' \(_Block\), and you said "
                  r"None: its children's outputs are finite, and its own forward makes the NaN"),
    Mistake(ch07.first_nonfinite, partial(first_nonfinite, remove=False), hint="h.remove()",
            match=r"after your function returned, \d+ module\(s\) still hold a hook of yours"),
    Mistake(ch07.first_nonfinite, lambda model, x: model.get_submodule("inp"), hint="the first module, in the order",
            match=r"your function returned Linear .*, expected a module's name \(a str"),
]


def test_the_check_leaves_the_learners_state_alone():
    torch.manual_seed(0)
    state, threads = torch.get_rng_state(), torch.get_num_threads()
    # the probe and the LR range test
    fails(ch07.find_the_bugs, script(**STARTER), match="5 of 5 faults remain", hint=HINTS["data"])
    assert torch.equal(torch.get_rng_state(), state) and torch.get_num_threads() == threads


def test_an_unwritten_script_is_not_attempted(capsys):
    def train(model, batches, steps, accum_steps=2):
        raise NotImplementedError("Exercise 7.1: Find the bugs")

    not_attempted(ch07.find_the_bugs, train, capsys=capsys)


def unwritten(*args):
    raise NotImplementedError("Exercise 7.x")


@pytest.mark.parametrize("check", [ch07.fix_oom, ch07.find_hang, ch07.first_nonfinite])
def test_an_unwritten_answer_is_not_attempted(check, capsys):
    not_attempted(check, unwritten, capsys=capsys)


def test_a_failed_hang_case_can_be_printed():
    fails(ch07.find_hang, partial(find_hang, header=False), match="returned without calling", hint="not in it")
    assert "had not finished" in ch07.last_hang()
    ch07.find_hang(find_hang)
    assert ch07.last_hang() is None


def test_a_slow_script_is_stopped(monkeypatch):
    monkeypatch.setattr(ch07, "TIMEOUT_S", 0.0)
    fails(ch07.find_the_bugs, script(), match=r"train did not finish within 0 s", hint=HINTS["loop"])
