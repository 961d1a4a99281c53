"""Measure where this machine's Chromium stops drawing static figures, to check lenses.plots.export's bounds.

    python benchmarks/figure_limits.py [--sides 4096 8192 16384 16385 20000] [--format png]

For each side length (in output pixels: width = height = side / scale, at scale 2 as the CLI's default PNG), it
asks kaleido for the figure and reports what came back: the byte count, whether it starts with the format's
signature and, for PNG, the pixel size written in the IHDR chunk. lenskit refuses any side above MAX_FIGURE_PX
(8,192 px before scale) before starting the browser; this script goes around that check to see the browser's
own limit, which is what the bound must stay under.
"""

from __future__ import annotations

import argparse
import struct
import time

import plotly.graph_objects as go

from lenses.plots.export import MAX_CANVAS_PX, MAX_FIGURE_PX, SIGNATURES


def png_size(data: bytes) -> tuple[int, int] | None:
    if not data.startswith(SIGNATURES["png"]) or len(data) < 24:
        return None
    return struct.unpack(">II", data[16:24])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sides", type=int, nargs="+", default=[4096, 8192, 16384, 16386, 20000, 32768])
    ap.add_argument("--scale", type=float, default=2.0)
    ap.add_argument("--format", default="png", choices=["png", "pdf"])
    args = ap.parse_args()
    import kaleido

    fig = go.Figure(go.Heatmap(z=[[0, 1], [1, 0]]))
    print(f"lenskit's bounds: MAX_FIGURE_PX={MAX_FIGURE_PX} (before scale), MAX_CANVAS_PX={MAX_CANVAS_PX}")
    print(f"{'side px':>8} {'layout px':>9} {'seconds':>7} {'bytes':>10}  result")
    for side in args.sides:
        layout = round(side / args.scale)
        start = time.perf_counter()
        try:
            data = kaleido.calc_fig_sync(fig, opts=dict(format=args.format, width=layout, height=layout,
                                                        scale=args.scale))
            error = ""
        except Exception as e:  # noqa: BLE001  (what the browser does at each size is the measurement)
            data, error = b"", f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
        took = time.perf_counter() - start
        if error:
            result = error
        elif args.format == "png":
            size = png_size(data)
            result = f"PNG {size[0]}x{size[1]}" if size else f"not a PNG (starts {data[:8]!r})"
        else:
            result = "PDF" if data.startswith(SIGNATURES["pdf"]) else f"not a PDF (starts {data[:8]!r})"
        print(f"{side:>8} {layout:>9} {took:>7.1f} {len(data):>10,}  {result}", flush=True)


if __name__ == "__main__":
    main()
