"""The embedded models (`stdlib-gpt2`, the default, and `stdlib-llama`): each loads in both lenskit and its
transformers class, has learned Python, and its card is true."""

from __future__ import annotations

import ast
import json
import platform
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers

import lenskit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))


EMBEDDED = pytest.mark.parametrize("name", sorted(lenskit.EMBEDDED_MODELS))


def embedded(name: str) -> Path:
    path = Path(lenskit.EMBEDDED_MODELS[name])
    if not (path / "model.safetensors").exists():
        pytest.fail(f"the embedded model {name} is missing at {path}; run experiments/train_default_model.py")
    return path


@EMBEDDED
def test_layout_and_size(name):
    path = embedded(name)
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "vocab.json", "merges.txt", "tokenizer.json", "README.md",
            "training.json", "evaluation.json"} <= names
    size = sum(p.stat().st_size for p in path.iterdir())
    assert size <= 20 * 2**20, f"the embedded model folder is {size / 2**20:.1f} MiB; the budget is 20 MiB"
    assert lenskit.ModelConfig.from_json(path / "config.json").n_layers >= 6


@EMBEDDED
def test_transformers_and_lenskit_agree(name):
    """Parity with the family's own transformers class (GPT2LMHeadModel, LlamaForCausalLM), loading the shipped folder."""
    from lenskit.families import family_of

    path = embedded(name)
    model = lenskit.HookedTransformer.from_pretrained(name)
    hf_class = getattr(transformers, family_of(model.cfg.family).hf_class)
    hf = hf_class.from_pretrained(path).eval()
    tokens = model.to_tokens(["def __init__(self, name):\n    self.name = name", "import os\nimport sys\n\n\nde"])
    with torch.no_grad():
        diff = (hf(tokens).logits - model(tokens)).abs().max().item()
    assert diff <= 1e-4


def test_the_two_share_tokenizer_and_budget():
    gpt2, llama = (json.loads((embedded(n) / "training.json").read_text()) for n in ("stdlib-gpt2", "stdlib-llama"))
    for key in ("corpus", "tokenizer", "steps", "batch", "ctx", "tokens_seen", "lr", "seed"):
        assert gpt2[key] == llama[key], key
    for f in ("vocab.json", "merges.txt"):
        assert (embedded("stdlib-gpt2") / f).read_bytes() == (embedded("stdlib-llama") / f).read_bytes(), f
    assert abs(llama["params"] - gpt2["params"]) <= 0.05 * gpt2["params"]
    cfg = lenskit.ModelConfig.from_json(embedded("stdlib-llama") / "config.json")
    assert (cfg.family, cfg.norm, cfg.mlp, cfg.positional, cfg.n_heads, cfg.n_kv_heads) == ("llama", "rmsnorm", "swiglu", "rotary", 6, 2)


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


def recorded_card(name: str) -> dict:
    """evaluation.json, after checking that the card shows what it holds; skips where the card's Python differs."""
    from evaluate_default_model import write_card

    path = embedded(name)
    recorded = json.loads((path / "evaluation.json").read_text())
    card = (path / "README.md").read_text()
    assert card == write_card(path, recorded, json.loads((path / "training.json").read_text()))
    assert recorded["heldout_loss"] < 0.5 * recorded["unigram_entropy"]
    assert recorded["unseen_loss"] < recorded["unseen_unigram_entropy"]
    if recorded["python"] != platform.python_version():
        pytest.skip(f"the card was measured on Python {recorded['python']}; this is {platform.python_version()}")
    return recorded


@EMBEDDED
def test_card_shows_evaluation_json_and_its_completions_are_generated_again(name):
    """The cheap part of the card, in the fast tiers: its text is evaluation.json's, and the greedy completions
    (3 x 24 tokens) are what the model generates now; the losses are measured again under `slow`."""
    from evaluate_default_model import completions

    recorded = recorded_card(name)
    assert completions(lenskit.HookedTransformer.from_pretrained(embedded(name))) == recorded["completions"]


@pytest.mark.slow  # about 3 minutes per model: every held-out and unseen window
@EMBEDDED
def test_card_is_measured_again(name):
    """Every number on the card, measured again: held-out and unseen-package losses, unigram entropies, and
    the greedy completions; and the card shows what evaluation.json holds."""
    from evaluate_default_model import measure

    path = embedded(name)
    recorded = recorded_card(name)
    again = measure(path, max_windows=None)
    assert again["heldout_tokens"] == recorded["heldout_tokens"]
    for key in ("heldout_loss", "unigram_entropy"):
        assert abs(again[key] - recorded[key]) < 2e-4, key
    assert again["completions"] == recorded["completions"]
    if again["unseen_package"] == recorded["unseen_package"]:  # another installed version is other text
        for key in ("unseen_loss", "unseen_unigram_entropy"):
            assert abs(again[key] - recorded[key]) < 2e-4, key


def test_the_training_script_builds_the_sibling_it_promises():
    """`--arch llama`: the SwiGLU width whose tied Llama is nearest the GPT-2's parameter count, GQA 6/2."""
    import argparse

    from train_default_model import model_config

    args = argparse.Namespace(layers=6, d_model=192, heads=6, ctx=256, name=None, kv_heads=2, d_mlp=None)
    gpt2 = model_config(argparse.Namespace(**vars(args), arch="gpt2"), 4096, 0)
    llama = model_config(argparse.Namespace(**vars(args), arch="llama"), 4096, 0)
    count = lambda cfg: sum(p.numel() for p in lenskit.HookedTransformer(cfg).parameters())  # noqa: E731
    assert count(gpt2) == 3_505_152
    assert abs(count(llama) - count(gpt2)) <= 0.05 * count(gpt2)
    for wider in (llama.d_mlp - 8, llama.d_mlp + 8):  # the nearest multiple of 8
        assert abs(count(llama) - count(gpt2)) <= abs(count(llama.replace(d_mlp=wider)) - count(gpt2))
    assert (llama.family, llama.n_kv_heads, llama.tie_word_embeddings) == ("llama", 2, True)
    assert llama == lenskit.ModelConfig.from_json(Path(lenskit.EMBEDDED_MODELS["stdlib-llama"]) / "config.json",
                                                  name=llama.name)
