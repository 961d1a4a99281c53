"""The README and the docs pages work as written: their images and links exist, their commands name real scripts
and subcommands, the README's commands run, and the Python of the README and of the pages in RUN_PYTHON runs.

Fenced blocks are read from the markdown. ```python blocks of a page run in order in one namespace, as a reader
would paste them; a block fenced as ```python no-run (```{.python .no-run} in docs/, which mkdocs renders) is
shown only. Shell blocks (```bash / ```sh / ```console) are split into commands: `python3 some/script.py` and
`bash some/script.sh` must name files in the repository, and every `lenskit ...` command of the README runs
through `bash -c` (so bash expands `$'...'`), in a scratch folder that holds real copies of the repository paths
it names. The README is a first visit; what it held before moved to docs/ pages, checked here as strongly.
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

from lenses.cli import COMMANDS  # `lenskit --version` and `lenskit --help` are the only commands without one

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
TEXT = README.read_text(encoding="utf-8")
# Every page a reader sees: the README and the docs site's sources.
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
# The pages whose Python runs as written, each in its own namespace (the others show calls on data or devices a
# test does not have: runs/tuned, a GPU, a hub model).
RUN_PYTHON = [README, DOCS / "index.md", DOCS / "python.md", DOCS / "saes.md", DOCS / "howto/transformer_lens.md"]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.S | re.M)


def page_id(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def info_words(info: str) -> list[str]:
    """The words of a fence's info string: `python no-run`, or the attribute form `{.python .no-run}`."""
    return [w.lstrip(".") for w in info.strip().strip("{}").split()]


def blocks(*languages: str, text: str = TEXT) -> list[tuple[str, str]]:
    """(info string, body) of the fenced blocks of `text` whose language is one of `languages`."""
    return [(info.strip(), body) for info, body in FENCE.findall(text) if info_words(info)[:1] and info_words(info)[0] in languages]


def joined_lines(body: str) -> list[str]:
    """The lines of a shell block, a line ending in a backslash joined to the next, as bash reads them."""
    return re.sub(r"\\\n", " ", body).splitlines()


def shell_commands(text: str = TEXT) -> list[list[str]]:
    """Every command of the shell blocks, split on &&, ||, ; and |, comments and prompts removed."""
    out = []
    for _, body in blocks("bash", "sh", "shell", "console", text=text):
        for line in joined_lines(body):
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


def image_links(text: str = TEXT) -> list[str]:
    markdown = re.findall(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)
    html = re.findall(r"<img\s[^>]*src=[\"']([^\"']+)[\"']", text, re.I)
    return markdown + html


def page_links(text: str) -> list[str]:
    """The targets of the markdown links of `text` outside fenced blocks and code spans, images included."""
    prose = re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))
    return re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose)


def slug(heading: str) -> str:
    """A heading's anchor as python-markdown's toc (mkdocs) and the code host spell it, for the headings used here."""
    words = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[\s]+", "-", words)


def anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", FENCE.sub("", page.read_text(encoding="utf-8")), flags=re.M)
    return {slug(h) for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_image_a_page_links_exists(page):
    missing = [link for link in image_links(page.read_text(encoding="utf-8"))
               if not link.startswith(("http://", "https://", "data:")) and not (page.parent / link.split("#")[0]).is_file()]
    assert not missing, f"{page_id(page)} links images that are not in the repository: {missing}; run experiments/make_figures.sh"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_link_of_a_page_resolves_with_its_anchor(page):
    """Relative links name files that exist, and a `#fragment` names a heading of its page (mkdocs --strict
    checks the files of docs/ but only reports anchors; the README is not part of the site)."""
    broken = []
    for link in page_links(page.read_text(encoding="utf-8")):
        if link.startswith(("http://", "https://", "mailto:", "data:")):
            continue
        path, _, fragment = link.partition("#")
        target = (page.parent / path) if path else page
        if not target.exists():
            broken.append(link)
        elif fragment and target.suffix == ".md" and fragment not in anchors(target):
            broken.append(link)
    assert not broken, f"{page_id(page)} has links that do not resolve: {broken}"


def test_the_readme_links_to_the_docs_and_every_page_that_holds_what_it_held():
    linked = {(ROOT / link.partition("#")[0]).resolve() for link in page_links(TEXT) if not link.startswith("http")}
    moved = ["gallery.md", "python.md", "saes.md", "families.md", "performance.md", "reliability.md",
             "howto/cli.md", "howto/transformer_lens.md", "howto/training.md", "howto/gpus.md", "index.md",
             "architecture.md"]
    assert [m for m in moved if (DOCS / m).resolve() not in linked] == []


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_commands_name_existing_scripts_and_subcommands(page):
    commands = shell_commands(page.read_text(encoding="utf-8"))
    if page == README:
        assert commands, "README.md has no shell commands; its setup section should show how to install and run"
    for cmd in commands:
        if cmd[0] in ("python", "python3") and len(cmd) > 1 and not cmd[1].startswith("-"):
            assert (ROOT / cmd[1]).is_file(), f"{page_id(page)} runs {cmd[1]}, which does not exist"
        if cmd[0] in ("bash", "sh") and len(cmd) > 1:
            assert (ROOT / cmd[1]).is_file(), f"{page_id(page)} runs {cmd[1]}, which does not exist"
        if cmd[0] == "lenskit":
            assert len(cmd) > 1 and (cmd[1] in COMMANDS or cmd[1:] in (["--version"], ["--help"])), f"{page_id(page)} uses `lenskit {' '.join(cmd[1:2])}`; commands: {sorted(COMMANDS)}"


def lenskit_segments(text: str = TEXT) -> list[str]:
    """The raw text of every `lenskit ...` command in the shell blocks, as bash would read it (quotes intact),
    cut at the first `&&`, `||`, `;` or `|` outside quotes."""
    out = []
    for _, body in blocks("bash", "sh", "shell", "console", text=text):
        for line in joined_lines(body):
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


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_lenskit_prompts_reach_the_cli_as_bash_expands_them(page, tmp_path):
    segments = lenskit_segments(page.read_text(encoding="utf-8"))
    if page == README:
        assert segments, "README.md shows no lenskit command"
    for segment in segments:
        done = bash(segment, tmp_path, define='python3 -c "import json, sys; print(json.dumps(sys.argv[1:]))" "$@"')
        argv = json.loads(done.stdout)
        assert argv[0] in COMMANDS or argv in (["--version"], ["--help"]), argv
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
@pytest.mark.parametrize("page", RUN_PYTHON, ids=page_id)
def test_python_blocks_run(page, in_scratch_copy, default_model_path):
    code = [body for info, body in blocks("python", "py", text=page.read_text(encoding="utf-8"))
            if "no-run" not in info_words(info)]
    assert code, f"{page_id(page)} has no Python to run; take it out of RUN_PYTHON"
    namespace: dict = {"__name__": "__readme__"}
    for i, body in enumerate(code):
        try:
            exec(compile(body, f"{page_id(page)} python block {i + 1}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{page_id(page)} python block {i + 1} raised {type(e).__name__}: {e}\n{body}") from e


def families_table(page: Path) -> list[list[str]]:
    """The body rows of the table under the page's "Model families" heading, as stripped cells."""
    section = re.split(r"^(#{1,2}) Model families\n", page.read_text(encoding="utf-8"), flags=re.M)
    assert len(section) == 3, f"{page_id(page)} needs one 'Model families' section with the families table"
    body = re.split(r"^#{1,%d} " % len(section[1]), section[2], flags=re.M)[0]
    rows = [line.strip() for line in body.splitlines() if line.strip().startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]  # past the header and |---|


@pytest.mark.parametrize("page", [README, DOCS / "families.md"], ids=page_id)
def test_families_table_is_the_registry(page):
    from lenskit.families import FAMILIES

    rows = families_table(page)
    listed = [row[0].strip("`") for row in rows]
    assert listed == list(FAMILIES), (
        f"{page_id(page)}'s Model families table lists {listed}, the registry (lenskit/families/__init__.py) "
        f"{list(FAMILIES)}: add, remove or reorder the table's rows to match")
    for row in rows:
        family = FAMILIES[row[0].strip("`")]
        assert row[1] == family.models, f"{page_id(page)}'s {family.model_type} row names models {row[1]!r}, the registry {family.models!r}"
        assert f"`{family.hf_class}`" in row[-1], f"{page_id(page)}'s {family.model_type} row should claim parity with `{family.hf_class}`"


def test_ci_runs_the_readme_test_command():
    """The README's whole-suite command (its first pytest line) is the one `.ci/run` runs, word for word."""
    suite = [" ".join(cmd) for cmd in shell_commands() if cmd[:3] == ["python3", "-m", "pytest"]]
    assert suite, "README.md shows no `python3 -m pytest` command"
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    assert suite[0] in ci, f"README's test command {suite[0]!r} is not a line of .ci/run"
