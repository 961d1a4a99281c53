"""The sdist and the wheel built from it carry both packages, the console script and the embedded models; the
wheel installs into a fresh environment and runs."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """`python -m build` as CI runs it (the sdist, then the wheel from the sdist), from a copy of the checkout, so
    the build leaves no build/ or egg-info changes in it."""
    tmp = tmp_path_factory.mktemp("dist")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for package in ("lenskit", "lenses"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return out


def _wheel(dist: Path) -> Path:
    wheels = list(dist.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.mark.slow
def test_wheel_contains_packages_and_default_model(dist):
    wheels = [_wheel(dist)]
    with zipfile.ZipFile(wheels[0]) as zf:
        names = set(zf.namelist())
        entry_points = next((zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt")), "")
    assert {"lenskit/__init__.py", "lenskit/model.py", "lenses/__init__.py", "lenses/cli/__init__.py"} <= names
    assert {"lenses/view/view.js", "lenses/view/view.css"} <= names  # the interactive view's script and style
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
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "the wheel carries no LICENSE"


@pytest.mark.slow
def test_sdist_carries_the_license_and_passes_twine_check(dist):
    sdists = list(dist.glob("*.tar.gz"))
    assert len(sdists) == 1 and sdists[0].name.startswith("lenskit_interp-"), sdists
    with tarfile.open(sdists[0]) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    assert {"LICENSE", "pyproject.toml", "lenskit/default_model/model.safetensors"} <= names
    pytest.importorskip("twine")  # the dev extra installs it
    proc = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, dist.iterdir())],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_runs_lens(dist, tmp_path):
    # --system-site-packages so torch and the rest are not installed again; --ignore-installed so the checkout's
    # editable install outside the venv does not count as this one.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True, timeout=120)
    bin_dir = venv / ("Scripts" if os.name == "nt" else "bin")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), "install", "-q", "--no-deps", "--ignore-installed", str(_wheel(dist))],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    work = tmp_path / "work"
    work.mkdir()
    where = subprocess.run([str(bin_dir / "python"), "-c", "import lenskit, lenses; print(lenskit.__file__); print(lenses.__file__)"],
                           cwd=work, capture_output=True, text=True, timeout=300, env=env)
    assert where.returncode == 0, where.stderr[-3000:]
    assert all(Path(line).is_relative_to(venv) for line in where.stdout.split()), where.stdout  # the wheel's copy ran

    version = subprocess.run([str(bin_dir / "lenskit"), "--version"], cwd=work, capture_output=True, text=True, timeout=300, env=env)
    assert version.stdout.strip() == f"lenskit {_wheel(dist).name.split('-')[1]}", version.stdout + version.stderr
    proc = subprocess.run([str(bin_dir / "lenskit"), "lens", "def f(x):\n    return x", "--csv", "lens.csv"],
                          cwd=work, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(work / "lens.csv") as f:
        rows = list(csv.DictReader(f))
    layers = {int(r["layer"]) for r in rows}
    assert layers == set(range(len(layers))) and len(layers) > 1, sorted(layers)
    assert all(0.0 <= float(r["top_prob"]) <= 1.0 for r in rows)
