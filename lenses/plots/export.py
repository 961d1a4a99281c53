"""Writing figures: self-contained HTML, and PNG/SVG/PDF through kaleido and a headless Chromium."""

from __future__ import annotations

import atexit
import html
import os
import re
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterator, Sequence

import plotly.graph_objects as go

STATIC_FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}
EXPORT_TIMEOUT_S = 600
# Chrome draws a figure on one canvas of at most 16,384 px a side (268 million px in all); past that it
# returns a few bytes of junk. 8,192 px a side at the default PNG scale of 2 is that limit exactly (measured on
# Debian's Chromium 156 by benchmarks/figure_limits.py: 16,384 px draws, 16,386 px is junk; results.md).
MAX_FIGURE_PX = 8192  # also lenses.cli.figure_options.MAX_FIGURE_PX (--help states it)
MAX_CANVAS_PX = 16384
# What a file of each format starts with (an SVG is XML text whose root element is <svg>).
SIGNATURES = {"png": b"\x89PNG\r\n\x1a\n", "pdf": b"%PDF-"}


class FigureExportError(RuntimeError, OSError):
    """A figure that could not be drawn or written (no browser, a size past the limit, junk from the
    browser). An OSError too, so the CLI reports it as one line and a non-zero exit."""


def save_figure(fig: go.Figure, path: str | os.PathLike, *, width: int | None = None, height: int | None = None,
                scale: float | None = None, plotlyjs: str = "inline") -> Path:
    """Write `fig` by the path's suffix: .html, .png, .svg, .pdf.

    HTML: `plotlyjs="inline"` (default) embeds plotly.js, so the file opens offline and weighs about 5 MB;
    `"cdn"` loads plotly.js from cdn.plot.ly instead (a few kB per figure, but needs the network to open).

    Static formats are drawn by kaleido 1.x in a headless Chrome/Chromium (Debian's `chromium` package,
    which scripts/install.sh installs; set BROWSER_PATH to use another). MathJax is switched off, so
    nothing is fetched from the network. PNGs default to scale 2, or to 300 dpi for figures sized with a
    preset (`size="column"` / `"page"`). A PDF's title (its metadata, shown by viewers) is the figure's title.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".html", *STATIC_FORMATS):
        raise ValueError(f"cannot tell the format of {str(path)!r}: expected a name ending in .html, .png, .svg or .pdf")
    path.parent.mkdir(parents=True, exist_ok=True)
    if plotlyjs not in ("inline", "cdn"):
        raise ValueError(f"plotlyjs={plotlyjs!r}: expected 'inline' (opens offline) or 'cdn' (small, needs the network)")
    if suffix == ".html":
        fig.write_html(path, include_plotlyjs=True if plotlyjs == "inline" else "cdn", full_html=True,
                       config={"displaylogo": False})
        return path
    data = _render_static(fig, STATIC_FORMATS[suffix], width, height, scale)
    check_rendered(data, STATIC_FORMATS[suffix], path)
    if suffix == ".pdf":
        data = set_pdf_title(data, figure_title(fig))
    path.write_bytes(data)
    return path


def figure_title(fig: go.Figure) -> str:
    """The figure's title as plain text (tags such as <br> become spaces), or 'figure' when it has none."""
    text = fig.layout.title.text if fig.layout.title and fig.layout.title.text else ""
    text = " ".join(html.unescape(re.sub(r"<[^>]+>", " ", text)).split())
    return text or "figure"


