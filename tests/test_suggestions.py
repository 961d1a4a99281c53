""""Did you mean" for model short names, presets, hook names and CLI choices; hints name only things that exist."""

from __future__ import annotations

import pytest
import torch

import lenskit
from lenses.cli import main
from lenskit.suggest import closest_hook_names, did_you_mean


@pytest.fixture
def offline_empty_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)


def test_did_you_mean_is_closest_first_and_empty_when_nothing_is_close():
    assert did_you_mean("pythia-70", ["gpt2", "pythia-70m", "pythia-160m"]) == "; did you mean 'pythia-70m', 'pythia-160m'?"
    assert did_you_mean("zzz", ["gpt2", "pythia-70m"]) == ""


def test_a_misspelt_embedded_model_is_refused_before_any_hub_lookup(offline_empty_hub, monkeypatch):
    import lenskit.io.hub as hub

    monkeypatch.setattr(hub, "_from_hub", lambda name: pytest.fail(f"{name} went to the hub"))
    with pytest.raises(FileNotFoundError, match=r"no model named 'stdlib-gtp2'; did you mean 'stdlib-gpt2'"):
        lenskit.HookedTransformer.from_pretrained("stdlib-gtp2")


def test_a_bare_unknown_name_gets_close_names_and_no_download_of_a_repository_that_does_not_exist(offline_empty_hub):
    with pytest.raises(OSError) as e:
        lenskit.HookedTransformer.from_pretrained("gpt2-mediun")
    assert "did you mean 'gpt2-medium'" in str(e.value) and "hf download" not in str(e.value)


def test_transformerlens_gpt2_small_points_at_the_repository_that_exists(offline_empty_hub):
    with pytest.raises(OSError) as e:
        lenskit.HookedTransformer.from_pretrained("gpt2-small")
    message = str(e.value)
    assert "`hf download openai-community/gpt2`" in message and "gpt2-small`" not in message
    assert "TransformerLens's name" in message


def test_a_misspelt_preset_gets_did_you_mean():
    with pytest.raises(KeyError, match=r"no preset named 'pythia-70'; did you mean 'pythia-70m'"):
        lenskit.ModelConfig.from_name("pythia-70")


def test_the_hook_name_error_lists_this_models_names_closest_first(model):
    tokens = torch.tensor([[1, 2, 3]])
    with pytest.raises(KeyError) as e:
        model.run_with_cache(tokens, names_filter="resid_pst.1")
    assert "did you mean 'blocks.1.hook_resid_post'" in str(e.value)
    named = str(e.value).split("did you mean ")[1]
    assert all(f"'{n}'" in named for n in closest_hook_names("resid_pst.1", model.hook_dict))
    assert "expert" not in named and "per_layer" not in named  # names of other families never appear
    _, cache = model.run_with_cache(tokens)
    with pytest.raises(KeyError) as e:
        cache["mlp_ot", -1]
    assert str(e.value).startswith(f"\"unknown short hook name 'mlp_ot'; did you mean 'blocks.{model.cfg.n_layers - 1}.hook_mlp_out'")
    assert "expert" not in str(e.value)


def test_closest_hook_names_prefers_the_named_block_and_the_spelling():
    names = [f"blocks.{i}.{h}" for i in range(4) for h in ("hook_resid_pre", "hook_resid_post", "attn.hook_q")]
    assert closest_hook_names("blocks.2.hook_resid_pots", names)[0] == "blocks.2.hook_resid_post"
    assert closest_hook_names("resid_pst3", names)[:2] == ["blocks.3.hook_resid_post", "blocks.3.hook_resid_pre"]
    assert closest_hook_names("nothing_alike", names) == []


def test_cli_choices_and_commands_say_did_you_mean(capsys):
    with pytest.raises(SystemExit):
        main(["lnes", "x"])
    assert "invalid choice: 'lnes'; did you mean 'lens'?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["lens", "x", "--size", "colum"])
    assert "invalid choice: 'colum'; did you mean 'column'?" in capsys.readouterr().err
