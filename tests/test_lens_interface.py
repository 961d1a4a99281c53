"""Any lens through evaluation and trajectories: streams a lens does not cover, the side-by-side table, lens specs."""

from __future__ import annotations

import pytest
import torch

from lenses import LogitLens, TunedLens
from lenses.evaluation import evaluate_windows, per_layer, prediction_depth, side_by_side
from lenses.spec import load_lens, load_lenses, split_spec
from lenses.trajectory import NO_TOKEN, Trajectory


class NoEmbeddings(LogitLens):
    """The logit lens, except that it does not decode stream 0 (as a Jacobian lens from a reference file)."""

    name = "partial"

    def covers(self, s):
        return s.layer != 0

    def transform_hidden(self, h, s):
        if s.layer == 0:
            raise AssertionError("an uncovered stream must never be decoded")
        return h


@pytest.fixture
def windows():
    return torch.randint(0, 101, (6, 10), generator=torch.Generator().manual_seed(3))


def test_uncovered_streams_are_nan_and_the_rest_unchanged(model, windows):
    tidy = evaluate_windows(model, {"logit": LogitLens(model), "partial": NoEmbeddings(model)}, windows, progress=False)
    logit, partial = (tidy[tidy["lens"] == n].set_index(["layer", "window"]) for n in ("logit", "partial"))
    metrics = ["kl", "ce", "entropy", "top1_agree", "settled"]
    assert partial.loc[0, metrics].isna().all().all()
    rest = partial.index.get_level_values("layer") > 0
    assert (partial[rest][metrics].to_numpy() == logit[rest][metrics].to_numpy()).all()
    # Prediction depth counts stream 0 as unsettled for the partial lens: 1 layer more wherever the logit lens
    # had settled at 0.
    depth = prediction_depth(tidy)
    settled_at_0 = logit.loc[0, "settled"].mean()
    assert depth["partial"] == pytest.approx(depth["logit"] + settled_at_0, abs=1e-12)


def test_trajectory_leaves_uncovered_streams_empty(model):
    tokens = torch.tensor([[5, 9, 13, 2, 40, 7]])
    full = Trajectory.from_prompt(LogitLens(model), tokens)
    part = Trajectory.from_prompt(NoEmbeddings(model), tokens)
    assert (part.top_ids[0] == NO_TOKEN).all() and part.entropy[0].isnan().all() and part.kl_to_final[0].isnan().all()
    assert torch.equal(part.top_ids[1:], full.top_ids[1:]) and torch.equal(part.kl_to_final[1:], full.kl_to_final[1:])
    frame = part.to_frame()
    assert (frame[frame["layer"] == 0]["top_token"] == "").all()
    assert (frame[frame["layer"] > 0]["top_token"] != "").any()


def test_side_by_side_means_intervals_and_depth(model, windows):
    tuned = TunedLens(model)
    with torch.no_grad():
        for p in tuned.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    tidy = evaluate_windows(model, {"logit": LogitLens(model), "tuned": tuned}, windows, progress=False)
    table = side_by_side(tidy, n_boot=300)
    assert list(table["lens"].unique()) == ["logit", "tuned"]
    assert len(table) == 2 * (model.cfg.n_layers + 1)
    wide = per_layer(tidy)
    for lens in ("logit", "tuned"):
        rows = table[table["lens"] == lens].sort_values("layer")
        for metric in ("kl", "ce", "entropy", "top1_agree", "settled"):
            assert rows[metric].to_numpy() == pytest.approx(wide[f"{metric}_{lens}"].to_numpy(), rel=1e-12, abs=1e-12)
            assert (rows[f"{metric}_lo"] <= rows[metric] + 1e-12).all() and (rows[metric] <= rows[f"{metric}_hi"] + 1e-12).all()
        assert rows["prediction_depth"].iloc[0] == pytest.approx(prediction_depth(tidy)[lens], rel=1e-12)
        lo, hi = rows["prediction_depth_lo"].iloc[0], rows["prediction_depth_hi"].iloc[0]
        assert lo <= rows["prediction_depth"].iloc[0] <= hi
    # At the last stream the logit lens is the model: KL exactly 0, agreement 1.
    last = table[(table["lens"] == "logit") & (table["layer"] == model.cfg.n_layers)]
    assert float(last["kl"].iloc[0]) == 0.0 and float(last["top1_agree"].iloc[0]) == 1.0
    # The intervals are over windows: wider than zero where windows differ.
    assert (table["kl_hi"] - table["kl_lo"]).max() > 0


def test_split_spec(tmp_path):
    assert split_spec("logit") == ("logit", "")
    assert split_spec("patchscope") == ("patchscope", "")
    assert split_spec("patchscope:a -> a\\n?") == ("patchscope", "a -> a\\n?")
    assert split_spec("jacobian:org/repo:sub/file.pt") == ("jacobian", "org/repo:sub/file.pt")
    assert split_spec("tuned:runs/x") == ("tuned", "runs/x")
    assert split_spec("runs/x") == ("", "runs/x")
    odd = tmp_path / "tuned:x"
    odd.mkdir()
    assert split_spec(str(odd)) == ("", str(odd))  # an existing path is a path, colon or not
    for bad, message in [("", "non-empty"), ("logit:x", "no argument"), ("tuned:", "say which lens"), ("jacobian:", "say which lens")]:
        with pytest.raises(ValueError, match=message):
            split_spec(bad)


def test_load_lens_folders_by_their_config(model, tmp_path):
    tuned = TunedLens(model)
    tuned.save(tmp_path / "t")
    assert isinstance(load_lens(str(tmp_path / "t"), model), TunedLens)
    assert isinstance(load_lens(f"tuned:{tmp_path / 't'}", model), TunedLens)
    assert isinstance(load_lens("logit", model), LogitLens)
    with pytest.raises(FileNotFoundError, match="no such folder or file, and not a lens kind"):
        load_lens(str(tmp_path / "missing"), model)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="a file; expected a lens folder"):
        load_lens(str(tmp_path / "notes.txt"), model)


def test_load_lenses_labels(model, tmp_path):
    TunedLens(model).save(tmp_path / "a")
    TunedLens(model).save(tmp_path / "b")
    assert list(load_lenses(["logit", str(tmp_path / "a")], model)) == ["logit", "tuned"]
    assert list(load_lenses([str(tmp_path / "a"), str(tmp_path / "b")], model)) == [str(tmp_path / "a"), str(tmp_path / "b")]
    with pytest.raises(ValueError, match="given twice"):
        load_lenses(["logit", "logit"], model)


def test_jacobian_spec_splits_a_hub_file(model, monkeypatch, tmp_path):
    from lenses import JacobianLens

    seen = []
    monkeypatch.setattr(JacobianLens, "load", classmethod(lambda cls, source, m, filename=None: seen.append((source, filename)) or "lens"))
    assert load_lens("jacobian:neuronpedia/jacobian-lens:gpt2-small/jlens/x.pt", model) == "lens"
    assert load_lens("jacobian:someone/folder-repo", model) == "lens"
    local = tmp_path / "a:b.pt"
    local.write_bytes(b"")
    assert load_lens(f"jacobian:{local}", model) == "lens"  # an existing path stays whole, colon and all
    assert seen == [("neuronpedia/jacobian-lens", "gpt2-small/jlens/x.pt"), ("someone/folder-repo", None), (str(local), None)]
