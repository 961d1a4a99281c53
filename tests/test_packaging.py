"""The wheel carries both packages, the console script and the embedded default model."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_contains_packages_and_default_model(tmp_path):
    # Build from a copy, so the build leaves no build/ or egg-info changes in the checkout.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("lenskit", "lenses"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(wheels[0]) as zf:
        names = set(zf.namelist())
        entry_points = next((zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt")), "")
    assert {"lenskit/__init__.py", "lenskit/model.py", "lenses/__init__.py", "lenses/cli/__init__.py"} <= names
    assert not any(n.endswith((".cpp", ".c", ".cu")) for n in names)  # nothing needs a compiler at install time
    assert "lenskit = lenses.cli:main" in entry_points
    model_files = {n.removeprefix("lenskit/default_model/") for n in names if n.startswith("lenskit/default_model/")}
    assert {"config.json", "model.safetensors"} <= model_files, (
        f"the wheel's lenskit/default_model/ holds {sorted(model_files)}; is the embedded model trained?"
    )
    assert "tokenizer.json" in model_files or {"vocab.json", "merges.txt"} <= model_files, sorted(model_files)
    llama_files = {n.removeprefix("lenskit/stdlib_llama/") for n in names if n.startswith("lenskit/stdlib_llama/")}
    assert {"config.json", "model.safetensors", "vocab.json", "merges.txt", "README.md"} <= llama_files, sorted(llama_files)
    assert wheels[0].name.startswith("lenskit_interp-"), wheels[0].name
    assert not any(n.endswith((".bin", ".pt", ".pkl")) for n in names)  # no pickles shipped
