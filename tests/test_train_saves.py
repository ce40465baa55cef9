"""Crash-safe checkpoints of `llmlab train`: a save SIGKILLed in each phase leaves the newest complete checkpoint,
which resumes bit-exactly; step folders, --keep, --save-every; the save directory claimed before training (a file,
read-only, full, another run's, this run's further on: refused, --overwrite); forged manifests refused in one line;
the checkpoint size estimate against a real save; temporary files of killed writers removed."""

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from llmlab.train import TrainConfig, Trainer
from llmlab.train import state as state_file
from llmlab.train.capstone import checkpoints, main, preflight, run_rank
from llmlab.train.capstone.config import RunConfig

RUN = RunConfig(steps=6, batch_size=8, block_size=32, save_every=2)  # the tiny GPT: ~0.05 s an update
ARGS = ["--steps", "6", "--batch-size", "8", "--block-size", "32", "--save-every", "2"]  # RUN's flags
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread per process on the shared 2 cores (conftest one_thread)


def _steps(root) -> list[int]:
    return [step for step, _ in checkpoints.checkpoints(root)]


def _assert_same_state(a, b, where="state"):
    """Equal bit for bit: tensors by torch.equal, containers item by item, other values by ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for k in a:
            _assert_same_state(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _final(root) -> dict:
    state = state_file.read_state(checkpoints.step_dir(root, RUN.steps) / "rank0.pt")
    state["history"] = [h["loss"] for h in state["history"]]  # its step times differ from run to run
    return state


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run's checkpoints (updates 2, 4, 6; --keep 2 leaves 4 and 6)."""
    root = tmp_path_factory.mktemp("straight") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_rank(replace(RUN, save=str(root)), quiet=True)
    finally:
        torch.set_num_threads(threads)
    return root


@pytest.mark.parametrize("phase, left", [("rank-file", [2]), ("before-manifest", [2]), ("after-manifest", [2]),
                                         ("after-commit", [2, 4])])
