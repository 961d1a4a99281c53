"""The embedded default model: loads in both lenskit and transformers, has learned Python, and its card is true."""

from __future__ import annotations

import ast
import json
import platform
import sys
from pathlib import Path

import pytest
import torch
import transformers

import lenskit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))


def test_layout_and_size(default_model_path):
    names = {p.name for p in default_model_path.iterdir()}
    assert {"config.json", "model.safetensors", "vocab.json", "merges.txt", "tokenizer.json", "README.md"} <= names
    size = sum(p.stat().st_size for p in default_model_path.iterdir())
    assert size <= 20 * 2**20, f"the embedded model folder is {size / 2**20:.1f} MiB; the budget is 20 MiB"
    assert lenskit.ModelConfig.from_json(default_model_path / "config.json").n_layers >= 6


def test_transformers_and_lenskit_agree(default_model, default_model_path):
    hf = transformers.GPT2LMHeadModel.from_pretrained(default_model_path).eval()
    tokens = default_model.to_tokens(["def __init__(self, name):\n    self.name = name", "import os\nimport sys\n\n\nde"])
    with torch.no_grad():
        diff = (hf(tokens).logits - default_model(tokens)).abs().max().item()
    assert diff <= 1e-4


def test_greedy_generation_is_plausible_python(default_model):
    prompt = "def __init__(self"
    out = default_model.to_string(default_model.generate(prompt, max_new_tokens=24))[0]
    signature = out.split("\n", 1)[0]
    # The model must close the signature itself; the completed def, given a body, must parse as Python.
    assert signature.startswith(prompt) and signature.rstrip().endswith(":"), out
    ast.parse(signature + "\n    pass\n")
    assert "self" in out[len(signature):], f"no use of self in the body: {out!r}"


@pytest.mark.slow
def test_card_loss_is_measured_and_far_below_unigram(default_model_path):
    from evaluate_default_model import measure

    recorded = json.loads((default_model_path / "evaluation.json").read_text())
    card = (default_model_path / "README.md").read_text()
    assert f"{recorded['heldout_loss']:.4f}" in card
    assert recorded["heldout_loss"] < 0.5 * recorded["unigram_entropy"]
    if recorded["python"] != platform.python_version():
        pytest.skip(f"the card was measured on Python {recorded['python']}; this is {platform.python_version()}")
    again = measure(default_model_path, max_windows=None)
    assert again["heldout_tokens"] == recorded["heldout_tokens"]
    assert abs(again["heldout_loss"] - recorded["heldout_loss"]) < 2e-4
    assert abs(again["unigram_entropy"] - recorded["unigram_entropy"]) < 2e-4
