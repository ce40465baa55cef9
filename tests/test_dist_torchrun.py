"""`init_from_env` joins a group started by torchrun, refuses clearly outside one, and names missing peers."""

import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from llmlab import dist

SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as td
    from llmlab import dist, runtime
    rank, world = dist.init_from_env()
    assert dist.init_from_env() == (rank, world)  # idempotent
    t = torch.tensor([float(rank + 1)], device=runtime.device())
    td.all_reduce(t)
    print(f"rank {rank}/{world} sum {t.item():g}", flush=True)
    td.destroy_process_group()
""")


def test_init_from_env_under_torchrun(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this python")
    script = tmp_path / "allreduce.py"
    script.write_text(SCRIPT)
    out = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "3", str(script)],
                         capture_output=True, text=True, timeout=180,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    # the ranks share one stdout, so their lines may interleave mid-line: find the reports anywhere
    assert sorted(re.findall(r"rank (\d)/3 sum (\d+)", out.stdout)) == [(str(r), "6") for r in range(3)], out.stdout


def test_init_from_env_outside_torchrun_says_how_to_launch(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match="not started by torchrun.*torchrun --standalone"):
        dist.init_from_env()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def alone(monkeypatch):
    """The env:// variables of a job of 3 ranks whose peers never start; returns the rendezvous address."""
    port = _free_port()
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    for key, value in dict(WORLD_SIZE="3", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(key, value)
    return f"127.0.0.1:{port}"


def test_missing_peers_are_named_after_the_timeout(alone, monkeypatch):
    monkeypatch.setenv("RANK", "0")  # rank 0 hosts the store; ranks 1 and 2 never come
    monkeypatch.setenv("LLMLAB_INIT_TIMEOUT", "2")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        dist.init_from_env(backend="gloo")
    assert time.monotonic() - t0 < 2 + 3  # the timeout, and a little for the store (seen: 0.01 s over)
    assert str(info.value) == (f"init_from_env: rank 0 waited 2s at the rendezvous {alone}: ranks 1, 2 did not join "
                               "(expected WORLD_SIZE=3, 1 joined)")


def test_an_unreachable_rendezvous_is_named(alone, monkeypatch):
    monkeypatch.setenv("RANK", "2")  # nobody hosts the store
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"rank 2 could not reach the rendezvous store at {alone} within 1s "
                                           r"\(WORLD_SIZE=3; rank 0 hosts it"):
        dist.init_from_env(backend="gloo", timeout=1)
    assert time.monotonic() - t0 < 1 + 5  # the store client retries with a back-off: seen up to 1.9 s over


@pytest.mark.parametrize("key, value, message", [("RANK", "x", "RANK='x' must be an integer"),
                                                 ("RANK", "3", r"RANK=3 must be in \[0, WORLD_SIZE=3\)"),
                                                 ("LLMLAB_INIT_TIMEOUT", "0", "LLMLAB_INIT_TIMEOUT")])
def test_bad_environment_is_named(alone, monkeypatch, key, value, message):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=message):
        dist.init_from_env(backend="gloo")
