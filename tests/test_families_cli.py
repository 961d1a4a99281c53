"""Every CLI command on a tiny random Llama, Pythia, Qwen 3, Gemma 2 and OLMo 2 folder (with a tokenizer), in-process."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import make_hf_family
from lens_fixtures import write_text_folder
from lenses.cli import main
from lenskit import HookedTransformer
from tiny_tokenizer import VOCAB, make_tokenizer

PROMPT = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module", params=["llama", "gpt_neox", "qwen3", "gemma2", "olmo2"])
def folder(request, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp(request.param)
    make_hf_family(request.param, vocab_size=VOCAB, max_position_embeddings=128).save_pretrained(root / "model")
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


def test_ablate_a_head(folder, tmp_path, capsys):
    csv = tmp_path / "ablate.csv"
    assert main(["ablate", PROMPT, "--model", str(folder / "model"), "--head", "0.0", "--csv", str(csv)]) == 0
    assert len(pd.read_csv(csv)) > 0


def test_info(folder, capsys):
    assert main(["info", "--model", str(folder / "model")]) == 0
    out = capsys.readouterr().out
    model = HookedTransformer.from_pretrained(folder / "model")
    assert f"{sum(p.numel() for p in model.parameters()):,}" in out
    if model.cfg.family == "gemma2":
        assert "norm_placement=sandwich scale_embed query_pre_attn_scalar=24 attn_softcap=1 final_softcap=2" in out
