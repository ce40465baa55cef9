"""The process launcher: results, failures (exception, hang, signal), ports, and no process left behind."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from llmlab import dist


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture
def no_leftover_processes():
    """Fail the test if it leaves any child process of this test process behind."""
    before = _children()
    yield
    deadline = time.monotonic() + 5
    while (left := _children() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left behind: {left}"


@pytest.fixture(scope="module")
def cluster3():
    with dist.Cluster(3) as c:
        yield c


def rank_and_sum(offset):
    import torch
    import torch.distributed as td

    t = torch.tensor([td.get_rank() + offset], dtype=torch.float64)
    td.all_reduce(t)
    return td.get_rank(), td.get_world_size(), t.item()


def raise_on_rank(bad_rank):
    import torch.distributed as td

    if td.get_rank() == bad_rank:
        raise ValueError(f"planted failure on rank {bad_rank}")
    return "fine"


def recv_nobody_sends():
    import torch
    import torch.distributed as td

    t = torch.zeros(3)
    if td.get_rank() == 0:
        td.recv(t, src=1)  # rank 1 never sends
    else:
        time.sleep(120)


def kill_rank(victim):
    import torch.distributed as td

    if td.get_rank() == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_results_come_back_in_rank_order(world_size, no_leftover_processes):
    results = dist.spawn(rank_and_sum, world_size, 0.5, timeout=30)
    expected_sum = sum(r + 0.5 for r in range(world_size))
    assert results == [(r, world_size, expected_sum) for r in range(world_size)]


def test_cluster_keeps_ranks_alive_between_calls(cluster3):
    pids = cluster3.pids()
    first = cluster3.run(rank_and_sum, 1.0)
    second = cluster3.run(rank_and_sum, 2.0)
    assert [r[2] for r in first] == [6.0] * 3 and [r[2] for r in second] == [9.0] * 3
    assert cluster3.pids() == pids


def test_exception_names_rank_and_carries_its_traceback(cluster3):
    with pytest.raises(dist.RankError) as info:
        cluster3.run(raise_on_rank, 2)
    err = info.value
    assert err.rank == 2 and err.exc_type == "ValueError"
    assert isinstance(err.exception, ValueError) and err.__cause__ is err.exception
    assert "rank 2 of 3 raised ValueError: planted failure on rank 2" in str(err)
    assert "traceback on rank 2" in str(err) and "in raise_on_rank" in str(err)
    # the other ranks finished, so the cluster is still usable and keeps its processes
    pids = cluster3.pids()
    assert cluster3.run(raise_on_rank, -1) == ["fine"] * 3
    assert cluster3.pids() == pids


def test_hang_ends_in_timeout_with_every_rank_stack(no_leftover_processes):
    timeout = 3
    with dist.Cluster(2) as c:
        c.run(rank_and_sum, 0.0)  # started: time only the call
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            c.run(recv_nobody_sends, timeout=timeout)
        elapsed = time.monotonic() - t0
        assert not c.alive
        # the cluster restarts on the next call
        assert [r[2] for r in c.run(rank_and_sum, 0.0)] == [1.0, 1.0]
    # a few seconds over the timeout: stack dumps (<= 2 s a rank) and killing
    assert elapsed < timeout + 5, elapsed
    msg = str(info.value)
    assert f"timeout={timeout}s" in msg
    assert "--- rank 0 ---" in msg and "--- rank 1 ---" in msg
    rank0, rank1 = msg.split("--- rank 1 ---")
    assert "in recv" in rank0 and "in recv_nobody_sends" in rank0
    assert "in recv_nobody_sends" in rank1


def test_rank_killed_by_signal_is_reported_as_such(no_leftover_processes):
    t0 = time.monotonic()
    with pytest.raises(dist.RankCrashed) as info:
        dist.spawn(kill_rank, 3, 1, timeout=60)
    assert time.monotonic() - t0 < 30, "a crash must not wait for the timeout"
    assert info.value.rank == 1 and info.value.signal == signal.SIGKILL
    assert "killed by signal SIGKILL" in str(info.value)


def test_two_launches_at_once_do_not_collide(no_leftover_processes):
    results, errors = {}, []

    def launch(i):
        try:
            results[i] = dist.spawn(rank_and_sum, 2, float(i), timeout=60)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=launch, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert {i: [r[2] for r in res] for i, res in results.items()} == {i: [2 * i + 1.0] * 2 for i in range(3)}


def test_rank_output_is_forwarded_with_its_rank(capfd):
    def shout():
        import torch.distributed as td

        print(f"hello from {td.get_rank()}")

    dist.spawn(shout, 2, timeout=30)
    out = capfd.readouterr().out
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out


def test_function_defined_in_main_works(tmp_path, no_leftover_processes):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        from llmlab import dist

        SCALE = 3.0

        def scaled_sum():
            import torch, torch.distributed as td
            t = torch.tensor([SCALE * (td.get_rank() + 1)])
            td.all_reduce(t)
            return t.item()

        if __name__ == "__main__":
            print(dist.spawn(scaled_sum, 2, timeout=30))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("[9.0, 9.0]")


def test_unpicklable_result_is_a_clear_error():
    with pytest.raises(dist.RankError, match=r"result of the function on rank 0 \(lock\) cannot be sent"):
        dist.spawn(threading.Lock, 1, timeout=30)


@pytest.mark.parametrize("world_size", [0, -1, 2.0, True, "2"])
def test_bad_world_size(world_size):
    with pytest.raises(ValueError, match="world_size"):
        dist.spawn(rank_and_sum, world_size)


def test_bad_arguments_fail_before_starting_ranks(no_leftover_processes):
    before = _children()
    with pytest.raises(TypeError, match="fn must be callable"):
        dist.spawn(42, 2)
    with pytest.raises(TypeError, match=r"argument 2 \(lock\) cannot be sent to the ranks"):
        dist.spawn(rank_and_sum, 2, 1.0, threading.Lock())
    with pytest.raises(ValueError, match="timeout"):
        dist.spawn(rank_and_sum, 2, 1.0, timeout=0)
    with pytest.raises(ValueError, match="backend"):
        dist.Cluster(2, backend="mpi")
    for env in ({"A": 1}, {"": "x"}, {"A=B": "x"}, ["A"]):
        with pytest.raises(ValueError, match="env="):
            dist.Cluster(2, env=env)
    assert _children() == before


def _getenv(*names):
    import os

    return [os.environ.get(n) for n in names]


def test_env_reaches_the_ranks_only(monkeypatch):
    monkeypatch.setenv("LLMLAB_TEST_INHERITED", "parent")
    got = dist.spawn(_getenv, 2, "LLMLAB_TEST_EXTRA", "LLMLAB_TEST_INHERITED", "OMP_NUM_THREADS", timeout=30,
                     env={"LLMLAB_TEST_EXTRA": "detail", "OMP_NUM_THREADS": "1"})
    assert got == [["detail", "parent", "1"]] * 2  # added, inherited, and the caller's choice wins over ours
    assert "LLMLAB_TEST_EXTRA" not in os.environ