def set_pdf_title(pdf: bytes, title: str) -> bytes:
    """`pdf` with its document title set to `title`, by an incremental update: a new info dictionary and a
    cross-reference section for it are appended, and nothing before them changes (PDF 1.7, section 7.5.6).
    Chrome names every PDF it prints after the page, which for kaleido is "Kaleido-fier"."""
    trailer = pdf[pdf.rfind(b"trailer"):]
    root = re.search(rb"/Root\s+(\d+\s+\d+\s+R)", trailer)
    size = re.search(rb"/Size\s+(\d+)", trailer)
    info = re.search(rb"/Info\s+(\d+)\s+(\d+)\s+R", trailer)
    startxref = re.search(rb"startxref\s+(\d+)\s+%%EOF\s*$", pdf)
    if not (root and size and startxref and pdf.startswith(b"%PDF-")):
        return pdf  # not the classic layout Chrome writes: leave the file as it is
    number, generation = (int(info.group(1)), int(info.group(2))) if info else (int(size.group(1)), 0)
    total = max(int(size.group(1)), number + 1)
    encoded = "\ufeff".encode("utf-16-be") + title.encode("utf-16-be")  # a text string with a byte-order mark
    body = pdf if pdf.endswith(b"\n") else pdf + b"\n"
    offset = len(body)
    obj = (f"{number} {generation} obj\n<</Title <{encoded.hex().upper()}>\n/Creator (lenskit, plotly, kaleido)>>\n"
           f"endobj\n").encode("ascii")
    xref_at = offset + len(obj)
    xref = (f"xref\n0 1\n0000000000 65535 f \n{number} 1\n{offset:010d} {generation:05d} n \n"
            f"trailer\n<</Size {total}\n/Root {root.group(1).decode()}\n/Info {number} {generation} R\n"
            f"/Prev {int(startxref.group(1))}>>\nstartxref\n{xref_at}\n%%EOF\n").encode("ascii")
    return body + obj + xref


class _Browser:
    """The process's one headless Chrome (a kaleido.Kaleido), started by the first static export and reused by every
    later one; it runs on an event loop in a daemon thread of its own, and is closed at exit (atexit) or by
    `stop_export_browser()`. Renders are one at a time (a lock), as the one tab is."""

    def __init__(self) -> None:
        import asyncio
        import threading

        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="lenskit-figure-export", daemon=True)
        self.thread.start()
        try:
            self.kaleido = self._call(self._open())
        except BaseException:
            self._stop_loop()
            raise

    async def _open(self):
        import kaleido

        # mathjax=False: kaleido otherwise loads MathJax from a CDN, which hangs or fails offline.
        # timeout: seconds per image; kaleido's default of 90 is too short on a busy 2-core CI machine.
        k = kaleido.Kaleido(mathjax=False, timeout=EXPORT_TIMEOUT_S)
        await k.open()
        return k

    def _call(self, coroutine):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def render(self, fig: dict, opts: dict) -> bytes:
        with self.lock:
            return self._call(self.kaleido.calc_fig(fig, opts=opts))

    def close(self) -> None:
        with self.lock:
            try:
                self._call(self.kaleido.close())
            finally:
                self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


_browser: _Browser | None = None


def _export_browser() -> _Browser:
    """The process's browser, started now if it is not running (nor inherited from a parent process by a fork)."""
    global _browser
    if _browser is None or _browser.pid != os.getpid():
        from kaleido.errors import ChromeNotFoundError

        try:
            _browser = _Browser()
        except ChromeNotFoundError:
            raise FigureExportError(_no_chrome_message("static export")) from None
        atexit.register(stop_export_browser)
    return _browser


def stop_export_browser() -> None:
    """Close the browser that static exports share (the next export starts another); also run at exit."""
    global _browser
    browser, _browser = _browser, None
    if browser is not None and browser.pid == os.getpid():
        browser.close()


@contextmanager
def export_session() -> Iterator[None]:
    """Start the shared browser now, so that the block's first export does not pay for it. Every static export of a
    process reuses one browser, in a block or not; it stays open until exit or `stop_export_browser()`.

    >>> with export_session():
    ...     for suffix in (".png", ".svg", ".pdf"):
    ...         save_figure(fig, "figures/lens" + suffix)
    PosixPath('figures/lens.png')
    PosixPath('figures/lens.svg')
    PosixPath('figures/lens.pdf')
    """
    _export_browser()
    yield


