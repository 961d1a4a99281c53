"""Every notebook in notebooks/ runs top to bottom without an error (executed with nbclient, not saved)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "expected notebooks/*.ipynb"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    assert any(c.cell_type == "code" for c in nb.cells), f"{path.name} has no code cells"
    # Run in notebooks/, as Jupyter would; a cell that raises fails the test with its traceback.
    client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    stderr = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                     if o.get("name") == "stderr")
    assert "IProgress" not in stderr, f"{path.name}: a progress bar needs ipywidgets: {stderr[:300]}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebooks_use_the_public_api_only(path):
    """Notebooks teach the library, so they import no command-line internals (lenses.cli)."""
    code = "".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
    assert "lenses.cli" not in code and "from lenses import cli" not in code
