"""Static export starts one browser per process, reuses it for every figure, and leaves no browser behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import plotly.graph_objects as go
import pytest

from lenses.plots import export, save_figure

ROOT = Path(__file__).resolve().parents[1]


def descendants(pid: int) -> set[int]:
    """Every process below `pid`, read from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


@pytest.mark.slow
def test_every_static_export_of_a_process_reuses_one_browser(tmp_path, monkeypatch):
    started = []

    class Counted(export._Browser):
        def __init__(self):
            started.append(1)
            super().__init__()

    export.stop_export_browser()
    monkeypatch.setattr(export, "_Browser", Counted)
    try:
        for i, suffix in enumerate((".png", ".svg", ".pdf", ".png")):
            save_figure(go.Figure(go.Heatmap(z=[[i, 1], [2, 3]])), tmp_path / f"f{i}{suffix}", width=300, height=200)
    finally:
        export.stop_export_browser()
    assert len(started) == 1
    assert (tmp_path / "f0.png").read_bytes().startswith(b"\x89PNG") and (tmp_path / "f2.pdf").read_bytes().startswith(b"%PDF-")
    assert b"<svg" in (tmp_path / "f1.svg").read_bytes()
    assert (tmp_path / "f0.png").read_bytes() != (tmp_path / "f3.png").read_bytes()  # each figure drawn, not a cached one


def test_a_browser_that_failed_a_render_is_replaced(tmp_path, monkeypatch):
    """A render that fails closes that browser and tries once more on a fresh one (on a loaded machine a new tab can
    miss kaleido's scripts); a second failure is raised, and no file is written."""
    made = []
    fails = {"first": 1, "always": 10**9}

    class Failing:
        pid = os.getpid()
        mode = "first"

        def __init__(self):
            made.append(self)
            self.closed = False

        def render(self, fig, opts):
            if len(made) <= fails[Failing.mode]:
                raise RuntimeError("the tab crashed")
            return b"\x89PNG\r\n\x1a\n" + b"\0" * 8

        def close(self):
            self.closed = True

    export.stop_export_browser()
    monkeypatch.setattr(export, "_Browser", Failing)
    try:
        save_figure(go.Figure(), tmp_path / "a.png")  # the first browser fails, the second draws it
        assert len(made) == 2 and made[0].closed and not made[1].closed and (tmp_path / "a.png").exists()
        export.stop_export_browser()
        made.clear()
        Failing.mode = "always"
        with pytest.raises(RuntimeError, match="the tab crashed"):
            save_figure(go.Figure(), tmp_path / "b.png")
    finally:
        export.stop_export_browser()
    assert len(made) == 2 and all(b.closed for b in made) and not (tmp_path / "b.png").exists()


@pytest.mark.slow
def test_the_browser_is_gone_when_the_process_exits(tmp_path):
    code = ("import os, sys\nimport plotly.graph_objects as go\nfrom lenses.plots import save_figure\n"
            "sys.path.insert(0, sys.argv[1]); from test_export_browser import descendants\n"
            "for i in range(2): save_figure(go.Figure(go.Bar(y=[1, i])), f'{sys.argv[2]}/x{i}.png', width=200, height=150)\n"
            "print(' '.join(map(str, sorted(descendants(os.getpid())))))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code, str(ROOT / "tests"), str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    browser = [int(p) for p in done.stdout.split()]
    assert browser, "no browser process was running after the exports"
    assert [p for p in browser if running(p)] == [], "browser processes were left after exit"


def running(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie waiting for its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
