"""The README works as written: its images exist, its commands name real scripts and run, its Python runs.

Fenced blocks are read from README.md. ```python blocks run in order in one namespace, as a reader
would paste them; a block fenced as ```python no-run is shown only. Shell blocks (```bash / ```sh /
```console) are split into commands: `python3 some/script.py` and `bash some/script.sh` must name
files in the repository, and every `lenskit ...` command is run through `lenses.cli.main`.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TEXT = README.read_text(encoding="utf-8")
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.S | re.M)


def blocks(*languages: str) -> list[tuple[str, str]]:
    """(info string, body) of the fenced blocks whose language is one of `languages`."""
    return [(info.strip(), body) for info, body in FENCE.findall(TEXT) if info.strip().split(" ")[0] in languages]


def shell_commands() -> list[list[str]]:
    """Every command of the shell blocks, split on &&, ||, ; and |, comments and prompts removed."""
    out = []
    for _, body in blocks("bash", "sh", "shell", "console"):
        for line in body.splitlines():
            line = re.sub(r"^\s*\$\s+", "", line)
            lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lex.whitespace_split, lex.commenters = True, "#"
            command: list[str] = []
            for token in [*lex, ";"]:
                if token in (";", "&&", "||", "|", "&"):
                    if command:
                        out.append(command)
                    command = []
                else:
                    command.append(token)
    return out


def image_links() -> list[str]:
    markdown = re.findall(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", TEXT)
    html = re.findall(r"<img\s[^>]*src=[\"']([^\"']+)[\"']", TEXT, re.I)
    return markdown + html


def test_every_image_the_readme_links_exists():
    missing = [link for link in image_links()
               if not link.startswith(("http://", "https://", "data:")) and not (ROOT / link.split("#")[0]).is_file()]
    assert not missing, f"README links images that are not in the repository: {missing}; run experiments/make_figures.sh"


def test_readme_commands_name_existing_scripts_and_subcommands():
    from lenses.cli import COMMANDS

    commands = shell_commands()
    assert commands, "README.md has no shell commands; its setup section should show how to install and run"
    for cmd in commands:
        if cmd[0] in ("python", "python3") and len(cmd) > 1 and not cmd[1].startswith("-"):
            assert (ROOT / cmd[1]).is_file(), f"README runs {cmd[1]}, which does not exist"
        if cmd[0] in ("bash", "sh") and len(cmd) > 1:
            assert (ROOT / cmd[1]).is_file(), f"README runs {cmd[1]}, which does not exist"
        if cmd[0] == "lenskit":
            assert len(cmd) > 1 and cmd[1] in COMMANDS, f"README uses `lenskit {' '.join(cmd[1:2])}`; commands: {sorted(COMMANDS)}"


@pytest.fixture
def in_scratch_copy(tmp_path, monkeypatch):
    """A scratch working directory that sees the repository's files (relative paths resolve) and keeps
    whatever a README command writes at its top level (lens.png, x.csv) out of the repository."""
    for entry in ROOT.iterdir():
        if not entry.name.startswith(".") and not (tmp_path / entry.name).exists():
            (tmp_path / entry.name).symlink_to(entry)
    monkeypatch.chdir(tmp_path)
    return tmp_path


LENSKIT_COMMANDS = [c for c in shell_commands() if c[0] == "lenskit"]


@pytest.mark.slow
@pytest.mark.parametrize("command", LENSKIT_COMMANDS, ids=[" ".join(c)[:60] for c in LENSKIT_COMMANDS])
def test_readme_lenskit_commands_run(command, in_scratch_copy, default_model_path):
    from lenses.cli import main

    assert main(command[1:]) == 0, f"`{shlex.join(command)}` failed"


@pytest.mark.slow
def test_readme_python_blocks_run(in_scratch_copy, default_model_path):
    code = [body for info, body in blocks("python", "py") if "no-run" not in info.split()]
    namespace: dict = {"__name__": "__readme__"}
    for i, body in enumerate(code):
        try:
            exec(compile(body, f"README.md python block {i + 1}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"README python block {i + 1} raised {type(e).__name__}: {e}\n{body}") from e
