"""The embedded models' short names, `stdlib-gpt2` and `stdlib-llama`, everywhere a model is taken, and their
precedence over a folder of the same spelling."""

from __future__ import annotations

from pathlib import Path

import pytest

import lenskit
from lenses.cli import main
from lenskit.io.loading import resolve_model_folder


def test_short_names_resolve_to_the_shipped_folders():
    assert resolve_model_folder("stdlib-gpt2") == Path(lenskit.DEFAULT_MODEL).resolve()
    assert lenskit.EMBEDDED_MODELS["stdlib-gpt2"] == str(Path(lenskit.DEFAULT_MODEL).resolve())
    assert set(lenskit.EMBEDDED_MODELS) == {"stdlib-gpt2", "stdlib-llama"}
    model = lenskit.HookedTransformer.from_pretrained("stdlib-gpt2")
    assert model.cfg.family == "gpt2" and model.tokenizer is not None


def test_a_short_name_wins_over_a_folder_of_that_name_and_says_so(tmp_path, monkeypatch):
    (tmp_path / "stdlib-gpt2").mkdir()  # an empty folder of the same spelling in the working directory
    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning, match=r"names lenskit's embedded model.*pass ./stdlib-gpt2 to load it"):
        assert resolve_model_folder("stdlib-gpt2") == Path(lenskit.DEFAULT_MODEL).resolve()
    # spelled as a path, the folder is what loads (here: an empty folder, refused for what it lacks)
    with pytest.raises(FileNotFoundError, match="config.json"):
        lenskit.HookedTransformer.from_pretrained("./stdlib-gpt2")


def test_info_lists_both_and_reads_each(capsys):
    with pytest.raises(SystemExit):
        main(["info", "--help"])
    out = capsys.readouterr().out
    assert "stdlib-gpt2" in out and "stdlib-llama" in out
    assert main(["info", "--model", "stdlib-gpt2"]) == 0
    assert "3,505,152" in capsys.readouterr().out


def test_the_llama_sibling_runs_under_its_short_name(tmp_path, capsys):
    model = lenskit.HookedTransformer.from_pretrained("stdlib-llama")
    assert model.cfg.family == "llama" and model.cfg.n_kv_heads == 2
    csv = tmp_path / "lens.csv"
    assert main(["lens", "def __init__(self, name):\n    self.name =", "--model", "stdlib-llama", "--csv", str(csv)]) == 0
    assert csv.stat().st_size > 0
    assert main(["info", "--model", "stdlib-llama"]) == 0
    assert "llama" in capsys.readouterr().out
