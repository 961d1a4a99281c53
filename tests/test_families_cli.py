"""Every CLI command on a tiny random folder (with a tokenizer) of every family in tests/families.py, in-process;
and one command on a family's hub name resolved through a local Hugging Face cache."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from families import FAMILY_BUILDERS
from lens_fixtures import write_text_folder
from tiny_tokenizer import VOCAB, make_tokenizer

from lenses.cli import main
from lenskit import HookedTransformer

PROMPT = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module", params=list(FAMILY_BUILDERS))
def folder(request, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp(request.param)
    FAMILY_BUILDERS[request.param](VOCAB).save_pretrained(root / "model")
    make_tokenizer().save_pretrained(str(root / "model"))
    write_text_folder(root / "train", n=30, seed=0)
    return root


def test_lens_command(folder, tmp_path, capsys):
    csv = tmp_path / "lens.csv"
    assert main(["lens", PROMPT, "--model", str(folder / "model"), "--csv", str(csv)]) == 0
    table = pd.read_csv(csv, keep_default_na=False)
    model = HookedTransformer.from_pretrained(folder / "model")
    tokens = model.to_tokens(PROMPT)
    assert sorted(table.layer.unique()) == list(range(model.cfg.n_layers + 1))
    # The last stream's top token is the model's own greedy prediction at every position.
    last = table[table.layer == model.cfg.n_layers].sort_values("position")
    with torch.no_grad():
        want = model(tokens)[0].argmax(-1).tolist()
    assert last.top_token_id.tolist() == want


def test_train_lens_two_steps(folder, tmp_path):
    out = tmp_path / "lens"
    assert main(["train-lens", "--model", str(folder / "model"), "--data", str(folder / "train"), "--out", str(out),
                 "--steps", "2", "--tokens-per-step", "64", "--ctx", "16", "--quiet"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "lens.safetensors"]


def test_eval_lens_and_lens_with_a_tuned_lens(folder, tmp_path, capsys):
    out, csv = tmp_path / "lens", tmp_path / "eval.csv"
    assert main(["train-lens", "--model", str(folder / "model"), "--data", str(folder / "train"), "--out", str(out),
                 "--steps", "2", "--tokens-per-step", "64", "--ctx", "16", "--quiet"]) == 0
    assert main(["eval-lens", "--model", str(folder / "model"), "--lens", str(out), "--data", str(folder / "train"),
                 "--tokens", "128", "--ctx", "16", "--csv", str(csv), "--quiet"]) == 0
    table = pd.read_csv(csv)
    model = HookedTransformer.from_pretrained(folder / "model")
    assert table.layer.tolist() == list(range(model.cfg.n_layers + 1))
    assert table.kl_logit.iloc[-1] == pytest.approx(0, abs=1e-5) and table.kl_tuned.iloc[-1] == pytest.approx(0, abs=1e-5)
    lens_csv = tmp_path / "tuned.csv"
    assert main(["lens", PROMPT, "--model", str(folder / "model"), "--lens", str(out), "--csv", str(lens_csv)]) == 0
    assert sorted(pd.read_csv(lens_csv).layer.unique()) == list(range(model.cfg.n_layers + 1))


def test_lens_on_a_hub_name_in_the_local_cache(tmp_path, monkeypatch, capsys):
    """`--model Qwen/Qwen3-0.6B` with the snapshot in the HF cache and the hub offline."""
    snapshot = tmp_path / "cache" / "models--Qwen--Qwen3-0.6B" / "snapshots" / ("0" * 40)
    FAMILY_BUILDERS["qwen3"](VOCAB).save_pretrained(snapshot)
    make_tokenizer().save_pretrained(str(snapshot))
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    csv = tmp_path / "lens.csv"
    assert main(["lens", PROMPT, "--model", "Qwen/Qwen3-0.6B", "--csv", str(csv)]) == 0
    model = HookedTransformer.from_pretrained(snapshot)
    assert model.cfg.family == "qwen3"
    last = pd.read_csv(csv).query(f"layer == {model.cfg.n_layers}").sort_values("position")
    with torch.no_grad():
        assert last.top_token_id.tolist() == model(model.to_tokens(PROMPT))[0].argmax(-1).tolist()


def test_ablate_a_head(folder, tmp_path, capsys):
    """A head of the first block with heads; a linear-attention block (Qwen 3.5) or a Mamba-2 one (Nemotron-H, Granite 4) has none,
    and says so."""
    csv = tmp_path / "ablate.csv"
    cfg = HookedTransformer.from_pretrained(folder / "model").cfg
    layer = next(l for l in range(cfg.n_layers) if cfg.has_heads(l))
    assert main(["ablate", PROMPT, "--model", str(folder / "model"), "--head", f"{layer}.0", "--csv", str(csv)]) == 0
    assert len(pd.read_csv(csv)) > 0
    if not cfg.has_heads(0):
        assert main(["ablate", PROMPT, "--model", str(folder / "model"), "--head", "0.0"]) == 2
        assert "has no attention heads" in capsys.readouterr().err  # linear attention, Mamba-2


@pytest.mark.parametrize("mode", ["zero", "reroute"])
def test_ablate_an_expert(folder, tmp_path, capsys, mode):
    """A MoE family's expert, by the CLI, scores as the library's expert ablation does; a dense family refuses."""
    from lenses.compare import compare_runs, output_summary
    from lenskit.intervene.experts import Expert, expert_ablation_hooks

    model = HookedTransformer.from_pretrained(folder / "model")
    layer = next((l for l in range(model.cfg.n_layers) if model.cfg.is_moe_layer(l)), None)
    csv = tmp_path / "ablate.csv"
    args = ["ablate", PROMPT, "--model", str(folder / "model"), "--expert", f"{layer or 0}.1", "--expert-mode", mode,
            "--csv", str(csv)]
    if layer is None:
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "has no experts (a dense model)" in err and len(err.strip().splitlines()) == 1, err
        return
    assert main(args) == 0
    got = pd.read_csv(csv)
    hooks = expert_ablation_hooks(model, [Expert(layer, 1)], mode)
    want = output_summary(compare_runs(model, model.to_tokens(PROMPT), hooks))
    assert got["ablated_loss"].tolist() == pytest.approx(want["ablated_loss"].tolist(), abs=1e-6)
    assert f"ablated expert {layer}.1 (experts {mode})" in capsys.readouterr().out


def test_info(folder, capsys):
    assert main(["info", "--model", str(folder / "model")]) == 0
    out = capsys.readouterr().out
    model = HookedTransformer.from_pretrained(folder / "model")
    assert f"{sum(p.numel() for p in model.parameters()):,}" in out
    if model.cfg.family == "gemma2":
        assert "norm_placement=sandwich scale_embed query_pre_attn_scalar=24 attn_softcap=1 final_softcap=2" in out
