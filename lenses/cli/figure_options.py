"""The figure options that `lenskit lens` and `lenskit ablate` share: window, size and title of the heatmap."""

from __future__ import annotations

import argparse

SIZE_CHOICES = ("column", "page")


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


def add_figure_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("figure (with --out)")
    window = g.add_mutually_exclusive_group()
    window.add_argument("--positions", type=_span, metavar="A:B", help="draw positions A to B-1 only (Python slice bounds, e.g. 10:50 or -40:)")
    window.add_argument("--last", type=_positive, metavar="N", help="draw the last N positions only")
    g.add_argument("--layers", type=_layers, metavar="LIST", help="draw these layers only: 0,3,6 or 2:5 (0 = the embeddings)")
    g.add_argument("--size", choices=SIZE_CHOICES, default=None,
                   help="a paper's single column (3.3 in wide) or full text width (7 in), exported at 300 dpi; "
                        "fonts scale with the size (default: room for every token, at most 1100 px wide)")
    g.add_argument("--width", type=_positive, metavar="PX", help="figure width in px (96 px = 1 inch); overrides --size")
    g.add_argument("--height", type=_positive, metavar="PX", help="figure height in px; overrides --size")
    g.add_argument("--title", default=None, help="figure title (also the PDF's title); default names the lens or the ablation")


def figure_kwargs(args: argparse.Namespace) -> dict:
    """The heatmap keywords that the options above set."""
    return dict(positions=args.positions, last=args.last, layers=args.layers, size=args.size,
                width=args.width, height=args.height)