def _no_chrome_message(what: str) -> str:
    hint = f" (BROWSER_PATH={os.environ['BROWSER_PATH']!r} is set; is it an executable Chrome?)" if "BROWSER_PATH" in os.environ else ""
    return (f"{what} needs Chrome or Chromium, and none was found{hint}. Install one (`apt-get install chromium`, "
            "as scripts/install.sh does) or point BROWSER_PATH at it; or save as .html, which needs no browser.")


def check_static_export(quiet: bool = False) -> None:
    """Render a one-point figure to PNG; raise FigureExportError saying what is missing if that fails.
    Commands that will write a PNG, SVG or PDF call it before their work, with `quiet=True`."""
    png = _render_static(go.Figure(go.Scatter(x=[0], y=[0])), "png", 100, 100, 1)
    if png[:8] != SIGNATURES["png"]:
        raise FigureExportError(f"static export returned {len(png)} bytes that are not a PNG; is BROWSER_PATH a working Chrome?")
    if not quiet:
        print("static figure export works (kaleido + headless Chrome)")


def check_figure_size(width: float, height: float, scale: float, what: str = "the figure") -> None:
    """Refuse a size Chrome cannot draw: at most MAX_FIGURE_PX a side, and at most MAX_CANVAS_PX a side once
    scaled (a PNG is drawn at `scale` device pixels per px)."""
    for name, px in (("width", width), ("height", height)):
        if not 0 < px <= MAX_FIGURE_PX or not 0 < px * scale <= MAX_CANVAS_PX:
            raise FigureExportError(f"{what}: {name} {px:g} px at scale {scale:g} is past the limit; expected at most "
                                    f"{MAX_FIGURE_PX} px a side and {MAX_CANVAS_PX} px once scaled (Chrome's canvas): "
                                    "pass a smaller --width/--height")


def check_rendered(data: bytes, fmt: str, path: str | os.PathLike) -> None:
    """Refuse what the browser returned unless it is a file of `fmt`: the PNG signature, %PDF-, an <svg> root."""
    if fmt == "svg":
        import xml.etree.ElementTree as ET

        try:
            ok = ET.fromstring(data).tag.rpartition("}")[2] == "svg"
        except ET.ParseError:
            ok = False
    else:
        ok = data.startswith(SIGNATURES[fmt])
    if not ok:
        raise FigureExportError(f"{path} was not written: the browser returned {len(data)} bytes that are not "
                                f"{fmt.upper()}; expected a {fmt.upper()} file (try a smaller figure, or .html)")


def _render_static(fig: go.Figure, fmt: str, width: int | None, height: int | None, scale: float | None) -> bytes:
    layout = fig.layout
    meta = layout.meta if isinstance(layout.meta, dict) else {}
    opts = dict(format=fmt, width=width or layout.width or 900, height=height or layout.height or 500,
                scale=scale or (meta.get("export_scale", 2) if fmt == "png" else 1))
    check_figure_size(opts["width"], opts["height"], opts["scale"] if fmt == "png" else 1)
    for attempt in (1, 2):
        browser = _export_browser()
        try:
            return browser.render(fig.to_dict(), opts)
        except Exception:
            stop_export_browser()  # a browser that failed once is not trusted with the next figure: the next one starts anew
            if attempt == 2:  # once more on a fresh browser: on a loaded machine its page can miss kaleido's scripts
                raise
    raise AssertionError("unreachable")


def save_figures(figures: dict[str, go.Figure], folder: str | os.PathLike, formats: str | Sequence[str]) -> list[Path]:
    """Write each figure as `folder/<name>.<fmt>` for every format, starting the browser once for all of them.

    >>> save_figures({"lens": fig}, "docs/figures", "png,svg")   # or formats=["png", "pdf"]
    [PosixPath('docs/figures/lens.png'), PosixPath('docs/figures/lens.svg')]
    """
    fmts = [f.strip().lstrip(".") for f in (formats.split(",") if isinstance(formats, str) else formats) if f.strip()]
    folder = Path(folder)
    with export_session() if any("." + f in STATIC_FORMATS for f in fmts) else nullcontext():
        return [save_figure(fig, folder / f"{name}.{fmt}") for name, fig in figures.items() for fmt in fmts]
