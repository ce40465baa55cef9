"""tools/gpu_suite.py: its time boxes, its budget, the wheel list and the parts it finds, without a GPU.

The suite itself runs in CI in its CPU mode (`make gpu-suite-cpu`, .ci/run) and on a GPU node in full.
"""

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "tools" / "gpu_suite.py")
suite = sys.modules["gpu_suite"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(suite)


def test_a_hung_part_is_killed_at_its_limit_with_what_it_started(tmp_path):
    pidfile = tmp_path / "child.pid"
    # the part starts a child that would outlive it, then hangs: the box must end both
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            f" open({str(pidfile)!r}, 'w').write(str(c.pid)); print('started', flush=True); time.sleep(60)")
    started = time.monotonic()
    outcome = suite.run_boxed("hang", [sys.executable, "-c", code], 4, tmp_path / "hang.log", env=None)
    assert outcome.status == "timed out" and "started" in outcome.detail
    # its 4 s limit (two Python starts fit in it on a loaded machine) and the kill's grace, not the part's 60 s
    assert time.monotonic() - started < 12
    child = int(pidfile.read_text())
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]


def test_failed_and_passing_parts_say_why(tmp_path):
    bad = suite.run_boxed("bad", [sys.executable, "-c", "raise SystemExit('no such device')"], 30,
                          tmp_path / "bad.log", env=None)  # fmt: skip
    assert bad.status == "failed" and "no such device" in bad.detail
    good = suite.run_boxed("good", [sys.executable, "-c", "print('3 passed, 1 skipped in 0.5s')"], 30,
                           tmp_path / "good.log", env=None)  # fmt: skip
    assert good.status == "ok" and good.detail == "3 passed, 1 skipped in 0.5s"
    assert good.line().startswith("suite  good") and " ok " in good.line()


def test_a_part_past_the_budget_is_not_reached(tmp_path):
    clock = suite.Clock(budget=0.0)
    outcome = suite.run_boxed("late", [sys.executable, "-c", "pass"], clock.allow(60), tmp_path / "x.log", env=None)
    assert outcome.status == "not reached" and not (tmp_path / "x.log").exists()
    assert suite.Clock(budget=100).allow(30) == 30
    assert suite.Clock(budget=100, scale=2).allow(30) == 60 and 0 < suite.Clock(budget=40, scale=2).allow(30) <= 40


def test_wheel_names_and_what_the_node_keeps(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("Jinja2==3.1.6\nmatplotlib @ file:///x\ntyping_extensions==4.1\n")
    assert suite._names(str(freeze)) == {"jinja2", "matplotlib", "typing-extensions"}
    assert suite._names("PyYAML, python_dateutil") == {"pyyaml", "python-dateutil"}
    deps = {suite._dist_name(d.split(">")[0].split(";")[0].split("=")[0].strip()) for d in suite._dependencies()}
    assert not deps & set(suite.NODE_HAS) and {"nbclient", "ipykernel", "jupyterlab"} <= deps


def test_the_gpu_tests_it_runs_carry_the_mark():
    files = suite._gpu_test_files()
    assert "tests/test_hardware.py" in files and "tests/test_memory_measure.py" in files
    # a file that only mentions the mark in a string (a notebook cell it writes) is not one of them
    assert "tests/test_notebook_harness.py" not in files and "tests/test_gpu_suite.py" not in files


def test_the_gpu_tests_it_runs_are_collected(tmp_path):
    # the suite's own command, as CI's `make gpu-suite-cpu` runs it, only collecting: a test file that imports a
    # helper from another (importlib mode puts no test folder on sys.path) once broke the whole part
    argv, env = suite.pytest_command(dict(os.environ, LLMLAB_GPU_SMOKE="2"))
    done = subprocess.run([*argv, "--collect-only"], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stdout.splitlines()[-1]  # "15/230 tests collected (215 deselected) in 1.62s"
    assert "error" not in last and " collected" in last and not last.startswith("0/")