def test_a_save_killed_in_any_phase_leaves_a_checkpoint_that_resumes_bit_exactly(phase, left, straight, tmp_path,
                                                                                 one_thread):
    root = tmp_path / "run"
    killed = subprocess.run([sys.executable, "-m", "llmlab.train", *ARGS, "--save", str(root)], capture_output=True,
                            text=True, timeout=120, env={**ENV, state_file.KILL_ENV: f"{phase}:4"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert _steps(root) == left  # the save of update 4 is complete only once renamed; update 2's stays till then
    assert len(checkpoints.interrupted(root)) == (phase != "after-commit")
    run_rank(replace(RUN, save=str(root), resume=str(root)), quiet=True)  # the newest complete one
    assert _steps(root) == [4, 6] and checkpoints.interrupted(root) == []  # the next save removed the leftovers
    _assert_same_state(_final(root), _final(straight))


def test_a_rank_killed_in_a_multi_rank_save_is_named_and_the_checkpoint_before_resumes(tmp_path):
    root = tmp_path / "run"
    killed = subprocess.run([sys.executable, "-m", "llmlab.train", *ARGS, "--nproc", "2", "--save", str(root)],
                            capture_output=True, text=True, timeout=120,
                            env={**ENV, state_file.KILL_ENV: "before-manifest:4"})
    assert killed.returncode == 2
    [line] = killed.stderr.strip().splitlines()  # one line
    assert line.startswith("python -m llmlab.train: error: rank 0 of 2 was killed by SIGKILL — out of memory? (the "
                           "full report, with every rank's stack: ")
    os.unlink(line.rsplit(" ", 1)[1].rstrip(")"))
    assert _steps(root) == [2] and len(checkpoints.interrupted(root)) == 1
    assert len(list((checkpoints.tmp_dir(root, 4)).glob("rank*.pt"))) == 2  # both rank files, no manifest


def test_keep_and_the_step_folders(straight):
    assert _steps(straight) == [4, 6]  # --save-every 2 saved 2, 4 and 6; --keep 2 removed 2 once 6 was complete
    assert sorted(p.name for p in checkpoints.step_dir(straight, 6).iterdir()) == ["manifest.pt", "rank0.pt"]
    assert checkpoints.other_entries(straight) == [] and checkpoints.resolve(straight).name == "step-000006"


def test_the_checkpoint_size_estimate_is_close_to_a_real_save(straight):
    """fp32 weights + AdamW moments + history: within 10% of the bytes a save of the tiny model wrote (the
    estimate leaves out only pickle framing beyond _FILE_BYTES, and the RNG and data states: a few kB)."""
    real = sum(f.stat().st_size for f in checkpoints.step_dir(straight, 6).iterdir())
    estimate = preflight.checkpoint_bytes(RUN, 1)
    assert abs(estimate - real) <= 0.1 * real, (estimate, real)


def _refused(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_save_directory_problems_are_refused_before_training(tmp_path, capsys, monkeypatch):
    file = tmp_path / "a-file"
    file.write_text("notes")
    assert "it is a file, not a directory" in _refused(capsys, [*ARGS, "--save", str(file)])
    if sys.platform == "linux":  # /sys refuses new entries even to root, for whom chmod does not
        assert "cannot write there" in _refused(capsys, [*ARGS, "--save", "/sys/llmlab-save"])
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        assert "cannot write there (Permission denied)" in _refused(capsys, [*ARGS, "--save", str(locked / "run")])
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=10**9, used=10**9 - 1000, free=1000))
    err = _refused(capsys, [*ARGS, "--save", str(tmp_path / "full")])
    assert "1 kB free on its disk, the checkpoints need about" in err and "3 × " in err  # --keep 2 + the new one


def test_a_directory_of_another_run_or_of_this_run_further_on_is_refused_unless_overwrite(straight, tmp_path, capsys,
                                                                                        one_thread):
    root = tmp_path / "run"
    shutil.copytree(straight, root)
    err = _refused(capsys, [*ARGS, "--seed", "1", "--save", str(root)])
    assert "holds another run's checkpoint (step-000006, saved with other flags)" in err
    err = _refused(capsys, [*ARGS, "--save", str(root)])  # this run again from update 0: it would rewind it
    assert "holds this run's checkpoint of a later update (step-000006; this run starts at update 0)" in err
    (root / "notes.txt").write_text("mine")
    assert "holds other files (notes.txt)" in _refused(capsys, [*ARGS, "--save", str(root), "--resume", str(root)])
    assert main([*ARGS, "--seed", "1", "--stop-at", "2", "--save", str(root), "--overwrite"]) == 0
    assert _steps(root) == [2] and (root / "notes.txt").read_text() == "mine"  # the other run's replaced, not notes
    assert read_flags(root)["seed"] == 1


def read_flags(root) -> dict:
    return state_file.read_state(checkpoints.resolve(root) / "manifest.pt")["flags"]


FORGED = {  # manifest field -> a forged value, and what the one-line refusal says
    "layout": (dict(world_size=0, dp=0, tp=1, zero=0), "not {world_size, dp, cp, tp, zero} of positive ints"),
    "step": ("6", "step '6' is not an update count"),
    "flags": ([1, 2], "flags list, expected"),
}


@pytest.mark.parametrize("field", [*FORGED, "world", "steps-type", "past-steps", "other-name", "not-a-dict"])
def test_forged_manifests_are_refused_in_one_line(field, straight, tmp_path, capsys):
    root = tmp_path / "run"
    shutil.copytree(straight, root)
    file = checkpoints.step_dir(root, 6) / "manifest.pt"
    manifest = state_file.read_state(file)
    layout, flags = manifest["layout"], manifest["flags"]
    forged, message = {
        "world": (dict(manifest, layout=dict(layout, world_size=3)), "is impossible (world_size = dp × cp × tp"),
        "steps-type": (dict(manifest, flags=dict(flags, steps=6.0)), "flag values of the wrong type: steps=6.0"),
        "past-steps": (dict(manifest, step=7), "step 7 is not an update count from 0 to --steps 6"),
        "other-name": (dict(manifest, step=4), "step 4 does not match the folder's name step-000006"),
        "not-a-dict": ([manifest], "keys list, expected flags, layout, step"),
    }.get(field) or (dict(manifest, **{field: FORGED[field][0]}), FORGED[field][1])
    state_file.write_state(file, forged)  # a valid header and checksum: only the fields are forged
    err = _refused(capsys, [*ARGS[:-2], "--resume", str(root)])  # (no --save-every: no --save)
    assert "is not a valid capstone manifest" in err and message in err


@pytest.mark.parametrize("forge, message", [
    (lambda state: [state], "rank0.pt (list) does not belong to the manifest's save"),
    (lambda state: dict(state, optimizer="junk"), "holds a malformed optimizer state (AttributeError: "),
    (lambda state: dict(state, history="junk"), "or a history of type str (a list expected)"),
])
def test_forged_rank_files_are_refused_in_one_line(forge, message, straight, tmp_path, capsys, one_thread):
    root = tmp_path / "run"
    shutil.copytree(straight, root)
    file = checkpoints.step_dir(root, 6) / "rank0.pt"
    state_file.write_state(file, forge(state_file.read_state(file)))
    assert message in _refused(capsys, [*ARGS[:-2], "--resume", str(root)])


def test_a_save_from_before_sp_and_cp_resumes_as_cp_1_without_sp(straight, tmp_path, capsys, one_thread):
    """Saves written before --sp and --cp existed (no such flags, no cp in the layouts) still resume; with
    --cp 2 they are refused, naming both layouts."""
    root = tmp_path / "run"
    shutil.copytree(straight, root)
    folder = checkpoints.step_dir(root, 4)
    manifest = state_file.read_state(folder / "manifest.pt")
    old = lambda layout: {k: v for k, v in layout.items() if k != "cp"}  # noqa: E731
    state_file.write_state(folder / "manifest.pt", dict(
        manifest, layout=old(manifest["layout"]), flags={k: v for k, v in manifest["flags"].items()
                                                         if k not in ("sp", "cp")}))
    rank0 = state_file.read_state(folder / "rank0.pt")
    state_file.write_state(folder / "rank0.pt", dict(rank0, layout=old(rank0["layout"])))
    shutil.rmtree(checkpoints.step_dir(root, 6))
    assert main([*ARGS[:-2], "--resume", str(root)]) == 0
    assert "final loss" in capsys.readouterr().out
    assert "this run is world 2 = dp 1 × cp 2 × tp 1" in _refused(capsys, [*ARGS[:-2], "--cp", "2", "--nproc", "2",
                                                                            "--resume", str(root)])


def test_an_interrupted_save_is_ignored_by_resume_with_a_note(straight, tmp_path, capsys, one_thread):
    root = tmp_path / "run"
    shutil.copytree(straight, root)
    broken = checkpoints.tmp_dir(root, 8)
    broken.mkdir()
    (broken / "rank0.pt").write_bytes(b"half")
    assert main([*ARGS[:-2], "--resume", str(root)]) == 0  # at update 6 of 6: nothing to train, no --save
    assert f"note: ignoring {broken}, a save that did not complete" in capsys.readouterr().err
    assert broken.exists()  # it resumed from step-000006 and did not save again: the folder waits for a save


def test_temporary_files_of_a_killed_single_file_save_are_removed(tmp_path, one_thread):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".state.pt.{dead.stdout.strip()}.abcd1234.tmp"  # a writer that is gone
    live = tmp_path / f".state.pt.{os.getpid()}.efgh5678.tmp"  # one still running (this process)
    stale.write_bytes(b"half")
    live.write_bytes(b"half")
    trainer = Trainer(config=TrainConfig.preset("tiny", steps=1, warmup=0, batch_size=2, block_size=8),
                      progress=False)
    trainer.save(tmp_path / "state.pt")
    assert not stale.exists() and live.exists() and Trainer.resume(tmp_path / "state.pt", progress=False)
    assert [p.name for p in Path(tmp_path).iterdir() if p.suffix == ".tmp"] == [live.name]
