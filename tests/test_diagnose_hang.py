"""llmlab.diagnose.hang: a hung collective diagnosed from the launcher's per-rank stacks, and DETAIL checks."""

import os
import time

import pytest

from llmlab import dist
from llmlab.diagnose import hang


@pytest.fixture(scope="module")
def cluster3():
    with dist.Cluster(3, threads_per_rank=1) as c:
        yield c


def planted_hang():
    import torch
    import torch.distributed as td

    if td.get_rank() == 1:
        time.sleep(60)  # rank 1 skips the all_reduce
    else:
        td.all_reduce(torch.ones(3))  # (3,)


def mismatched(kind):
    import torch
    import torch.distributed as td

    rank = td.get_rank()
    if kind == "shape":
        td.all_reduce(torch.ones(3 + rank))  # (3,) on rank 0, (4,) on rank 1
    elif rank == 0:
        td.all_reduce(torch.ones(3))  # (3,)
    else:
        td.broadcast(torch.ones(3), src=0)  # (3,)


def launcher_message(unfinished, world_size, frames):
    """A TimeoutError worded as llmlab.dist.launcher writes it; frames: rank -> [(file, line, function)]."""
    worker = [("/x/llmlab/dist/_worker.py", 91, "main"), ("<frozen runpy>", 88, "_run_code")]
    stacks = "\n\n".join(f"--- rank {r} ---\nCurrent thread 0x00007f (most recent call first):\n" + "\n".join(
        f'  File "{f}", line {n} in {fn}' for f, n, fn in [*fs, *worker]) for r, fs in frames.items())
    return TimeoutError(f"ranks {', '.join(map(str, unfinished))} of {world_size} had not finished within "
                        f"timeout=5s; the cluster's ranks were stopped\n\nwhere every rank was:\n{stacks}")


C10D = "/v/site-packages/torch/distributed/distributed_c10d.py"


def test_diagnose_hang_parses_different_collectives_and_finished_ranks():
    logger = ("/v/site-packages/torch/distributed/c10d_logger.py", 83, "wrapper")
    different = hang.diagnose_hang(launcher_message([0, 1], 2, {
        0: [(C10D, 3252, "all_reduce"), logger, ("/u/train.py", 12, "step")],
        1: [(C10D, 2890, "broadcast"), logger, ("/u/train.py", 15, "step")]}))
    assert [p.call for p in different.places] == ["all_reduce", "broadcast"]
    assert str(different.places[0].where) == "step (train.py:12)"
    assert "called different collectives" in different.verdict
    returned = hang.diagnose_hang(str(launcher_message([0, 2], 3, {
        r: [(C10D, 3252, "all_reduce"), logger, ("/u/train.py", 12, "step")] for r in (0, 2)})))
    assert [p.state for p in returned.places] == ["waiting", "finished", "waiting"]
    assert "ranks 0, 2 wait in all_reduce (step (train.py:12)); rank 1 returned without calling it" in str(returned)
    same = hang.diagnose_hang(launcher_message([0, 1], 2, {
        r: [(C10D, 3252, "all_reduce"), ("/u/train.py", 12, "step")] for r in (0, 1)}))
    assert "from the same line" in same.verdict and "debug_detail()" in same.verdict


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="error must be the TimeoutError"):
        hang.diagnose_hang(ValueError("not a hang"))
    with pytest.raises(ValueError, match="error has no per-rank stacks"):
        hang.diagnose_hang(TimeoutError("ranks 0, 1 did not join the process group within start_timeout=5s"))


def test_planted_hang_diagnosed(cluster3):
    timeout = 6
    cluster3.run(os.getpid)  # the ranks are up: time only the hung call
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        cluster3.run(planted_hang, timeout=timeout)
    assert time.monotonic() - t0 < timeout + 5  # stack dumps and killing take a few seconds
    report = hang.diagnose_hang(info.value)
    waiting, skipped = [report.places[r] for r in (0, 2)], report.places[1]
    assert all(p.state == "waiting" and p.call == "all_reduce" and p.where.function == "planted_hang"
               for p in waiting)
    assert skipped.state == "elsewhere" and skipped.where.function == "planted_hang"
    assert skipped.where.line != waiting[0].where.line
    assert "ranks 0, 2 wait in all_reduce" in report.verdict and "rank 1 never reached it" in report.verdict


def test_debug_detail_turns_a_mismatch_into_an_error():
    before = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
    with hang.debug_detail():
        cluster = dist.Cluster(2, threads_per_rank=1).start()
    assert os.environ.get("TORCH_DISTRIBUTED_DEBUG") == before
    with cluster:
        for kind, difference in (("shape", "Tensor shapes: 3vs 4"), ("op", "Op type: ALLREDUCEvs BROADCAST")):
            t0 = time.monotonic()
            with pytest.raises(dist.RankError, match="Detected mismatch between collectives") as info:
                cluster.run(mismatched, kind, timeout=10)
            assert difference in str(info.value) and time.monotonic() - t0 < 5  # an error, not a hang
