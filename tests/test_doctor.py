"""`llmlab doctor`: passes here, ending with the verdict line; a broken check fails the run and is named."""

import subprocess
import sys
from pathlib import Path

import torch
from llmlab.kernels import vector_add

from llmlab import doctor, runtime

LLMLAB = Path(sys.executable).with_name("llmlab")  # the console script installed next to this Python


def test_doctor_passes_here():
    out = subprocess.run([str(LLMLAB), "doctor"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    for name, _ in doctor.CHECKS:
        assert any(line.split()[:2] == ["ok", name] for line in lines), f"no 'ok {name}' line:\n{out.stdout}"
    assert lines[-1] == f"doctor: all checks passed — every chapter can run here ({runtime.tier().name} tier)"
    assert "Triton interpreted" in out.stdout or "Triton compiled" in out.stdout


def test_a_failing_check_is_named_and_the_others_still_run(monkeypatch, capsys):
    monkeypatch.setattr(vector_add, "add", lambda x, y: x - y)  # a kernel with a bug

    def broken_versions():
        raise RuntimeError("metadata unreadable")

    checks = dict(doctor.CHECKS)
    checks["versions"] = broken_versions
    checks["speed"] = lambda: (True, "not measured in this test")
    monkeypatch.setattr(doctor, "CHECKS", list(checks.items()))
    assert doctor.main() == 1
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("  FAIL  versions    RuntimeError: metadata unreadable") for line in lines)
    assert any(line.startswith("  FAIL  triton      vector_add (") and "differs from its reference" in line
               for line in lines)
    assert any(line.startswith("  ok    all-reduce") for line in lines), "checks after a failure must run"
    assert lines[-1].startswith("doctor: 2 checks failed (versions, triton)")


def test_triton_check_reports_the_error(monkeypatch):
    monkeypatch.setattr(vector_add, "add", lambda x, y: torch.zeros_like(x))
    ok, text = doctor.check_triton()
    assert not ok and "float32: max |error|" in text and "bfloat16" in text
