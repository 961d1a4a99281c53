"""`lenskit info`: the printed counts and the CSV agree with the real model, and bad input fails clearly."""

from __future__ import annotations

import pandas as pd
import pytest

import lenskit
from lenses.cli import main


def test_info_on_the_gpt2_preset_prints_the_chapters_numbers(capsys):
    assert main(["info", "--model", "gpt2", "--tokens", "1e9"]) == 0
    out = capsys.readouterr().out
    assert "124,439,808" in out  # total, by hand: 50257*768 + 1024*768 + 12*(12*768^2 + 13*768) + 2*768
    assert "85,056,000" in out  # non-embedding
    assert "7,087,872" in out  # per block: 12 d^2 + 13 d
    assert "66.6%" in out  # MLP share of a block
    assert "22.2% of 2N (N non-embedding)" in out  # attention core at 1,024 tokens
    assert f"{6 * 85_056_000 * 1e9:.3g}" in out  # 6ND


def test_info_on_a_model_folder_matches_its_weights(tmp_path, model, capsys):
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    csv = tmp_path / "params.csv"
    assert main(["info", "--model", str(folder), "--n-ctx", "32", "--csv", str(csv)]) == 0
    out = capsys.readouterr().out
    total = sum(p.numel() for p in lenskit.HookedTransformer.from_pretrained(folder).parameters())
    assert f"{total:,}" in out and "n_ctx=32" in out
    table = pd.read_csv(csv)
    assert table.params.sum() == total
    assert set(table.component) == {"embed", "pos_embed", "attn", "mlp", "norms", "ln_final", "unembed"}


def test_info_errors_say_what_to_do(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["info", "--model", str(tmp_path / "empty")]) == 2
    assert "has no config.json" in capsys.readouterr().err


def test_info_defaults_to_the_embedded_model(default_model, capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"{sum(p.numel() for p in default_model.parameters()):,}" in out
    assert f"n_layers={default_model.cfg.n_layers} d_model={default_model.cfg.d_model}" in out


def test_info_help_lists_every_registered_family_and_preset(capsys, monkeypatch):
    from lenskit.families import FAMILIES

    monkeypatch.setenv("COLUMNS", "100000")  # one line: argparse would otherwise wrap inside names at hyphens
    with pytest.raises(SystemExit):
        main(["info", "--help"])
    text = capsys.readouterr().out
    for model_type, family in FAMILIES.items():
        assert f"{model_type}: {', '.join(family.presets)}" in text, f"`lenskit info --help` omits {model_type}'s presets"


@pytest.mark.parametrize("name", sorted(lenskit.PRESETS))
def test_info_runs_on_every_preset(name, capsys):
    assert main(["info", "--model", name]) == 0
    assert f"family={lenskit.PRESETS[name].family} " in capsys.readouterr().out
