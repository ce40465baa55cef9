"""The process launcher: results, failures (exception, hang, signal, stall) and their root cause, ports, and no
process or file left behind — not by a rank's children, not after the caller is killed."""

import json
import os
import re
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


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie is dead: an orphan waits there until the init process reaps it)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _all_gone(pids, within_s: float) -> list[int]:
    """The pids still running after waiting up to `within_s` seconds for all of them to end."""
    deadline = time.monotonic() + within_s
    while (left := [p for p in pids if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


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
    assert err.headline == "rank 2 of 3 raised ValueError: planted failure on rank 2"
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
    assert info.value.headline == "rank 1 of 3 was killed by SIGKILL — out of memory?"
    assert str(info.value).startswith(info.value.headline)


def test_root_cause_puts_a_dead_process_first_then_exceptions_then_lost_connections():
    from llmlab.dist.failures import root_cause

    lost = dist.RankError(0, 5, "RuntimeError", "[pair.cc:553] Connection closed by peer [127.0.0.1]:4242", "tb")
    reset = dist.RankError(1, 5, "DistNetworkError", "recv failed", "tb")
    dead = dist.RankCrashed(4, 5, -signal.SIGKILL, "")
    bugs = {r: dist.RankError(r, 5, "ValueError", "bad shape\nsecond line", "tb") for r in (2, 3)}
    assert root_cause({0: lost, 1: reset, 4: dead, **bugs}) == [4, 2, 3, 0, 1]
    assert bugs[2].headline == "rank 2 of 5 raised ValueError: bad shape"  # one line


def die_between_all_reduces(victim, how):
    import torch
    import torch.distributed as td

    t = torch.ones(1)
    td.all_reduce(t)  # every rank is connected
    if td.get_rank() == victim:
        time.sleep(0.5)  # the others are inside the next all_reduce by now
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    td.all_reduce(t)  # the survivors lose their connection to the victim here
    return t.item()


@pytest.mark.parametrize("how, headline", [
    ("exit", "rank 1 of 2 exited with code 3 without answering"),
    ("kill", "rank 1 of 2 was killed by SIGKILL — out of memory?"),
])
def test_a_rank_dying_in_a_collective_is_named_not_its_peers_lost_connection(how, headline, no_leftover_processes):
    t0 = time.monotonic()
    with pytest.raises(dist.RankCrashed) as info:
        dist.spawn(die_between_all_reduces, 2, 1, how, timeout=60)
    assert time.monotonic() - t0 < 30, "a crash must not wait for the timeout"
    err = info.value
    assert err.rank == 1 and err.headline == headline
    assert (err.returncode, err.signal) == ((3, None) if how == "exit" else (-signal.SIGKILL, signal.SIGKILL))
    # rank 0 failed too, as a consequence: named after the root cause
    assert "rank 0 failed too (lost connections: a consequence)" in str(err), str(err)


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
    with pytest.raises(ValueError, match="stall_timeout"):
        dist.spawn(rank_and_sum, 2, 1.0, stall_timeout=-1)
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


def start_sleeper(crash_rank):
    """Start a child process that would sleep for a minute and print its pid; return it (rank `crash_rank` exits
    with code 3 instead)."""
    import torch.distributed as td

    child = subprocess.Popen(["sleep", "60"])
    print(f"child {child.pid}", flush=True)
    if td.get_rank() == crash_rank:
        os._exit(3)
    return child.pid


def test_the_processes_a_rank_started_end_with_it(capfd, no_leftover_processes):
    children = dist.spawn(start_sleeper, 1, -1, timeout=30)
    assert _all_gone(children, 5) == []  # the rank closed politely, then its group was killed
    with pytest.raises(dist.RankCrashed, match="rank 0 of 2 exited with code 3"):
        dist.spawn(start_sleeper, 2, 0, timeout=30)
    children = [int(pid) for pid in re.findall(r"\[rank \d\] child (\d+)", capfd.readouterr().out)]
    assert len(children) == 3  # the second call's: of the crashed rank (found by its group) and of the live one
    assert _all_gone(children, 5) == []


CALLER = textwrap.dedent("""
    import json, subprocess, threading, time
    from llmlab import dist

    def start_sleeper():
        return subprocess.Popen(["sleep", "60"]).pid

    def start():
        global cluster
        cluster = dist.Cluster(2).start()

    starter = threading.Thread(target=start)
    starter.start()
    starter.join()                          # the thread that started the ranks has ended: they must live on
    print(json.dumps(cluster.pids() + cluster.run(start_sleeper, timeout=30)), flush=True)
    time.sleep(600)
""")


def test_a_killed_caller_leaves_no_rank_child_or_file_behind(tmp_path):
    """A Cluster started from a thread of a process then SIGKILLed: ranks, their children and temp files go too."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    caller = subprocess.Popen([sys.executable, "-c", CALLER], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "TMPDIR": str(tmpdir)})
    try:
        pids = json.loads(caller.stdout.readline())
    finally:
        caller.kill()
        caller.wait()
    assert len(pids) == 4, pids  # two ranks, then the child each started
    assert _all_gone(pids, 5) == []
    assert sorted(os.listdir(tmpdir)) == []


def beat(seconds, stall_rank=-1):
    """Heartbeat every 0.1 s for `seconds`; rank `stall_rank` stops after 3 beats and sleeps."""
    import torch.distributed as td

    from llmlab import dist as d

    for step in range(round(seconds / 0.1)):
        if td.get_rank() == stall_rank and step == 3:
            time.sleep(60)
        d.heartbeat()
        time.sleep(0.1)
    return step + 1


def test_heartbeats_keep_a_long_call_alive(no_leftover_processes):
    dist.heartbeat()  # outside a rank: nothing happens
    # 3 s of work, longer than stall_timeout, with a heartbeat every 0.1 s, and no limit on the call's length
    assert dist.spawn(beat, 2, 3.0, timeout=None, stall_timeout=1) == [30, 30]


def test_a_rank_without_heartbeat_raises_rank_hang_with_every_stack(no_leftover_processes):
    from llmlab.diagnose import hang

    with dist.Cluster(2) as c:
        c.run(rank_and_sum, 0.0)  # started: time only the call
        t0 = time.monotonic()
        with pytest.raises(dist.RankHang) as info:
            c.run(beat, 30.0, 1, timeout=None, stall_timeout=1)
        elapsed = time.monotonic() - t0
        assert not c.alive
    err = info.value
    assert isinstance(err, TimeoutError) and err.ranks == [1] and err.stall_timeout == 1
    assert err.headline == "no step finished for 1 s on rank 1 of 2 (no heartbeat() and no return)"
    # 0.3 s of beats, 1 s of stall, 0.25 s of polling, then the stacks (<= 2 s a rank) and killing
    assert elapsed < 0.3 + 1 + 0.25 + 5, elapsed
    assert set(err.stacks) == {0, 1} and "in beat" in err.stacks[0] and "in beat" in err.stacks[1]
    assert str(err).startswith(err.headline) and "--- rank 1 ---" in str(err)
    assert [p.rank for p in hang.diagnose_hang(err).places] == [0, 1]  # the message reads as the launcher's hang


def _die_like_cpp():
    import os
    import sys

    print("before the abort", flush=True)
    sys.stderr.write("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
                     "  what():  [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 16 vs 12.\n")
    sys.stderr.flush()
    os._exit(134)


def test_a_cpp_abort_is_said_by_the_error_not_printed_raw(capfd, no_leftover_processes):
    """A C++ exception's dying words (gloo's enforce failure) stay out of the caller's output: the RankCrashed
    error carries them once; the rank's own prints are still forwarded."""
    with pytest.raises(dist.RankCrashed) as info:
        dist.spawn(_die_like_cpp, 2, timeout=60)
    out = capfd.readouterr().out
    assert "[rank 0] before the abort" in out and "terminate called" not in out and "what():" not in out
    assert "terminate called after throwing" in str(info.value) and "16 vs 12" in str(info.value)
