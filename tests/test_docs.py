"""The docs site's sources agree with the code: mkdocs.yml names pages that exist, the architecture page lists every
module, and every public name of lenskit, lenses and lenskit.transformer_lens has a docstring for the API reference.
(`mkdocs build --strict` itself runs in .ci/run.)"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def test_every_page_the_nav_names_exists():
    nav = re.findall(r":\s*([\w./-]+\.(?:md|ipynb))\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    assert len(nav) >= 15
    missing = [page for page in nav if not (DOCS / page).exists()]
    assert missing == [], missing
    notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert sorted(Path(p).name for p in nav if p.endswith(".ipynb")) == notebooks  # every notebook is rendered


def test_the_architecture_page_lists_every_module():
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    modules = [p.relative_to(ROOT).as_posix() for package in ("lenskit", "lenses") for p in sorted((ROOT / package).rglob("*.py"))]
    missing = [m for m in modules if f"`{m}`" not in text]
    assert missing == [], f"docs/architecture.md's 'Every module' table lacks {missing}"


@pytest.mark.parametrize("module", ["lenskit", "lenses", "lenskit.transformer_lens"])
def test_every_public_name_has_a_docstring(module):
    mod = importlib.import_module(module)
    undocumented = [name for name in mod.__all__ if callable(getattr(mod, name)) and not (getattr(mod, name).__doc__ or "").strip()]
    assert undocumented == [], f"{module}: {undocumented} have no docstring for the API reference"
