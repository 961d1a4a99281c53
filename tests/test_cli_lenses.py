"""Several lenses on the command line: `lenskit lens --lens A --lens B` and `lenskit eval-lens --lens ...`."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from lens_fixtures import write_text_folder, write_tiny_model

import lenskit
from lenses import LogitLens, Trajectory, TunedLens
from lenses.cli import main
from lenses.evaluation import evaluate_windows, side_by_side
from lenskit.io.data import load_token_stream

PROMPT = "def f(alpha, beta):\n    return alpha"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lenses_cli")
    write_tiny_model(root / "model")
    write_text_folder(root / "heldout", n=20, seed=1)
    model = lenskit.HookedTransformer.from_pretrained(root / "model")
    tuned = TunedLens(model)
    with torch.no_grad():  # a lens that differs from the logit lens, so a mix-up shows
        for p in tuned.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.1)
    tuned.save(root / "tuned")
    return root


def captured_figures(monkeypatch) -> list:
    from lenses import plots

    seen, save = [], plots.save_figure
    monkeypatch.setattr(plots, "save_figure", lambda fig, path, **kw: (seen.append(fig), save(fig, path, **kw))[1])
    return seen


def test_lens_draws_several_lenses_on_one_scale(files, tmp_path, monkeypatch, capsys):
    figures = captured_figures(monkeypatch)
    csv, out = tmp_path / "x.csv", tmp_path / "x.html"
    assert main(["lens", PROMPT, "--model", str(files / "model"), "--lens", "logit", "--lens", f"tuned:{files / 'tuned'}",
                 "--csv", str(csv), "--out", str(out), "--color", "kl"]) == 0
    printed = capsys.readouterr().out
    assert "logit lens" in printed and "tuned lens" in printed
    frame = pd.read_csv(csv, keep_default_na=False)
    assert frame["lens"].unique().tolist() == ["logit", "tuned"]
    model = lenskit.HookedTransformer.from_pretrained(files / "model")
    for name, lens in (("logit", LogitLens(model)), ("tuned", TunedLens.load(files / "tuned", model))):
        want = Trajectory.from_prompt(lens, PROMPT).to_frame()
        got = frame[frame["lens"] == name]
        assert got["top_token_id"].tolist() == want["top_token_id"].tolist()
        assert got["kl_to_final"].to_numpy() == pytest.approx(want["kl_to_final"].to_numpy(), abs=1e-6)
    (fig,) = figures
    heatmaps = [t for t in fig.data if t.type == "heatmap"]
    assert len(heatmaps) == 2
    assert heatmaps[0].zmin == heatmaps[1].zmin and heatmaps[0].zmax == heatmaps[1].zmax  # one colour scale
    assert [t.showscale for t in heatmaps] == [True, False]  # and one colour bar
    # The shared range covers both panels' values (the logit lens's KL is the larger at the embeddings).
    top = max(float(pd.Series(t.z.ravel() if hasattr(t.z, "ravel") else [v for row in t.z for v in row]).max()) for t in heatmaps)
    assert heatmaps[0].zmax >= top - 1e-9
    assert [a.text for a in fig.layout.annotations] == ["logit lens", "tuned lens"]


def test_eval_lens_side_by_side(files, tmp_path, monkeypatch, capsys):
    figures = captured_figures(monkeypatch)
    csv, table_csv, out = tmp_path / "wide.csv", tmp_path / "tidy.csv", tmp_path / "kl.html"
    assert main(["eval-lens", "--model", str(files / "model"), "--lens", str(files / "tuned"), "--data", str(files / "heldout"),
                 "--tokens", "320", "--ctx", "16", "--csv", str(csv), "--table", str(table_csv), "--out", str(out),
                 "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "prediction depth" in printed and "logit" in printed and "tuned" in printed
    wide = pd.read_csv(csv)
    assert {"layer", "kl_logit", "kl_tuned", "ce_logit", "ce_tuned"} <= set(wide.columns)  # the DESIGN.md contract
    tidy_table = pd.read_csv(table_csv)
    assert tidy_table["lens"].unique().tolist() == ["logit", "tuned"]  # the logit baseline comes first, unasked
    for col in ("kl", "kl_lo", "kl_hi", "ce", "entropy", "top1_agree", "prediction_depth", "prediction_depth_lo"):
        assert col in tidy_table.columns
    # The same numbers as the library computes on the same windows.
    model = lenskit.HookedTransformer.from_pretrained(files / "model")
    windows = load_token_stream([files / "heldout"], model.tokenizer).windows(16)[:20]
    want = side_by_side(evaluate_windows(model, {"logit": LogitLens(model), "tuned": TunedLens.load(files / "tuned", model)},
                                         windows, progress=False))
    assert tidy_table["kl"].to_numpy() == pytest.approx(want["kl"].to_numpy(), rel=1e-5)
    assert tidy_table["kl_hi"].to_numpy() == pytest.approx(want["kl_hi"].to_numpy(), rel=1e-5)
    (fig,) = figures
    assert sorted({t.name for t in fig.data if t.name}) == ["logit", "tuned"]


def test_eval_lens_refusals(files, tmp_path, capsys):
    base = ["eval-lens", "--model", str(files / "model"), "--data", str(files / "heldout"), "--quiet"]
    assert main([*base, "--lens", "logit", "--lens", "logit:x"]) == 2
    assert "takes no argument" in capsys.readouterr().err
    assert main([*base, "--lens", str(files / "tuned"), "--out", str(tmp_path / "x.jpg")]) == 2
    assert "ending in .html, .png, .svg, .pdf" in capsys.readouterr().err
    assert main([*base, "--lens", "logit", "--card"]) == 2
    assert "--card writes into one tuned-lens folder" in capsys.readouterr().err


def random_jacobian(model, seed=0):
    from lenses import JacobianLens

    g = torch.Generator().manual_seed(seed)
    d = model.cfg.d_model
    return JacobianLens(model, {s: torch.eye(d) + 0.1 * torch.randn(d, d, generator=g) for s in range(model.cfg.n_layers)})


def test_all_four_kinds_through_the_cli(files, tmp_path, capsys):
    """Jacobian folders and reference files, and patchscopes, by spec: the CLI's numbers are the library's."""
    from lenses import JacobianLens, Patchscope

    model = lenskit.HookedTransformer.from_pretrained(files / "model")
    jlens = random_jacobian(model)
    jlens.save(tmp_path / "jlens")
    jlens.save_reference(tmp_path / "jlens.pt", dtype=torch.float32)
    prompt = "alpha -> alpha\nbeta -> beta\n?"
    csv = tmp_path / "four.csv"
    specs = ["logit", str(files / "tuned"), str(tmp_path / "jlens"), f"patchscope:{prompt.replace(chr(10), chr(92) + 'n')}"]
    assert main(["lens", PROMPT, "--model", str(files / "model"), "--csv", str(csv), *(x for s in specs for x in ("--lens", s))]) == 0
    frame = pd.read_csv(csv, keep_default_na=False)
    assert frame["lens"].unique().tolist() == ["logit", "tuned", "jacobian", "patchscope"]
    references = {"jacobian": jlens, "patchscope": Patchscope(model, prompt)}
    for name, lens in references.items():
        want = Trajectory.from_prompt(lens, PROMPT).to_frame()
        got = frame[frame["lens"] == name]
        assert got["top_token_id"].tolist() == want["top_token_id"].tolist()
        assert got["kl_to_final"].to_numpy() == pytest.approx(want["kl_to_final"].to_numpy(), abs=1e-5)
    # The reference .pt has no place for stream 0: that row is empty, and the rest is the folder's lens.
    csv_pt = tmp_path / "pt.csv"
    assert main(["lens", PROMPT, "--model", str(files / "model"), "--csv", str(csv_pt), "--lens", f"jacobian:{tmp_path / 'jlens.pt'}"]) == 0
    from_pt = pd.read_csv(csv_pt, keep_default_na=False)
    assert (from_pt[from_pt["layer"] == 0]["top_token"] == "").all()
    folder_rows = frame[(frame["lens"] == "jacobian") & (frame["layer"] > 0)]
    assert from_pt[from_pt["layer"] > 0]["top_token_id"].tolist() == folder_rows["top_token_id"].tolist()

    table = tmp_path / "four_table.csv"
    assert main(["eval-lens", "--model", str(files / "model"), "--data", str(files / "heldout"), "--tokens", "160", "--ctx", "16",
                 "--table", str(table), "--quiet", *(x for s in specs[1:] for x in ("--lens", s))]) == 0
    capsys.readouterr()
    tidy = pd.read_csv(table)
    assert tidy["lens"].unique().tolist() == ["logit", "tuned", "jacobian", "patchscope"]
    windows = load_token_stream([files / "heldout"], model.tokenizer).windows(16)[:10]
    want = side_by_side(evaluate_windows(model, {"logit": LogitLens(model), "tuned": TunedLens.load(files / "tuned", model),
                                                 "jacobian": JacobianLens.load(tmp_path / "jlens", model),
                                                 "patchscope": Patchscope(model, prompt)}, windows, progress=False))
    assert tidy["kl"].to_numpy() == pytest.approx(want["kl"].to_numpy(), rel=1e-5)
    assert tidy["top1_agree"].to_numpy() == pytest.approx(want["top1_agree"].to_numpy(), rel=1e-6)
