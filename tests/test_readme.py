"""The README works as written: its images exist, its commands name real scripts and run, its Python runs.

Fenced blocks are read from README.md. ```python blocks run in order in one namespace, as a reader
would paste them; a block fenced as ```python no-run is shown only. Shell blocks (```bash / ```sh /
```console) are split into commands: `python3 some/script.py` and `bash some/script.sh` must name
files in the repository, and every `lenskit ...` command runs through `bash -c` (so bash expands `$'...'`),
in a scratch folder that holds real copies of the repository paths it names.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from lenses.cli import COMMANDS

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
    commands = shell_commands()
    assert commands, "README.md has no shell commands; its setup section should show how to install and run"
    for cmd in commands:
        if cmd[0] in ("python", "python3") and len(cmd) > 1 and not cmd[1].startswith("-"):
            assert (ROOT / cmd[1]).is_file(), f"README runs {cmd[1]}, which does not exist"
        if cmd[0] in ("bash", "sh") and len(cmd) > 1:
            assert (ROOT / cmd[1]).is_file(), f"README runs {cmd[1]}, which does not exist"
        if cmd[0] == "lenskit":
            assert len(cmd) > 1 and cmd[1] in COMMANDS, f"README uses `lenskit {' '.join(cmd[1:2])}`; commands: {sorted(COMMANDS)}"


def lenskit_segments() -> list[str]:
    """The raw text of every `lenskit ...` command in the shell blocks, as bash would read it (quotes intact),
    cut at the first `&&`, `||`, `;` or `|` outside quotes."""
    out = []
    for _, body in blocks("bash", "sh", "shell", "console"):
        for line in body.splitlines():
            line = re.sub(r"^\s*\$\s+", "", line)
            for match in re.finditer(r"(?:^|&&|\|\||;|\|)\s*(lenskit\s)", line):
                out.append(_until_operator(line[match.start(1):]))
    return out


def _until_operator(text: str) -> str:
    i, quote = 0, None
    while i < len(text):
        c = text[i]
        if quote is None:
            if c == "#" and (i == 0 or text[i - 1].isspace()):
                break
            if c in "&|;":
                break
            if c == "\\":
                i += 1
            elif text.startswith("$'", i):
                quote, i = "$'", i + 1
            elif c in "'\"":
                quote = c
        elif quote == "'" and c == "'":
            quote = None
        elif quote in ("$'", '"') and c == "\\":
            i += 1  # an escaped character, e.g. \' inside $'...'
        elif c == quote[-1]:
            quote = None
        i += 1
    return text[:i].strip()


def bash(command: str, cwd: Path, define: str = 'python3 -m lenses.cli "$@"') -> subprocess.CompletedProcess:
    """Run `command` with bash, `lenskit` being this checkout's CLI (so `$'...'` reaches it as bash expands it)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(["bash", "-c", f"lenskit() {{ {define}; }}\n{command}"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


LENSKIT_SEGMENTS = lenskit_segments()


def test_readme_lenskit_prompts_reach_the_cli_as_bash_expands_them(tmp_path):
    assert LENSKIT_SEGMENTS, "README.md shows no lenskit command"
    for segment in LENSKIT_SEGMENTS:
        done = bash(segment, tmp_path, define='python3 -c "import json, sys; print(json.dumps(sys.argv[1:]))" "$@"')
        argv = json.loads(done.stdout)
        assert argv[0] in COMMANDS, argv
        if "$'" in segment:  # ANSI-C quoting: the CLI sees real newlines, never the quoting itself
            assert any("\n" in a for a in argv) and not any(a.startswith("$") for a in argv), argv


def scratch_copy(tmp_path: Path, words: list[str]) -> Path:
    """A scratch working directory holding real copies of the repository paths that `words` name
    (so that relative paths resolve) and nothing linked back: whatever a command writes stays there."""
    for word in words:
        source = ROOT / word
        if word and not word.startswith(("-", "/")) and source.exists() and ROOT in source.resolve().parents:
            target = tmp_path / word
            target.parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir():
                shutil.copytree(source, target, dirs_exist_ok=True)
            else:
                shutil.copy2(source, target)
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("segment", LENSKIT_SEGMENTS, ids=[s[:60] for s in LENSKIT_SEGMENTS])
def test_readme_lenskit_commands_run(segment, tmp_path, default_model_path):
    scratch = scratch_copy(tmp_path, shlex.split(segment.replace("$'", "'")))
    done = bash(segment, scratch)
    assert done.returncode == 0, f"`{segment}` failed:\n{done.stderr[-3000:]}"
    words = shlex.split(segment.replace("$'", "'"))
    for flag in ("--out", "--csv"):
        if flag in words:
            written = scratch / words[words.index(flag) + 1]
            assert written.is_file() and written.stat().st_size > 0, f"`{segment}` did not write {written.name}"


@pytest.fixture
def in_scratch_copy(tmp_path, monkeypatch):
    """An empty scratch working directory, so that files a README block writes (lens.pdf) stay out of the checkout."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.slow
def test_readme_python_blocks_run(in_scratch_copy, default_model_path):
    code = [body for info, body in blocks("python", "py") if "no-run" not in info.split()]
    namespace: dict = {"__name__": "__readme__"}
    for i, body in enumerate(code):
        try:
            exec(compile(body, f"README.md python block {i + 1}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"README python block {i + 1} raised {type(e).__name__}: {e}\n{body}") from e


def families_table() -> list[list[str]]:
    """The body rows of the table under README's "## Model families", as stripped cells."""
    section = re.split(r"^## Model families\n", TEXT, flags=re.M)
    assert len(section) == 2, "README.md needs one '## Model families' section with the families table"
    body = re.split(r"^## ", section[1], flags=re.M)[0]
    rows = [line.strip() for line in body.splitlines() if line.strip().startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]  # past the header and |---|


def test_readme_families_table_is_the_registry():
    from lenskit.families import FAMILIES

    rows = families_table()
    listed = [row[0].strip("`") for row in rows]
    assert listed == list(FAMILIES), (
        f"README's Model families table lists {listed}, the registry (lenskit/families/__init__.py) {list(FAMILIES)}: "
        "add, remove or reorder the table's rows to match")
    for row in rows:
        family = FAMILIES[row[0].strip("`")]
        assert row[1] == family.models, f"README's {family.model_type} row names models {row[1]!r}, the registry {family.models!r}"
        assert f"`{family.hf_class}`" in row[-1], f"README's {family.model_type} row should claim parity with `{family.hf_class}`"
