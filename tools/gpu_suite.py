"""The GPU suite: everything llmlab does on a GPU, run in one call on a GPU node, each part in its own time box.

On a GPU node that has PyTorch and Triton installed and no network, from a clone of the project:

    python3 tools/gpu_suite.py --wheels wheels/     # installs what is missing from wheels/, then runs every part
    python3 tools/gpu_suite.py --parts bench,chapters --budget 300

The parts, in this order (GPU timings first, while nothing else runs on the card):

    doctor    `llmlab doctor`: tier, versions, devices, speed, an all-reduce, a Triton kernel
    pytest    the tests marked `gpu` (`pytest -m gpu` over the test files that carry the mark)
    bench     gemm, attention, grouped_gemm, precision, checkpoint, compress, quant, moe, zero, allreduce (NCCL on
              the GPUs the node has): each writes its JSON record, device named, to OUT/results/NAME-DEVICE.json
    chapters  every chapter executed on this tier as `llmlab site` does, several at once, pages in OUT/pages/

Each part runs in a process group of its own with its own limit (`LIMITS`) and never past the whole run's
`--budget` (default 540 s: the suite fits 9 minutes on one H100/H200); a hung part costs its limit and is killed
with everything it started. The suite ends with one summary line per part (also OUT/summary.txt) and exits 1 when
any part failed, ran out of time or was not reached. Logs: OUT/logs/PART.log. OUT defaults to build/gpu-suite.

The wheel folder (prepared on a machine with network; the node's Python and platform named):

    python3 tools/gpu_suite.py wheels wheels/ --python 3.12           # manylinux x86_64, CPython 3.12
    python3 tools/gpu_suite.py wheels wheels/ --skip node-freeze.txt  # less what the node has (its `pip freeze`)

downloads llmlab's dependencies (without torch, triton and numpy, which the node has) and everything they need,
as binary wheels for that Python (`pip download --only-binary=:all:`); the notebook stack is pure Python except
pyzmq, tornado, psutil, debugpy, markupsafe and rpds-py. On the node, `--wheels DIR` installs into
OUT/site-packages, with `pip install --no-index --no-deps`, each wheel whose distribution the node lacks (one it
has is kept: it was installed with torch, and replacing it could break torch), then llmlab itself from this clone,
and runs the parts with that folder on PYTHONPATH.

CPU mode (CI, `make gpu-suite-cpu`): `--smoke` runs the same parts on the CPU with LLMLAB_GPU_SMOKE=2 (two stand-in
GPUs, so the branches for several GPUs run too), the mode in which every GPU-only branch of the chapters, benches and
claims runs with tiny sizes and CPU stand-ins for the CUDA-only calls (`llmlab.runtime`): a typo in a GPU branch fails
here, not in a workshop. Its records are stand-in runs, named `…-smoke.json`, and never go to results/.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("doctor", "pytest", "bench", "chapters")
BENCHES = ("gemm", "attention", "grouped_gemm", "precision", "checkpoint", "compress", "quant", "moe", "zero",
           "allreduce")
# seconds each piece may take at most (a bench or a chapter is one piece): compilation and autotuning included
LIMITS = {"doctor": 90, "pytest": 150, "bench": 75, "bench gemm": 150, "bench grouped_gemm": 150, "chapter": 180,
          "install": 240}
NODE_HAS = ("torch", "triton", "numpy")  # never carried: the node's own builds (CUDA) must stay
# what the parts import, checked once installed; jupyter_core.paths needs platformdirs, which nbconvert's import of
# its exporters swallows when missing
IMPORTS = ("jupyter_core.paths", "nbconvert.exporters.html", "nbclient", "ipykernel.kernelapp", "ipywidgets",
           "matplotlib.pyplot", "llmlab.kernels.gemm", "llmlab.site")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


@dataclass
class Outcome:
    part: str
    status: str  # "ok" | "failed" | "timed out" | "not reached"
    seconds: float
    detail: str = ""

    def line(self) -> str:
        return f"suite  {self.part:<20} {self.status:<11} {self.seconds:6.1f} s  {self.detail}"


class Clock:
    """The whole run's budget: what a part may still take is its own limit (times `scale`) or what is left, the
    smaller. The CPU mode scales the limits, set for a GPU node, by 2: a 2-core CPU runs the CPU sizes."""

    def __init__(self, budget: float, scale: float = 1.0):
        self.deadline, self.scale = time.monotonic() + budget, scale

    def allow(self, limit: float) -> float:
        return min(limit * self.scale, self.deadline - time.monotonic())


def run_boxed(part: str, argv: list[str], limit: float, log: Path, env: dict[str, str] | None,
              cwd: Path = ROOT) -> Outcome:
    """Run `argv` in `cwd`, in a new process group, for at most `limit` seconds (output to `log`); then kill the
    group, so nothing it started outlives it."""
    if limit < 2:
        return Outcome(part, "not reached", 0.0, "the suite's budget was spent")
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _kill_group(proc)
            proc.wait()
    seconds = time.monotonic() - started
    tail = _last_lines(log)
    if code is None:
        return Outcome(part, "timed out", seconds, f"killed after {limit:.0f} s; last: {tail}")
    return Outcome(part, "ok" if code == 0 else "failed", seconds, tail if code else _headline(log))


def _kill_group(proc: subprocess.Popen, grace: float = 2.0) -> None:
    """SIGTERM every process of `proc`'s group, then SIGKILL what is still there after `grace` seconds."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            time.sleep(0.05)
            proc.poll()  # reap the leader: a zombie still counts as a member of its group
            os.killpg(proc.pid, 0)  # raises ProcessLookupError once the group is empty
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return


