"""`kernels/` ships as `llmlab.kernels`, both in this editable install and in a built wheel."""

import subprocess
import sys
import zipfile
from pathlib import Path

import llmlab.kernels

ROOT = Path(__file__).resolve().parents[1]


def test_editable_install_maps_kernels_folder():
    assert Path(llmlab.kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"


def test_wheel_contains_llmlab_kernels(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                          "-w", str(tmp_path), "-q"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("llmlab-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {str(p.relative_to(ROOT)).replace("kernels/", "llmlab/kernels/", 1)
                for p in (ROOT / "kernels").glob("*.py")}
    expected |= {str(p.relative_to(ROOT)) for p in (ROOT / "llmlab").rglob("*.py")}
    assert expected <= names, sorted(expected - names)
    assert not any(n.startswith("kernels/") for n in names), "kernels/ must not be a top-level package"
    assert "llmlab/CLAIMS.md" in names, "the claims registry reads llmlab/CLAIMS.md at run time"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "llmlab = llmlab.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
