"""The embedded default model: loads in both lenskit and transformers, has learned Python, and its card is true."""

from __future__ import annotations

import ast
import json
import platform
import textwrap
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
    # In the stdlib, `def __init__(self` sits inside a class body, so the model sees it indented.
    out = default_model.to_string(default_model.generate("    def __init__(self", max_new_tokens=24))[0]
    signature, body = out.split("\n", 1)
    # The model closes the signature itself, and the body it starts is indented deeper and uses self.
    assert signature.rstrip().endswith("):"), out
    ast.parse(textwrap.dedent(signature) + "\n    pass\n")
    assert body.startswith(" " * 8) and "self" in body, out


def test_greedy_generation_from_a_bare_prompt_is_a_parameter_list(default_model):
    prompt = "def __init__(self"
    out = default_model.to_string(default_model.generate(prompt, max_new_tokens=12))[0]
    continuation = out[len(prompt):].split("\n", 1)[0]
    # Whatever the model writes next is more parameters: cut at the last comma, close the signature, parse.
    head = prompt + continuation[: continuation.rfind(",")] if "," in continuation else out.split("\n", 1)[0]
    assert continuation.startswith((",", ")")), out
    ast.parse((head if head.rstrip().endswith(":") else head + "):") + "\n    pass\n")


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
