"""`make lab`: JupyterLab on the project root, for one learner or a class.

    make lab                                  # = .venv/bin/python tools/lab.py --port 8888
    make lab PORT=8893                        # another port (one per learner on a shared GPU node)
    .venv/bin/python tools/lab.py --dry-run   # print the command line instead of running it

The server's root is the project root, so the file browser reaches chapters/, exercises/ and solutions/, and the
browser opens START.md first: one page linking every chapter and its exercises (tools/landing.py writes it). A
Markdown page starts no kernel: the server's default settings (tools/lab-settings/overrides.json) open Markdown
files rendered, with live links, rather than as source text. Opening a chapter changes nothing on disk either: the
server's pre-save hook (llmlab.labserver) keeps each shipped notebook's metadata as it is in the file.
The project's .venv/bin comes first on the server's PATH, so `llmlab grade exercises/NN_topic.ipynb` works as
typed in JupyterLab's terminal, which opens in the project root.

It listens on localhost only, behind the random token JupyterLab generates and prints in its URL; from a laptop,
forward the port over ssh (README, "Workshop guide"). The token is never put on the command line, where `ps` would
show it to every user of a shared node. Run as root (rented GPU containers usually are), it adds --allow-root,
which JupyterLab demands then, and prints one line saying so.

solutions/ stays visible. llmlab is also a self-study package, where the answers are part of the material; and
hiding a folder from the file browser (ContentsManager.hide_globs) would not withhold it: JupyterLab's terminal,
its contents API given the path, and the clone itself all still reach it. An instructor who wants the answers out
of the learners' reach deletes solutions/ from the copy on the class node (`rm -r solutions`) and grades on a
machine of their own.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LANDING = "START.md"  # relative to ROOT; written by tools/landing.py
SETTINGS = "tools/lab-settings"  # relative to ROOT: the server's default settings (overrides.json)


def command(port: int, uid: int, root: Path = ROOT) -> list[str]:
    """The JupyterLab command line serving `root` on localhost:`port` (0: any free port), for user id `uid`."""
    argv = [
        sys.executable, "-m", "jupyterlab",
        f"--ServerApp.root_dir={root}",
        "--ServerApp.ip=localhost",  # overrides any config's "0.0.0.0": nothing but this machine can connect
        f"--ServerApp.port={port}",
        f"--LabApp.default_url=/lab/tree/{LANDING}",  # the page the browser opens, and the URL JupyterLab prints
        f"--LabApp.app_settings_dir={ROOT / SETTINGS}",  # overrides.json: Markdown opens rendered, links live
        "--ContentsManager.pre_save_hook=llmlab.labserver.keep_language_info",  # opening changes no notebook
    ]  # fmt: skip
    if uid == 0:
        argv.append("--allow-root")
    return argv


def environment(env: dict[str, str]) -> dict[str, str]:
    """`env` with this Python's bin folder (the project's .venv/bin) first on PATH, so that `llmlab` and `python`
    in JupyterLab's terminal are the project's, as in the README's commands."""
    bin_dir = str(Path(sys.executable).parent)  # not resolved: .venv/bin/python is a link out of the venv
    rest = [d for d in env.get("PATH", os.defpath).split(os.pathsep) if d and d != bin_dir]
    return {**env, "PATH": os.pathsep.join([bin_dir, *rest])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/lab.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8888, help="the port to listen on (default 8888; 0: any free)")
    parser.add_argument("--dry-run", action="store_true", help="print the command line instead of running it")
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port}: a port is a number from 0 to 65535")
    uid = os.geteuid()
    argv = command(args.port, uid)
    if uid == 0:
        print("tools/lab.py: running as root (uid 0, as in most containers): adding --allow-root", flush=True)
    if args.dry_run:
        print(shlex.join(argv))
        return 0
    os.execve(argv[0], argv, environment(os.environ))  # JupyterLab takes this process over: Ctrl-C reaches it


if __name__ == "__main__":
    sys.exit(main())