def _last_lines(log: Path, n: int = 2) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(lines[-n:])[-300:]


def _headline(log: Path) -> str:
    """The line of a passing part's log worth a summary: pytest's counts, doctor's verdict, a bench's table head."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for pattern in (r"\d+ (passed|skipped|deselected)", r"^doctor:", r"^wrote "):
        found = [line for line in lines if re.search(pattern, line)]
        if found:
            return found[-1][-200:]
    return lines[-1][-200:] if lines else ""


# --- the wheel folder and installing from it ---------------------------------------------------------------------


def _dependencies() -> list[str]:
    """llmlab's dependencies from pyproject.toml, less the ones the node has (torch, triton, numpy)."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [d for d in deps if _dist_name(re.split(r"[\s;<>=!~\[]", d, maxsplit=1)[0]) not in NODE_HAS]


def _names(spec: str) -> set[str]:
    """Distribution names from a comma-separated list, or from a file of `pip freeze` / `pip list` lines."""
    path = Path(spec)
    words = ([line.split()[0] for line in path.read_text().splitlines() if line.strip()]
             if "," not in spec and path.is_file() else spec.split(","))  # fmt: skip
    return {_dist_name(re.split(r"[=<>@ ]", w.strip(), maxsplit=1)[0]) for w in words if w.strip()}


def prepare_wheels(folder: Path, python: str, skip: set[str]) -> int:
    """Download llmlab's dependencies, with theirs, as wheels for CPython `python` on manylinux x86_64; then drop
    the wheels of NODE_HAS and of `skip` (what the node is known to have: the node keeps its own)."""
    argv = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version", python,
            "--implementation", "cp", "-d", str(folder), *[f"--platform={p}" for p in PLATFORMS], *_dependencies()]
    code = subprocess.call(argv)
    wheels = sorted(folder.glob("*.whl"))
    for kept in (w for w in wheels if _dist_name(w.name.split("-")[0]) in {*NODE_HAS, *skip}):
        kept.unlink()  # the node's own stays (numpy comes in as matplotlib's dependency)
    total = sum(w.stat().st_size for w in folder.glob("*.whl"))
    print(f"{len(list(folder.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB in {folder}")
    return code


