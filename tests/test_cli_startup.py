"""`lenskit` starts fast: listing the commands imports no subcommand module, and a command imports only
what it uses (no plotly or kaleido without a figure to write)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lenses.cli import COMMANDS, SUMMARY, build_parser

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "pandas", "transformers", "plotly", "kaleido")

# Runs lenses.cli.main in a fresh interpreter, then reports which heavy packages got imported.
PROBE = """
import json, sys
from lenses.cli import main
rc = main(sys.argv[1:])
print("\\n" + json.dumps({"rc": rc, "loaded": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def probe(*argv: str, cwd: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_help_lists_every_command_without_importing_them(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = ("import sys\nfrom lenses.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            f"print('LOADED', [m for m in {HEAVY!r} if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert "LOADED []" in done.stdout, done.stdout[-500:] + done.stderr[-2000:]
    for name in COMMANDS:
        assert name in done.stdout and SUMMARY[name].split()[0] in done.stdout


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_module_uses_the_summary_line(name):
    """The stub `lenskit --help` shows and the full parser's help are one and the same line."""
    parser = build_parser(name)
    sub = next(a for a in parser._actions if getattr(a, "choices", None) and name in a.choices)
    helps = {c.dest: c.help for c in sub._choices_actions}
    assert helps[name] == SUMMARY[name]


def test_info_and_text_lens_import_no_plotting(tmp_path, default_model_path):
    info = probe("info", cwd=tmp_path)
    assert info["rc"] == 0 and not {"plotly", "kaleido"} & set(info["loaded"]), info
    lens = probe("lens", "import os", cwd=tmp_path)
    assert lens["rc"] == 0 and not {"plotly", "kaleido"} & set(lens["loaded"]), lens
    assert "torch" in lens["loaded"]  # the probe does see imports


def test_version_is_the_installed_distributions_and_imports_nothing_heavy(tmp_path):
    from importlib import metadata

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = ("import sys\nfrom lenses.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
            f"print('LOADED', [m for m in {HEAVY!r} if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.stdout.splitlines()[0] == f"lenskit {metadata.version('lenskit-interp')}", done.stdout + done.stderr[-2000:]
    assert "LOADED []" in done.stdout, done.stdout[-500:]
