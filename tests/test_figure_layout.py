"""Lens figures at paper sizes: laid out by plotly.js in a headless Chromium (tests/figure_layout.py), no two texts
overlap and none leaves the figure, over column and page widths, with and without a title, one to four lenses
stacked, 8 to 200 positions; long prompts show their last positions and say so; token labels never wrap."""

from __future__ import annotations

import itertools

import pytest
import torch
from figure_layout import browser, problems, text_boxes

import lenskit
from lenses import LogitLens, plots
from lenses.trajectory import Trajectory
from lenskit.io.data import stdlib_root

pytestmark = pytest.mark.skipif(browser() is None, reason="needs chromium (scripts/install.sh installs it)")

MATRIX = list(itertools.product(["column", "page"], [None, "Logit lens on textwrap.py"], [1, 2, 3, 4], [8, 40, 200]))


@pytest.fixture(scope="module")
def frame():
    model = lenskit.HookedTransformer.from_pretrained("stdlib-gpt2")
    ids = model.to_tokens((stdlib_root() / "textwrap.py").read_text(encoding="utf-8")[:4000])[:, :200]
    assert ids.shape[1] == 200
    with torch.no_grad():
        return Trajectory.from_prompt(LogitLens(model), ids).to_frame()


def figure(frame, size, title, n_lenses, n_positions, color="prob"):
    part = frame[frame["position"] < n_positions]
    if n_lenses == 1:
        return plots.logit_lens_heatmap(part, color, size=size, title=title)
    return plots.lens_stack({f"lens {i}": part for i in range(n_lenses)}, color, size=size, title=title)


@pytest.mark.slow
def test_no_text_overlaps_or_leaves_the_figure_at_paper_sizes(frame):
    figures = [figure(frame, *case, color=("prob", "kl", "entropy")[i % 3]) for i, case in enumerate(MATRIX)]
    laid_out = text_boxes(figures)
    assert len(laid_out) == len(MATRIX)
    failures = {case: problems(layout) for case, layout in zip(MATRIX, laid_out) if problems(layout)}
    assert not failures, "\n".join(f"{case}: {len(p)} problems, e.g. {p[:2]}" for case, p in failures.items())
    for case, layout in zip(MATRIX, laid_out):
        texts = [box[0] for box in layout["boxes"]]
        assert "layer" in texts and any(t.startswith("input token") for t in texts), (case, texts[:20])
        if case[1]:
            assert case[1] in texts, case


def test_long_prompts_show_the_last_positions_that_fit_and_say_so(frame):
    for size in ("column", "page", None):
        fig = plots.logit_lens_heatmap(frame, size=size)
        shown = list(fig.layout.xaxis.tickvals)
        caption = fig.layout.xaxis.title.text
        assert shown == list(range(200 - len(shown), 200)) and len(shown) < 200, size
        assert caption == f"input token (last {len(shown)} of 200 positions)", caption
        assert all(label for label in fig.layout.xaxis.ticktext), "a shown position has no token label"
    # A window the caller chose is drawn as asked, with no caption.
    fig = plots.logit_lens_heatmap(frame, size="column", last=100)
    assert len(fig.layout.xaxis.tickvals) == 100 and fig.layout.xaxis.title.text == "input token"


def test_token_labels_never_wrap_inside_a_token():
    labels, font = plots.style.token_labels(["····return", "self", "\n", "x"], cell_px=30, font=14, max_chars=6)
    assert not any("<br>" in label for label in labels)
    assert labels == ["····…", "self", "\\n", "x"] and font == 8.0  # 5 characters of 8 px fit 30 px
