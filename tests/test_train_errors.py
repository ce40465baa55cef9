"""`llmlab train` fails in one line with exit code 2 for what a user can cause: a hang (--timeout is a hang
detector, not a limit on the run's length), a rank that crashed or hung under --nproc (the launcher's headline),
a size that cannot fit in memory (the planner's estimate, before anything is allocated); more ranks than cores run
with a warning."""

import os
import subprocess
import sys

import pytest

from llmlab import dist, timing
from llmlab.dist import RankCrashed, RankHang
from llmlab.train.capstone import main, run_rank
from llmlab.train.capstone.config import RunConfig

ARGS = ["--steps", "4", "--batch-size", "8", "--block-size", "32"]


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("python -m llmlab.train: error: "), err
    return lines[0]


def test_a_process_alone_with_no_update_for_timeout_seconds_fails_in_one_line_with_the_stacks():
    """--timeout 0.001: building the model alone takes longer than a millisecond, so no update finishes in time."""
    hung = subprocess.run([sys.executable, "-m", "llmlab.train", *ARGS, "--timeout", "0.001"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert hung.returncode == 2
    line = _one_error_line(hung.stderr)
    assert "no update finished for 0.001 s (--timeout); the stack of every thread is in " in line
    stacks = line.rsplit(" ", 1)[1]
    text = open(stacks).read()
    os.unlink(stacks)
    assert "Current thread" in text and "most recent call first" in text  # faulthandler's dump, every thread


def test_spawned_ranks_get_a_hang_detector_not_a_limit_on_the_run(monkeypatch, one_thread):
    calls = []
    monkeypatch.setattr(dist, "spawn", lambda fn, n, *args, **kw: calls.append((fn, n, kw)) or [])
    assert main([*ARGS, "--nproc", "2", "--timeout", "30"]) == 0
    assert calls == [(run_rank, 2, dict(timeout=None, stall_timeout=30.0))]  # no limit on the call's length
    beats = []
    run_rank(RunConfig(steps=3, batch_size=8, block_size=32), quiet=True, heartbeat=lambda: beats.append(1))
    assert len(beats) == 3  # one heartbeat per update: the launcher's stall clock restarts at each


def _stacks_note():
    return "rank 0: waiting for its peers\n  File \"train.py\", line 1, in step\nrank 1: ..."


@pytest.mark.parametrize("error, headline", [
    (RankHang([1], 2, 600.0, {0: "stack 0", 1: "stack 1"}, _stacks_note()),
     "no step finished for 600 s on rank 1 of 2 (no heartbeat() and no return)"),
    (RankCrashed(1, 2, -9, "last words"), "rank 1 of 2 was killed by SIGKILL — out of memory?"),
])
def test_a_failed_rank_is_one_line_with_the_full_report_in_a_file(error, headline, monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(dist, "spawn", fail)
    assert main([*ARGS, "--nproc", "2"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(f"python -m llmlab.train: error: {headline} (the full report, with every rank's stack: ")
    report = line.rsplit(" ", 1)[1].rstrip(")")
    assert open(report).read().strip() == str(error).strip()
    os.unlink(report)


def test_a_size_that_cannot_fit_is_refused_with_the_planners_estimate(capsys):
    """--block-size 100000 asked the tiny GPT for T×T attention scores: ~2.6 TB, refused before any allocation."""
    assert main(["--steps", "2", "--block-size", "100000"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--batch-size 16 --block-size 100000 on 1 rank(s): llmlab.memory.planner estimates " in line
    assert " TB per rank (activations " in line and "of memory: lower --batch-size or --block-size" in line


def test_more_ranks_than_cores_run_with_a_warning_of_the_slowdown(monkeypatch, capsys):
    cores = timing.Load.now().cores
    n = 4 * cores
    monkeypatch.setattr(dist, "spawn", lambda fn, n, *args, **kw: [])
    assert main(["--steps", "2", "--nproc", str(n), "--batch-size", str(n)]) == 0
    err = capsys.readouterr().err.strip()
    assert err == (f"warning: --nproc {n} on {cores} core(s): the ranks take turns on the cores, so each update "
                   f"takes about 4× as long as with one core per rank (--nproc {cores}); running anyway")


def test_a_save_that_fails_during_the_run_is_one_line(tmp_path, monkeypatch, capsys, one_thread):
    """A disk that fills up after the checks: the save's OSError becomes one line naming DIR and the update."""
    from llmlab.train import state

    def full(path, state_dict, kill_phase=None):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(state, "write_state", full)
    assert main([*ARGS, "--save", str(tmp_path / "run")]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"--save {tmp_path / 'run'}: writing the checkpoint of update 4 failed ([Errno 28] No space left " in line



@pytest.mark.parametrize("argv, message", [(["--steps", "abc"], "argument --steps: invalid int value: 'abc'"),
                                           (["--bogus"], "unrecognized arguments: --bogus")])
def test_a_bad_flag_is_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert message in _one_error_line(capsys.readouterr().err)
