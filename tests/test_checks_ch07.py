"""Chapter 7's exercise check (llmlab.checks.ch07): the fixed training script passes, the starter fails naming
all five planted faults, each fault left alone is named precisely, an unwritten script reads not attempted, and a
script that breaks the contract (wrong reported losses, too many steps, too slow, too little training) fails saying
so.

`script(...)` is the exercise's training script with each fault switchable, written the way the starter and the
solution notebook write it; `script()` is the solution, `script(**STARTER)` the starter.
"""

import torch
import torch.nn.functional as F
from check_answers import Mistake, Reference
from grading import fails, not_attempted

from llmlab.checks import ch07

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


def test_a_slow_script_is_stopped(monkeypatch):
    monkeypatch.setattr(ch07, "TIMEOUT_S", 0.0)
    fails(ch07.find_the_bugs, script(), match=r"train did not finish within 0 s", hint=HINTS["loop"])