def _dist_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def install(wheels: Path, site: Path, env: dict[str, str]) -> Outcome:
    """Install into `site` each wheel of `wheels` whose distribution this Python lacks, then llmlab from ROOT."""
    started = time.monotonic()
    found = sorted(wheels.glob("*.whl"))
    if not found:
        return Outcome("install", "failed", 0.0, f"no wheels in {wheels}")
    have = {_dist_name(d.metadata["Name"]) for d in metadata.distributions()}
    missing = [w for w in found if _dist_name(w.name.split("-")[0]) not in have]
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target",
           str(site)]
    steps = [pip + [str(w) for w in missing]] if missing else []
    steps.append(pip + ["--no-build-isolation", str(ROOT)])  # llmlab itself (with llmlab.kernels from kernels/)
    # then every module the parts import, in a fresh process with `site` on the path: a dependency the node lacks
    # and the folder does not carry shows here by name (nbconvert, for one, hides it: its exporters are then absent)
    steps.append([sys.executable, "-c", f"import importlib; [importlib.import_module(m) for m in {IMPORTS!r}]"])
    for argv in steps:
        done = subprocess.run(argv, cwd=site.parent, env=dict(env, PYTHONPATH=str(site)), capture_output=True,
                              text=True, timeout=LIMITS["install"])  # fmt: skip
        if done.returncode:
            return Outcome("install", "failed", time.monotonic() - started, (done.stderr or done.stdout)[-300:])
    return Outcome("install", "ok", time.monotonic() - started,
                   f"{len(missing)} of {len(found)} wheels installed (the rest were here), and llmlab, into {site}")


# --- the parts ---------------------------------------------------------------------------------------------------


def _device_slug(env: dict[str, str], cwd: Path) -> str:
    code = "from llmlab import hardware, runtime; print(hardware.device_name(runtime.device()))"
    name = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=cwd).stdout.strip()  # fmt: skip
    return re.sub(r"[^a-z0-9]+", "-", name.lower().removeprefix("nvidia ")).strip("-") or "unknown"


_GPU_MARK = re.compile(r"^@pytest\.mark\.gpu\b|^pytestmark = pytest\.mark\.gpu\b", re.M)


def _gpu_test_files() -> list[str]:
    """The test files with a test marked `gpu` (a decorator or a module mark at the start of a line)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if _GPU_MARK.search(p.read_text()))  # fmt: skip


def pytest_command(env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The `pytest -m gpu` command over the marked test files, and its environment.

    --import-mode=importlib: pytest puts no folder of the checkout on sys.path, so with wheels the installed llmlab
    is found, not the checkout's. Test files import helpers from each other (`from test_kernels_gemm import ...`),
    so tests/ alone goes on PYTHONPATH: it holds no llmlab.
    """
    argv = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
            "-p", "no:nbval", "--rootdir", str(ROOT), "--import-mode=importlib",
            *[str(ROOT / f) for f in _gpu_test_files()]]
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), env.get("PYTHONPATH", "")]))
    return argv, dict(env, PYTHONPATH=path)


def part_chapters(out: Path, clock: Clock, jobs: int, env: dict[str, str], cwd: Path) -> list[Outcome]:
    """Every chapter as `llmlab site` builds it, `jobs` at once, each in its own boxed process."""
    chapters = sorted((ROOT / "chapters").glob("[0-9]*.ipynb"))
    code = ("import sys; from llmlab import site; p = site.build_page(sys.argv[1], sys.argv[2], float(sys.argv[3])); "
            "print(p.problem or 'ok'); sys.exit(1 if p.problem else 0)")

    def one(notebook: Path) -> Outcome:
        limit = clock.allow(LIMITS["chapter"])
        argv = [sys.executable, "-c", code, str(notebook), str(out / "pages"), str(max(limit - 10, 1))]
        return run_boxed(f"chapter {notebook.stem}", argv, limit, out / "logs" / f"{notebook.stem}.log", env, cwd)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, chapters))


def part_benches(out: Path, clock: Clock, slug: str, env: dict[str, str], cwd: Path,
                 benches=BENCHES) -> list[Outcome]:
    outcomes = []
    for name in benches:
        record = out / "results" / f"{name}-{slug}.json"
        argv = [sys.executable, "-m", "llmlab.cli", "bench", name, "--json", str(record)]
        limit = clock.allow(LIMITS.get(f"bench {name}", LIMITS["bench"]))
        outcomes.append(run_boxed(f"bench {name}", argv, limit, out / "logs" / f"bench-{name}.log", env, cwd))
    return outcomes


