"""A lens folder's config.json read back (issue 29): a malformed "eval" section is refused on load, by file
and key, for the tuned and the Jacobian lens; the card treats an unreadable table as not evaluated; a lens for
another model is refused with the remedy of its own kind."""

from __future__ import annotations

import json

import pytest
import torch
from lens_fixtures import write_tiny_model

import lenskit
from lenses import JacobianLens, TunedLens
from lenses.card import eval_problem, model_card

GOOD_ROW = {"layer": 0, "kl_logit": 1.5, "kl_tuned": 0.5, "ce_logit": 3.0, "ce_tuned": 2.5}
GOOD = {"n_tokens": 64, "data_sha256": "ab" * 32, "table": [GOOD_ROW]}
BAD = {
    "not an object": [1, 2],
    "table not a list": {**GOOD, "table": {"layer": 0}},
    "row not an object": {**GOOD, "table": [3]},
    "layer a string": {**GOOD, "table": [{**GOOD_ROW, "layer": "0"}]},
    "layer a float": {**GOOD, "table": [{**GOOD_ROW, "layer": 1.0}]},
    "no layer": {**GOOD, "table": [{"kl_logit": 1.0}]},
    "a NaN": {**GOOD, "table": [{**GOOD_ROW, "kl_tuned": float("nan")}]},
    "a string number": {**GOOD, "table": [{**GOOD_ROW, "ce_tuned": "2.5"}]},
    "n_tokens negative": {**GOOD, "n_tokens": -1},
    "n_tokens a string": {**GOOD, "n_tokens": "64"},
    "sha a number": {**GOOD, "data_sha256": 5},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("configs")
    return [lenskit.HookedTransformer.from_pretrained(write_tiny_model(root / f"m{seed}", seed=seed)) for seed in (0, 1)]


def make(kind: str, model):
    d = model.cfg.d_model
    return TunedLens(model) if kind == "tuned" else JacobianLens(model, {0: torch.eye(d), 2: torch.eye(d)})


def with_eval(folder, ev) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eval": ev}))


@pytest.mark.parametrize("kind", ["tuned", "jacobian"])
@pytest.mark.parametrize("case", list(BAD))
def test_a_malformed_eval_section_is_refused_on_load(models, tmp_path, kind, case):
    model = models[0]
    folder = make(kind, model).save(tmp_path / "lens")
    with_eval(folder, BAD[case])
    with pytest.raises(ValueError) as e:
        type(make(kind, model)).load(folder, model)
    message = str(e.value)
    assert str(folder / "config.json") in message and "'eval'" in message and "\n" not in message, message


@pytest.mark.parametrize("kind", ["tuned", "jacobian"])
def test_a_well_formed_eval_section_loads_and_saves_again(models, tmp_path, kind):
    model = models[0]
    folder = make(kind, model).save(tmp_path / "lens")
    with_eval(folder, GOOD)
    lens = type(make(kind, model)).load(folder, model)
    lens.save(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["eval"] == GOOD


@pytest.mark.parametrize("case", list(BAD))
def test_the_card_reads_a_malformed_table_as_not_evaluated(case):
    assert eval_problem(BAD[case]) is not None
    card = model_card({"eval": BAD[case], "model_name": "m"})
    assert "Not evaluated yet" in card


def test_the_card_shows_a_good_table():
    assert eval_problem(GOOD) is None
    assert "| 0 | 1.5000 |" in model_card({"eval": GOOD, "model_name": "m"})


@pytest.mark.parametrize("kind,remedy,wrong", [("tuned", "lenskit train-lens", "JacobianLens.fit"),
                                               ("jacobian", "JacobianLens.fit", "train-lens")])
def test_a_lens_for_another_model_is_refused_with_its_own_remedy(models, tmp_path, kind, remedy, wrong):
    folder = make(kind, models[0]).save(tmp_path / "lens")
    with pytest.raises(ValueError, match="trained for another model") as e:
        type(make(kind, models[0])).load(folder, models[1])
    assert remedy in str(e.value) and wrong not in str(e.value), e.value
