"""The README's workshop guide: every capstone command in it (and in tools/workshop/capstone.sbatch) is one that
`llmlab train` accepts, with a layout its check passes for the world size torchrun would give it."""

import re
import shlex
from pathlib import Path

import pytest

from llmlab.train import capstone

ROOT = Path(__file__).resolve().parent.parent
SBATCH = ROOT / "tools" / "workshop" / "capstone.sbatch"


def commands(text: str) -> list[str]:
    """Shell commands that run the capstone under torchrun, continuation lines joined."""
    return [line for line in text.replace("\\\n", " ").splitlines() if "torchrun" in line and "-m llmlab.train" in line]


def world_size(torchrun_args: list[str], nodes: int) -> int:
    value = {a: b for a, b in zip(torchrun_args, torchrun_args[1:], strict=False)}
    nnodes = value.get("--nnodes", "1")
    return (nodes if nnodes == "$SLURM_NNODES" else int(nnodes)) * int(value["--nproc-per-node"])


def guide_commands():
    readme = (ROOT / "README.md").read_text()
    guide = readme[readme.index("## Workshop guide"):readme.index("## Tests")]
    sbatch = SBATCH.read_text()
    nodes = int(re.search(r"#SBATCH --nodes=(\d+)", sbatch)[1])
    return [(c, nodes) for c in commands(guide) + commands(sbatch)]


def test_the_guide_has_its_commands():
    found = guide_commands()
    assert len(found) >= 5  # two on one node, one on 2 nodes, SLURM in the README and in the batch file
    assert {world_size(shlex.split(c.split("-m llmlab.train")[0]), n) for c, n in found} == {8, 16}


@pytest.mark.parametrize("command,nodes", guide_commands())
def test_capstone_commands_are_accepted(command, nodes):
    launcher, flags = command.split("-m llmlab.train")
    args = capstone.build_parser().parse_args(shlex.split(flags))
    config = capstone.RunConfig.from_args(args)
    capstone.check(config, world_size(shlex.split(launcher), nodes))  # raises ValueError on a bad layout
