"""The interactive view (lenses.view): a self-contained HTML file, loaded in a real headless Chromium: its DOM holds
the lens cells, token labels, hover text and one canvas per head after the script ran, and a screenshot has the
window's size and is not blank."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
from figure_layout import BROWSER_FLAGS, browser

import lenskit
from lenses import LogitLens
from lenses.cli import main
from lenses.view import View

PROMPT = "def add(a, b):\\n    return a + b\\n"


@pytest.fixture(scope="module")
def model():
    return lenskit.HookedTransformer.from_pretrained("stdlib-gpt2")


def run_browser(page: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "profile"
    shutil.rmtree(profile, ignore_errors=True)
    return subprocess.run([browser(), *BROWSER_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=10000", *args,
                           page.as_uri()], capture_output=True, text=True, timeout=300)


def png_size_and_colours(data: bytes) -> tuple[int, int, int]:
    """(width, height, distinct byte values in the pixel data) of a PNG, read from its chunks."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    idat, at = b"", 8
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        if kind == b"IDAT":
            idat += data[at + 8:at + 8 + length]
        at += 12 + length
    return width, height, len(set(zlib.decompress(idat)))


def test_the_view_holds_its_data_and_needs_no_network(model, tmp_path):
    view = View.from_prompt(model, PROMPT.replace("\\n", "\n"), lenses={"logit": LogitLens(model)}, top_k=3)
    page = view.to_html()
    assert not re.search(r"(src|href)=[\"']?(https?:)?//", page), "the view loads something from the network"
    cells = re.findall(r'<td class="cell" data-layer="(\d+)" data-pos="(\d+)"', page)
    n_pos = view.frames["logit"]["position"].nunique()
    assert len(cells) == (model.cfg.n_layers + 1) * n_pos
    assert "1. " in page and "3. " in page and "4. " not in page  # the hover text holds the top 3
    assert len(view.attention["patterns"]) == model.cfg.n_layers
    assert len(view.attention["patterns"][0]) == model.cfg.n_heads and len(view.attention["tokens"]) == n_pos
    html_frame = view._repr_html_()
    assert html_frame.startswith("<iframe srcdoc=") and "&lt;script" in html_frame
    with pytest.raises(ValueError, match="ending in .html"):
        view.save(tmp_path / "view.png")


@pytest.mark.skipif(browser() is None, reason="needs chromium (scripts/install.sh installs it)")
@pytest.mark.slow
def test_lens_html_view_in_a_headless_browser(model, tmp_path, capsys):
    page = tmp_path / "view.html"
    assert main(["lens", PROMPT.replace("\\n", "\n"), "--html", str(page), "--top-k", "4"]) == 0
    assert f"wrote {page}" in capsys.readouterr().out

    dom = run_browser(page, tmp_path, "--dump-dom").stdout
    n_pos = len(re.findall(r'<th class="input">', dom))
    assert n_pos > 5
    assert len(re.findall(r'<td class="cell"', dom)) == (model.cfg.n_layers + 1) * n_pos
    assert re.search(r'<th class="input">·return</th>', dom), "the input token labels are missing"
    hovers = re.findall(r'title="(layer \d+, position \d+, input [^"]*)"', dom)
    assert len(hovers) == (model.cfg.n_layers + 1) * n_pos
    assert all(re.search(r"\n1\. .*\n2\. .*\n3\. .*\n4\. ", h) for h in hovers), hovers[0]  # the top 4 of every cell
    # After the script ran: a canvas per head, and the first head's pattern as a labelled table.
    assert len(re.findall(r"<canvas ", dom)) == model.cfg.n_layers * model.cfg.n_heads
    assert len(re.findall(r'<td class="att"', dom)) == n_pos * n_pos
    assert len(re.findall(r'<th class="row query">', dom)) == n_pos

    shot = tmp_path / "view.png"
    run_browser(page, tmp_path, "--window-size=1000,700", f"--screenshot={shot}")
    width, height, colours = png_size_and_colours(shot.read_bytes())
    assert (width, height) == (1000, 700)
    assert colours > 50, "the screenshot is blank"
