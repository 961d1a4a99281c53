"""An editable install keeps working from a folder that holds `lenses/` or `lenskit/` folders of the user's own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_editable_install_is_not_shadowed_by_a_lenses_folder_in_the_cwd(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("lenskit", "lenses"):
        # The embedded model's weights are not needed to import; skip them to keep the copy small.
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.safetensors"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(src)],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    work = tmp_path / "work"
    (work / "lenses" / "gpt2").mkdir(parents=True)  # what `train-lens --out lenses/gpt2` leaves behind
    (work / "lenses" / "gpt2" / "config.json").write_text("{}")
    (work / "lenskit" / "runs").mkdir(parents=True)
    probe = "import lenses, lenskit; from lenses import TunedLens, LogitLens; print(lenses.__file__); print(lenskit.__file__)"
    for argv in ([str(python), "-c", probe], [str(python), "-m", "lenses.cli", "--help"]):
        proc = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    proc = subprocess.run([str(python), "-c", probe], cwd=work, capture_output=True, text=True, timeout=300, env=env)
    files = [Path(line) for line in proc.stdout.split()]
    assert files == [src / "lenses" / "__init__.py", src / "lenskit" / "__init__.py"], proc.stdout
