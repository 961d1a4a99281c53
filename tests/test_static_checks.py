"""The static checks (scripts/static_checks.sh) run in CI before the tests, and their settings still catch what
they are there for: ruff an unsorted import and an undefined name; mypy a name imported from a module that no
longer has it (what moving code breaks) and a call with a wrong argument."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_static_checks_before_the_tests():
    lines = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    checks = lines.index("bash scripts/static_checks.sh")
    first_tests = next(i for i, line in enumerate(lines) if "-m pytest" in line)
    assert checks < first_tests
    script = (ROOT / "scripts/static_checks.sh").read_text()
    assert "-m ruff check lenskit lenses tests experiments benchmarks scripts" in script and "-m mypy" in script


def test_the_checkers_are_dev_dependencies_pinned_by_the_constraints():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    pins = {line.split("==")[0] for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line}
    for tool in ("ruff", "mypy"):
        assert any(req.startswith(tool) for req in dev), f"{tool} is not in the dev extra"
        assert tool in pins, f"{tool} has no pin in constraints.txt"


def test_ruff_settings_report_import_order_and_undefined_names():
    pytest.importorskip("ruff")
    source = "import sys\nimport os\n\nprint(os.sep, sys.argv, undefined_name)\n"
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"),
         "--output-format", "concise", "--stdin-filename", "lenskit/example.py", "-"],
        input=source, capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "I001" in proc.stdout and "F821" in proc.stdout, proc.stdout


def test_mypy_settings_report_a_moved_name_and_a_wrong_call(tmp_path):
    """mypy with the project's settings on a package of two small modules: the codes the settings keep on must fire
    here (a few seconds: the package imports nothing)."""
    pytest.importorskip("mypy")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    pkg = tmp_path / "lenskit"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f(x: int) -> int:\n    return x\n")
    (pkg / "b.py").write_text(
        "def g():\n"  # an unannotated body: checked too (check_untyped_defs)
        "    from lenskit.a import moved_away\n"
        "    from lenskit.a import f\n"
        "    return f(1, 2), moved_away\n"
    )
    (tmp_path / "lenses").mkdir()
    (tmp_path / "lenses" / "__init__.py").write_text("")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert 'Module "lenskit.a" has no attribute "moved_away"  [attr-defined]' in proc.stdout, proc.stdout
    assert '[call-arg]' in proc.stdout, proc.stdout
