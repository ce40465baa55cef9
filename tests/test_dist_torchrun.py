"""`init_from_env` joins a group started by torchrun, and refuses clearly outside one."""

import os
import re
import shutil
import subprocess
import sys
import textwrap

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
