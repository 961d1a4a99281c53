"""Laid-out text boxes of plotly figures, measured in a headless Chromium: every figure drawn by plotly.js in one
page (one browser start for all), each text element's box read with getBoundingClientRect, the page's DOM dumped.

`text_boxes(figures)` -> for each figure, its size and [(text, class, x0, y0, x1, y1)] in px from its top left.
`problems(layout)` -> the overlaps of two texts and the texts outside the figure, as lines to print."""

from __future__ import annotations

import html
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import plotly.graph_objects as go

BROWSER_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
                 "--disable-component-update", "--disable-sync"]
PAGE = """<!doctype html><html><head><meta charset="utf-8"><script>{plotly}</script>
<style>body {{ margin: 0 }} .fig {{ position: relative }}</style></head><body><pre id="out">pending</pre>
<script>
const FIGS = {figures};
(async () => {{
  const out = [];
  for (const fig of FIGS) {{
    const div = document.createElement("div"); div.className = "fig"; document.body.appendChild(div);
    await Plotly.newPlot(div, fig.data, fig.layout, {{staticPlot: true}});
    const root = div.querySelector(".main-svg").getBoundingClientRect();
    const boxes = [];
    for (const t of div.querySelectorAll("text")) {{
      const r = t.getBoundingClientRect();
      const style = getComputedStyle(t);
      if (!t.textContent.trim() || r.width === 0 || style.display === "none" || style.visibility === "hidden"
          || Number(style.opacity) === 0 || t.closest("[style*='opacity: 0']")) continue;
      boxes.push([t.textContent, t.getAttribute("class") || "", r.left - root.left, r.top - root.top,
                  r.right - root.left, r.bottom - root.top]);
    }}
    out.push({{width: root.width, height: root.height, boxes}});
    div.remove();
  }}
  document.getElementById("out").textContent = JSON.stringify(out);
}})().catch(e => {{ document.getElementById("out").textContent = "ERROR " + e; }});
</script></body></html>"""


def browser() -> str | None:
    return os.environ.get("BROWSER_PATH") or shutil.which("chromium") or shutil.which("chromium-browser")


def text_boxes(figures: list[go.Figure]) -> list[dict]:
    from plotly.offline import get_plotlyjs

    specs = [json.loads(fig.to_json()) for fig in figures]
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "figures.html"
        page.write_text(PAGE.format(plotly=get_plotlyjs(), figures=json.dumps(specs).replace("</", "<\\/")), encoding="utf-8")
        done = subprocess.run([browser(), *BROWSER_FLAGS, f"--user-data-dir={tmp}/profile", "--virtual-time-budget=120000",
                               "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=600)
    dom = done.stdout
    start = dom.find('<pre id="out">')
    if start < 0:
        raise RuntimeError(f"chromium printed no page (rc {done.returncode}): {done.stderr[-500:]}")
    data = html.unescape(dom[start + len('<pre id="out">'): dom.find("</pre>", start)])
    if not data.startswith("["):
        raise RuntimeError(f"the page did not finish: {data[:300]}")
    return json.loads(data)


def problems(layout: dict, slack: float = 1.0) -> list[str]:
    """Two texts whose boxes overlap by more than `slack` px both ways, and texts that leave the figure."""
    found = []
    boxes = layout["boxes"]
    for text, cls, x0, y0, x1, y1 in boxes:
        if x0 < -slack or y0 < -slack or x1 > layout["width"] + slack or y1 > layout["height"] + slack:
            found.append(f"outside the {layout['width']:.0f}x{layout['height']:.0f} figure: {text!r} ({cls}) at "
                         f"[{x0:.0f}, {y0:.0f}, {x1:.0f}, {y1:.0f}]")
    for i, (a, acls, ax0, ay0, ax1, ay1) in enumerate(boxes):
        for b, bcls, bx0, by0, bx1, by1 in boxes[i + 1:]:
            if min(ax1, bx1) - max(ax0, bx0) > slack and min(ay1, by1) - max(ay0, by0) > slack:
                found.append(f"overlap: {a!r} ({acls}) [{ax0:.0f}, {ay0:.0f}, {ax1:.0f}, {ay1:.0f}] and {b!r} ({bcls}) "
                             f"[{bx0:.0f}, {by0:.0f}, {bx1:.0f}, {by1:.0f}]")
    return found