def run_suite(out: Path, parts: list[str], budget: float, jobs: int, smoke: bool, wheels: Path | None,
              benches=BENCHES) -> int:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TQDM_DISABLE="1")
    if smoke:
        env["LLMLAB_GPU_SMOKE"] = "2"  # two stand-in GPUs: the branches for several GPUs run too
    outcomes: list[Outcome] = []
    out.mkdir(parents=True, exist_ok=True)
    cwd = ROOT  # where the parts run: here llmlab is the project's editable install
    if wheels is not None:
        # llmlab installed into `site`: the parts run outside the checkout, whose llmlab/ (without kernels/, which
        # the install maps to llmlab.kernels) would otherwise come first on sys.path
        site, cwd = out / "site-packages", out
        outcomes.append(install(wheels, site, env))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH", "")]))
        # the wheels' data files (nbconvert's page templates) are under site/share/jupyter
        env["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(site / "share" / "jupyter"),
                                                            env.get("JUPYTER_PATH", "")]))
    clock = Clock(budget, scale=2.0 if smoke else 1.0)
    slug = "smoke" if smoke else _device_slug(env, cwd)
    logs = out / "logs"
    if "doctor" in parts:
        outcomes.append(run_boxed("doctor", [sys.executable, "-m", "llmlab.cli", "doctor"],
                                  clock.allow(LIMITS["doctor"]), logs / "doctor.log", env, cwd))  # fmt: skip
    if "pytest" in parts:
        argv, pytest_env = pytest_command(env)
        outcomes.append(run_boxed("pytest -m gpu", argv, clock.allow(LIMITS["pytest"]), logs / "pytest.log",
                                  pytest_env, cwd))  # fmt: skip
    if "bench" in parts:
        outcomes += part_benches(out, clock, slug, env, cwd, benches)
    if "chapters" in parts:
        outcomes += part_chapters(out, clock, jobs, env, cwd)
    summary = "\n".join(o.line() for o in outcomes)
    failed = [o for o in outcomes if o.status != "ok"]
    summary += f"\nsuite  {len(outcomes) - len(failed)} of {len(outcomes)} parts ok on {slug}" + (
        f"; not ok: {', '.join(o.part for o in failed)}" if failed else "")
    (out / "summary.txt").write_text(summary + "\n")
    (out / "summary.json").write_text(json.dumps([o.__dict__ for o in outcomes], indent=1) + "\n")
    print(summary)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("verb", nargs="?", choices=("run", "wheels"), default="run")
    parser.add_argument("folder", nargs="?", help="wheels: the folder to download into")
    parser.add_argument("--python", default="3.12", help="wheels: the node's Python version (default 3.12)")
    parser.add_argument("--skip", default="", help="wheels: what the node has (names, comma-separated, or a file of "
                        "its `pip freeze`): not downloaded")
    parser.add_argument("--wheels", type=Path, help="install what is missing from this wheel folder first")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "gpu-suite")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)}")
    parser.add_argument("--benches", default=",".join(BENCHES), help="the benches of the bench part, in order")
    parser.add_argument("--budget", type=float, default=540, help="seconds for all the parts together")
    parser.add_argument("--jobs", type=int, default=None, help="chapters at once (default: cores // 4, ≥ 1)")
    parser.add_argument("--smoke", action="store_true", help="CPU mode: GPU branches on the CPU, tiny sizes")
    args = parser.parse_args(argv)
    if args.verb == "wheels":
        if not args.folder:
            parser.error("wheels: give the folder to download into")
        return prepare_wheels(Path(args.folder), args.python, _names(args.skip) if args.skip else set())
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if unknown := sorted(set(parts) - set(PARTS)):
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    benches = [b.strip() for b in args.benches.split(",") if b.strip()]
    if unknown := sorted(set(benches) - set(BENCHES)):
        parser.error(f"--benches: unknown {', '.join(unknown)}; choose from {', '.join(BENCHES)}")
    if not args.budget > 0:
        parser.error(f"--budget={args.budget}: must be a positive number of seconds")
    if args.wheels is not None and not args.wheels.is_dir():
        parser.error(f"--wheels={args.wheels}: not a folder")
    jobs = args.jobs if args.jobs is not None else max(1, (os.cpu_count() or 1) // 4)
    if jobs < 1:
        parser.error(f"--jobs={jobs}: must be at least 1")
    return run_suite(args.out.resolve(), parts, args.budget, jobs, args.smoke,
                     args.wheels.resolve() if args.wheels else None, benches)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
