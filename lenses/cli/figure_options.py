"""The figure options that `lenskit lens` and `lenskit ablate` share: window, size and title of the heatmap."""

from __future__ import annotations

import argparse
from pathlib import Path

SIZE_CHOICES = ("column", "page")
FIGURE_SUFFIXES = (".html", ".png", ".svg", ".pdf")  # what plots.save_figure writes
MAX_FIGURE_PX = 8192  # lenses.plots.export.MAX_FIGURE_PX, kept here so that --help imports no plotly


def _span(text: str) -> slice:
    """'A:B', 'A:' or ':B' (Python slice bounds, negatives count from the end) -> slice."""
    start, colon, stop = text.partition(":")
    try:
        if not colon:
            raise ValueError
        return slice(int(start) if start.strip() else None, int(stop) if stop.strip() else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:STOP such as 10:50 or -40: (Python slice bounds), got {text!r}") from None


def _layers(text: str) -> list[int]:
    """'0,3,6' or '2:5' (2, 3, 4) or a mix, '0,4:7' -> sorted layer numbers."""
    chosen: set[int] = set()
    try:
        for part in text.split(","):
            if ":" in part:
                start, _, stop = part.partition(":")
                chosen.update(range(int(start), int(stop)))
            else:
                chosen.add(int(part))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer numbers such as 0,3,6 or a range 2:5, got {text!r}") from None
    if not chosen:
        raise argparse.ArgumentTypeError(f"--layers {text!r} names no layer")
    return sorted(chosen)


def _positive(text: str) -> int:
    try:
        value = int(text)
        if value < 1:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}") from None
    return value


def _figure_px(text: str) -> int:
    value = _positive(text)
    if value > MAX_FIGURE_PX:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_FIGURE_PX} px (Chrome's canvas limit at PNG scale 2), "
                                         f"got {value}")
    return value


def check_figure_output(path: str | None, what: str = "the --out figure") -> None:
    """Before any work: `path` names a format save_figure writes, can take a file, and, for .png/.svg/.pdf,
    the browser that draws it starts (so a missing Chrome is an error now, not after the computation)."""
    if path is None:
        return
    from lenskit.io.files import check_output_file

    if Path(path).suffix.lower() not in FIGURE_SUFFIXES:
        raise ValueError(f"cannot tell the format of {what} {path!r}: expected a file name ending in {', '.join(FIGURE_SUFFIXES)}")
    check_output_file(path, what)
    if Path(path).suffix.lower() != ".html":
        from lenses.plots.export import FigureExportError, check_static_export

        try:
            check_static_export(quiet=True)
        except FigureExportError as e:
            raise FigureExportError(f"{what} {path} cannot be written: {e}") from None


def add_figure_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("figure (with --out)")
    window = g.add_mutually_exclusive_group()
    window.add_argument("--positions", type=_span, metavar="A:B", help="draw positions A to B-1 only (Python slice bounds, e.g. 10:50 or -40:)")
    window.add_argument("--last", type=_positive, metavar="N", help="draw the last N positions only")
    g.add_argument("--layers", type=_layers, metavar="LIST", help="draw these layers only: 0,3,6 or 2:5 (0 = the embeddings)")
    g.add_argument("--size", choices=SIZE_CHOICES, default=None,
                   help="a paper's single column (3.3 in wide) or full text width (7 in), exported at 300 dpi; "
                        "fonts scale with the size (default: room for every token, at most 1100 px wide)")
    g.add_argument("--width", type=_figure_px, metavar="PX",
                   help=f"figure width in px (96 px = 1 inch, at most {MAX_FIGURE_PX}); overrides --size")
    g.add_argument("--height", type=_figure_px, metavar="PX", help=f"figure height in px (at most {MAX_FIGURE_PX}); overrides --size")
    g.add_argument("--title", default=None, help="figure title (also the PDF's title); default names the lens or the ablation")


def figure_kwargs(args: argparse.Namespace) -> dict:
    """The heatmap keywords that the options above set."""
    return dict(positions=args.positions, last=args.last, layers=args.layers, size=args.size,
                width=args.width, height=args.height)

